"""The chunked pieces' CPU thread count (:mod:`hf_fpdt.attention.threads`, issue 43 item 5): decided once from the
process's affinity, its cgroup's CPU quota and ``LOCAL_WORLD_SIZE`` (or ``FPDTConfig.cpu_threads``); scopes that give
torch its count back at every exit (a backward that raises, one that stops early); results that do not depend on
the count (1 and 2 threads: the same bits)."""

from __future__ import annotations

import logging

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import chunked
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.threads import CpuShare, CpuThreads, cgroup_cpus


@pytest.mark.parametrize(
    ("affinity", "quota", "processes", "want"),
    [
        (2, None, 1, 2),  # this machine: both cores
        (64, 4.0, 1, 4),  # a quota pod on a big host: the quota, not the host's cores
        (64, 2.5, 1, 2),  # whole CPUs of the quota
        (64, 0.5, 1, 1),  # at least one
        (4, 16.0, 1, 4),  # a cpuset narrower than the quota: the cpuset
        (16, None, 4, 4),  # four processes of a node: a quarter each (torchrun / accelerate launch)
        (2, None, 4, 1),  # more processes than cores: one each
        (64, 8.0, 2, 4),  # quota and processes together
    ],
)
def test_auto_is_the_process_share_of_the_cpus(affinity, quota, processes, want):
    assert CpuShare(affinity, quota, processes).threads == want


def _cgroup_tree(tmp_path, proc_lines: str, files: dict[str, str]):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(proc_lines)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(proc), str(root)


def test_cgroup_quota_v2_v1_and_none(tmp_path):
    # v2: the smallest quota of the group and its ancestors ("max": no limit)
    proc, root = _cgroup_tree(
        tmp_path / "v2",
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "300000 100000\n",
            "kubepods/pod1/ctr/cpu.max": "450000 100000\n",
        },
    )
    assert cgroup_cpus(proc, root) == 3.0
    # v2 inside a container: the group's folder is the mount's root
    proc, root = _cgroup_tree(tmp_path / "v2root", "0::/some/host/path\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpus(proc, root) == 1.5
    # v1: the cpu controller's cfs quota and period (-1: no limit)
    proc, root = _cgroup_tree(
        tmp_path / "v1",
        "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpus(proc, root) == 2.0
    proc, root = _cgroup_tree(
        tmp_path / "v1none",
        "3:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpus(proc, root) is None
    assert cgroup_cpus(str(tmp_path / "nowhere"), root) is None  # no /proc/self/cgroup: no limit found


def test_the_count_is_decided_once_and_auto_only_lowers(monkeypatch):
    share = CpuShare(affinity=4, quota=None, processes=2)
    threads = CpuThreads("auto", share)
    assert threads.threads == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert threads.count() == 2 and "torch.set_num_threads(2)" in threads.describe()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # OMP_NUM_THREADS=1 (torchrun's default): kept
    assert threads.count() == 1
    assert CpuThreads(3).count() == 3 and CpuThreads(3).describe() == "cpu_threads 3 (set)"


def test_runtime_takes_the_config_setting(monkeypatch):
    assert FPDTRuntime(FPDTConfig(cpu_threads=1)).threads.threads == 1
    monkeypatch.setenv("FPDT_CPU_THREADS", "3")
    assert FPDTRuntime(FPDTConfig()).threads.threads == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    monkeypatch.delenv("FPDT_CPU_THREADS")
    assert FPDTRuntime(FPDTConfig()).threads.threads == 1  # auto: more processes than cores: one each


def test_scope_sets_and_restores_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    calls = [before]  # torch's count is the last one set (patched: the test must not change the process's)
    monkeypatch.setattr(torch, "get_num_threads", lambda: calls[-1])
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = CpuThreads(before + 1)  # differs from torch's, so the scope must set it and set torch's back
    with threads.scope(torch.device("cpu")):
        with threads.scope(torch.device("cpu")):  # nested: keeps the outer scope's
            pass
    assert calls == [before, before + 1, before]
    del calls[1:]
    with threads.scope(torch.device("meta")):  # not a CPU (a GPU): nothing changes
        with threads.scope(torch.device("cpu")):
            pass
    assert calls == [before]
    with pytest.raises(RuntimeError, match="inside"), threads.scope(torch.device("cpu")):
        raise RuntimeError("inside the scope")
    assert calls == [before, before + 1, before]


def _other_count() -> int:
    """A count that differs from torch's (so a scope must change it and give it back)."""
    return 2 if torch.get_num_threads() == 1 else 1


def test_a_backward_that_raises_inside_the_scope_leaves_torchs_count(monkeypatch):
    outer, inner = torch.get_num_threads(), _other_count()
    runtime = FPDTRuntime(FPDTConfig(chunk_size=8, offload=False, cpu_threads=inner))
    q, k, v = (torch.randn(1, 24, 2, 8, requires_grad=True) for _ in range(3))
    out = fpdt_attention(q, k, v, runtime)
    assert torch.get_num_threads() == outer
    seen = []

    def failing(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise RuntimeError("backward failed inside the scope")

    monkeypatch.setattr(chunked, "chunked_attention_backward", failing)
    with pytest.raises(RuntimeError, match="backward failed inside the scope"):
        out.sum().backward()
    assert seen == [inner] and torch.get_num_threads() == outer


def test_a_step_runs_its_pieces_with_the_count_and_gives_torchs_back(monkeypatch):
    """A training step of an applied model: the attention's forward and backward and the tiles' forwards run with
    ``cpu_threads``; between them, after a full backward and after one that stops early, torch's count."""
    outer, inner = torch.get_num_threads(), _other_count()
    model = hf_fpdt.apply(tiny_model("tiny-llama"), FPDTConfig(chunk_size=8, mlp_chunks=2, cpu_threads=inner))
    seen: dict[str, set] = {"attention": set(), "attention backward": set(), "outside": set()}
    forward, backward = chunked.chunked_attention_forward, chunked.chunked_attention_backward

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].add(torch.get_num_threads())
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(chunked, "chunked_attention_forward", record("attention", forward))
    monkeypatch.setattr(chunked, "chunked_attention_backward", record("attention backward", backward))
    model.model.embed_tokens.register_forward_hook(lambda *a: seen["outside"].add(torch.get_num_threads()))
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    out = model(input_ids=ids, labels=ids)
    assert torch.get_num_threads() == outer
    out.loss.backward()
    assert torch.get_num_threads() == outer
    assert seen == {"attention": {inner}, "attention backward": {inner}, "outside": {outer}}
    # a backward that stops early (the gradient of the last hidden states only): torch's count after it
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.autograd.grad(hidden[-1].sum(), hidden[-2])
    assert torch.get_num_threads() == outer


def test_the_plan_line_names_the_count(caplog):
    model = hf_fpdt.apply(tiny_model("tiny-llama"), FPDTConfig(chunk_size=8, cpu_threads=1))
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert any("hf_fpdt plan:" in r.getMessage() and "cpu_threads 1 (set)" in r.getMessage() for r in caplog.records)


def _step(cpu_threads: int) -> dict[str, torch.Tensor]:
    model = hf_fpdt.apply(
        tiny_model("tiny-llama"), FPDTConfig(chunk_size=16, mlp_chunks=3, loss_chunks=3, cpu_threads=cpu_threads)
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def test_the_result_does_not_depend_on_the_count():
    """One and two threads inside the chunked pieces: the same loss and gradients, bit for bit (fp32)."""
    one, two = _step(1), _step(2)
    assert one.keys() == two.keys()
    differ = [name for name in one if not torch.equal(one[name], two[name])]
    assert not differ, f"1 vs 2 threads differ in {differ}"
