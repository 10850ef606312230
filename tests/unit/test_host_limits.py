"""What the host really has: RAM, ``RLIMIT_AS`` and the cgroup limit, and the planner's use of them.

The planner compares the step's predicted host peak (not only the bytes kept across layers) with the smallest of
the three, per local process, and a step that cannot fit is refused before it allocates, with the numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.bench.__main__ import main as bench_main
from hf_fpdt.config import format_bytes
from hf_fpdt.integrations import step_plan
from hf_fpdt.memory import probes
from hf_fpdt.memory.planner import HOST_MARGIN_FIXED, host_margin, plan

GIB = 1 << 30
HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_is_the_smallest_over_the_group_and_its_ancestors(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    _write(proc / "self" / "cgroup", "0::/job/step\n")
    _write(root / "memory.max", "max\n")
    _write(root / "job" / "memory.max", str(4 * GIB))  # the job's limit binds
    _write(root / "job" / "memory.current", str(GIB))
    _write(root / "job" / "memory.stat", f"anon 123\ninactive_file {GIB // 2}\n")  # droppable page cache
    _write(root / "job" / "step" / "memory.max", "max\n")
    _write(root / "job" / "step" / "memory.current", str(GIB // 4))
    assert probes.cgroup_available(str(proc), str(root)) == 4 * GIB - GIB // 2
    _write(root / "job" / "step" / "memory.max", str(2 * GIB))  # now the step's own limit is smaller
    assert probes.cgroup_available(str(proc), str(root)) == 2 * GIB - GIB // 4


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    _write(proc / "self" / "cgroup", "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert probes.cgroup_available(str(proc), str(root)) is None
    _write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", str(2 * GIB))
    _write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", str(GIB))
    _write(root / "memory" / "docker" / "abc" / "memory.stat", f"cache 1\ntotal_inactive_file {GIB // 4}\n")
    assert probes.cgroup_available(str(proc), str(root)) == GIB + GIB // 4
    assert probes.cgroup_available(str(tmp_path / "none"), str(root)) is None  # unreadable: no limit known


def test_the_smallest_limit_per_local_process_and_its_source():
    limits = probes.HostLimits(ram=16 * GIB, address_space=3 * GIB, cgroup=10 * GIB)
    assert limits.per_process(1) == (3 * GIB, limits.per_process(1)[1])
    assert "RLIMIT_AS" in limits.per_process(1)[1]  # the process's own limit, not shared
    nbytes, source = limits.per_process(4)  # RAM and cgroup are shared by the node's 4 processes
    assert nbytes == 10 * GIB // 4 and "cgroup" in source and "4 local processes" in source
    nbytes, source = probes.HostLimits(ram=8 * GIB, address_space=None, cgroup=None).per_process(2)
    assert nbytes == 4 * GIB and "MemAvailable" in source


def test_under_rlimit_as_the_threads_address_space_comes_off_the_limit():
    """Each thread beyond the first may map an arena (glibc: 64 MiB) and a stack in the step: RLIMIT_AS counts
    them, RAM and the cgroup (resident memory) do not."""
    one = probes.HostLimits(ram=64 * GIB, address_space=3 * GIB, cgroup=None, threads=1).per_process(1)
    assert one[0] == 3 * GIB and "less" not in one[1]
    nbytes, source = probes.HostLimits(ram=64 * GIB, address_space=3 * GIB, cgroup=None, threads=4).per_process(1)
    assert nbytes == 3 * GIB - 3 * probes.THREAD_ADDRESS_SPACE
    assert (
        "RLIMIT_AS" in source and f"less {format_bytes(3 * probes.THREAD_ADDRESS_SPACE)} for 3 more threads'" in source
    )
    resident = probes.HostLimits(ram=2 * GIB, address_space=None, cgroup=GIB, threads=16).per_process(1)
    assert resident[0] == GIB and "cgroup" in resident[1]  # no thread share off a resident limit
    assert probes.host_limits().threads == torch.get_num_threads()


def test_the_plan_checks_the_host_peak_with_its_margin_and_says_both():
    settings = dict(device="cpu", dtype="fp32", chunk_size=4096, optimizer=False, host_memory="unlimited")
    free = plan("small-llama", 8192, search_longest=False, **settings)
    assert free.host_margin == host_margin(free.peak) > HOST_MARGIN_FIXED  # a share of the step's growth
    need = free.host_need + free.host_margin
    roomy = need + 3 * free.replay_per_layer  # (keeping every layer is decided with a layer's chunks spare)
    at = plan("small-llama", 8192, host_capacity=(roomy, "RAM available (test)"), **settings)
    assert at.fits and at.replay_layers == free.replay_layers
    line = f"host peak {format_bytes(at.host_need)} + margin {format_bytes(at.host_margin)} of {format_bytes(roomy)}"
    assert line in at.describe()
    for capacity in range(need - 3 * free.replay_per_layer, roomy, free.replay_per_layer // 4):
        p = plan("small-llama", 8192, host_capacity=(capacity, "RAM available (test)"), **settings)
        assert p.fits == (p.host_need + p.host_margin <= capacity)  # what fits leaves the margin free
        assert p.fits or p.replay_layers == 0  # layers recompute before the step is refused
    none = plan("small-llama", 8192, host_capacity=(free.host_need, "RAM available (test)"), **settings)
    assert not none.fits and any("+ margin" in problem for problem in none.problems)  # the tensors alone fit
    assert none.longest and plan("small-llama", none.longest, host_capacity=(free.host_need, "t"), **settings).fits
    gpu = plan("llama-3.1-8b", 262144, lora_rank=16, device_memory="80GiB", host_memory="unlimited")
    assert gpu.host_margin == HOST_MARGIN_FIXED  # a GPU step's host tier: the fixed part (not yet measured)


def test_auto_host_memory_takes_the_smallest_limit(monkeypatch):
    monkeypatch.setattr(probes, "host_limits", lambda: probes.HostLimits(64 * GIB, 3 * GIB, None))
    assert probes.auto_host_memory(1) == int(probes.AUTO_HOST_SHARE * 3 * GIB)
    monkeypatch.setattr(probes, "host_limits", lambda: probes.HostLimits(64 * GIB, None, 8 * GIB))
    assert probes.auto_host_memory(2) == int(probes.AUTO_HOST_SHARE * 4 * GIB)


def _limit_over_imports(env: dict, room: int = 3 * GIB) -> int:
    """An ``RLIMIT_AS`` that leaves ``room`` beyond what importing torch, transformers and hf_fpdt maps: a fixed 3 GiB
    is less than torch's CUDA wheels map at import on a CPU machine (torch 2.14.1+cu130: OpenBLAS then cannot start
    its threads), so the limit follows the installed torch."""
    code = (
        "import torch, transformers, hf_fpdt; from hf_fpdt.memory import probes; "
        "print(probes.meminfo_status()['VmSize'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1]) + room


@pytest.mark.multiprocess
def test_address_space_limit_is_read_in_a_limited_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_WORLD_SIZE": "1"}
    limit = _limit_over_imports(env)
    code = (
        f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
        "from hf_fpdt.memory import probes; import hf_fpdt.memory.planner as pl; "
        "left = probes.address_space_available(); mapped = probes.meminfo_status()['VmSize']; "
        "p = pl.plan('small-llama', 1 << 20, device='cpu', host_capacity='auto', host_memory='auto'); "
        "print(left, mapped, int(p.fits), p.host_budget, p.longest); print(p.problems[-1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    numbers, problem = out.stdout.strip().splitlines()
    left, mapped, fits, budget, longest = (int(x) for x in numbers.split())
    assert abs(left + mapped - limit) < 64 << 20  # the soft limit less what is mapped (it moves a little)
    assert not fits and "RLIMIT_AS" in problem  # not MemAvailable: the limit that binds
    assert budget <= probes.AUTO_HOST_SHARE * limit  # host_memory="auto" takes the limit too
    assert 0 < longest < 1 << 20


def test_a_step_larger_than_the_host_does_not_fit_and_the_longest_is_bounded():
    cap = (16 * GIB, "RAM available (test)")  # weights, Adam's states and every gradient take 12.3 GiB
    unchecked = plan("llama-1b", 131072, device="cpu", host_memory="unlimited")
    assert unchecked.fits and unchecked.host_need > cap[0]  # the kept bytes alone said "fits"
    p = plan("llama-1b", 131072, device="cpu", host_memory="unlimited", host_capacity=cap)
    assert not p.fits and not p.host_fits
    assert any("host peak" in problem and "RAM available (test)" in problem for problem in p.problems)
    assert "more host memory for the process" in p.error()
    assert p.longest and p.longest < 131072
    at_longest = plan("llama-1b", p.longest, device="cpu", host_memory="unlimited", host_capacity=cap)
    assert at_longest.fits and at_longest.host_need <= cap[0]
    beyond = plan("llama-1b", p.longest + 4096, device="cpu", host_memory="unlimited", host_capacity=cap)
    assert not beyond.fits


def test_the_kept_replay_chunks_shrink_to_what_the_host_has():
    free = plan("llama-1b", 65536, device="cpu", host_memory="unlimited")
    assert free.replay_layers == free.layers
    cap = (free.host_need + free.host_margin - 3 * free.replay_per_layer, "test")  # the margin is checked too
    p = plan("llama-1b", 65536, device="cpu", host_memory="unlimited", host_capacity=cap)
    assert p.fits and p.replay_layers < free.layers and p.host_need + p.host_margin <= cap[0]  # recompute some, fit


def test_a_gpu_plan_checks_the_host_tier_against_the_host():
    settings = dict(lora_rank=16, device_memory="80GiB", resident_memory=0, host_memory="unlimited")
    p = plan("llama-3.1-8b", 262144, **settings)
    assert p.fits and p.host_need == sum(p.host.values()) and p.replay_layers == p.layers
    half = plan("llama-3.1-8b", 262144, host_capacity=(p.host_need // 2, "test"), **settings)
    assert half.fits and half.replay_layers < p.layers and half.host_need <= p.host_need // 2  # recompute more
    inputs = p.layers * p.layer_input
    small = plan("llama-3.1-8b", 262144, host_capacity=(inputs // 2, "test"), **settings)
    assert not small.fits and any("host peak" in problem for problem in small.problems)


def _tiny_model():
    return hf_fpdt.apply(tiny_model("tiny-llama"), hf_fpdt.FPDTConfig(chunk_size=32))


def test_the_step_is_refused_before_it_allocates(monkeypatch):
    model = _tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(1))
    monkeypatch.setattr(step_plan, "host_limits", lambda: probes.HostLimits(1 << 20, None, None))
    ids = torch.randint(0, 512, (1, 256))
    with pytest.raises(ValueError, match=r"host peak .*RAM available"):
        model(input_ids=ids, labels=ids)
    assert not ran  # before the first layer
    monkeypatch.setattr(step_plan, "host_limits", lambda: probes.HostLimits(64 * GIB, None, None))
    model(input_ids=ids, labels=ids).loss.backward()
    assert ran


@pytest.mark.multiprocess
def test_under_a_tight_rlimit_as_the_step_is_refused_or_runs_never_crashes():
    """The issue's case: small-llama at 8192 tokens under RLIMIT_AS = VmSize + 200 MiB once planned "fits" (the
    tensors, 257.7 MiB with the weights) and died in backward (DefaultCPUAllocator: can't allocate memory). With
    the margin it is refused before the first layer; a limit just above the plan's growth, margin and threads'
    address space runs the step."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_WORLD_SIZE": "1"}
    script = [sys.executable, str(ROOT / "tests" / "scripts" / "rlimit_step.py")]
    runs = [  # side by side: each limit is its process's own
        subprocess.Popen(script + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for args in ([f"+{200 << 20}", "8192"], [f"plan+{4 << 20}", "1024"])
    ]
    (tight, tight_err), (just, just_err) = (run.communicate(timeout=300) for run in runs)
    assert runs[0].returncode == 0, tight_err[-2000:]  # no allocator crash
    assert "REFUSED:" in tight and "+ margin" in tight and "RLIMIT_AS" in tight
    assert runs[1].returncode == 0 and "STEP RAN" in just, just + just_err[-2000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_rlimit_as_the_step_is_refused_with_the_numbers():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_WORLD_SIZE": "1"}
    run = [sys.executable, str(ROOT / "tests" / "scripts" / "rlimit_step.py"), str(_limit_over_imports(env))]
    refused = subprocess.run(run + ["1048576"], capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 0, refused.stderr[-2000:]
    assert "REFUSED:" in refused.stdout and "RLIMIT_AS" in refused.stdout and "longest that fits" in refused.stdout
    ran = subprocess.run(run + ["2048"], capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0 and "STEP RAN" in ran.stdout, ran.stderr[-2000:]


def test_bench_plan_says_when_a_length_does_not_fit(capsys):
    argv = ["plan", "--model", "llama-1b", "--device", "cpu", "--host-memory", "unlimited", "--seq-len"]
    assert bench_main(argv + ["4096,131072", "--host-capacity", "12GiB"]) == 1
    out = capsys.readouterr().out
    assert "host peak" in out and "exit code 1: 131072 tokens do not fit" in out
    assert bench_main(argv + ["4096", "--host-capacity", "12GiB"]) == 0
    assert "exit code" not in capsys.readouterr().out
    assert bench_main(argv + ["131072", "--host-capacity", "unlimited"]) == 0
