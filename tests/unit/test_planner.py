"""The planner: its numbers against what a CPU step really takes, its placement, the CLI.

The prediction test measures the peak resident-set growth of one training step in fresh processes
(glibc returns freed blocks of 64 KiB and more to the OS, so the resident set tracks live tensors;
a warm-up step at a short length first takes the lazy one-time allocations out of the measure) and
asks the plan of the same step to be within 15% of it.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from distributed import run_distributed
from testkit import tiny_model
from transformers import AutoConfig, PretrainedConfig

import hf_fpdt
from hf_fpdt.memory.planner import ModelShape, auto_host_memory, plan

# Layer terms dominate: hidden 256 at 2048 tokens, a small vocabulary (gradients, logits small).
SEQ, CHUNK = 2048, 512


def _config(layers: int) -> PretrainedConfig:
    return AutoConfig.for_model(
        "llama",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1 << 16,
    )


def _measured_and_planned(rank: int, world_size: int, cases: list) -> list[tuple[int, int, int]]:
    """(measured peak growth, planned peak, replay layers kept) of one step per ``(layers, host_memory, seq)``."""
    import gc

    import torch.distributed as dist

    from hf_fpdt.bench.common import PeakMemory
    from hf_fpdt.data.layout import shard_batch

    def batch(n: int) -> dict:
        ids = torch.randint(0, 2048, (1, n), generator=torch.Generator().manual_seed(n))
        return shard_batch(ids, ids.clone(), rank=rank, sp_size=world_size, chunk_size=CHUNK).model_kwargs()

    out = []
    for layers, host_memory, seq in cases:
        model = tiny_model(_config(layers), "sdpa")
        group = dist.group.WORLD if world_size > 1 else None
        hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, host_memory=host_memory), group=group)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model(**batch(2 * CHUNK)).loss.backward()  # warm-up: lazy one-time allocations
        for p in model.parameters():
            p.grad = None  # the measured step allocates its gradients
        model.fpdt.runtime.release()  # ... and its pooled chunk buffers
        model.fpdt.layer_offloader.release()
        inputs = batch(seq)
        with PeakMemory(torch.device("cpu")) as mem:
            model(**inputs).loss.backward()
        assert mem.how == "VmHWM growth"
        budget = model.fpdt.runtime.host_budget(torch.device("cpu"))
        p = plan(
            _config(layers), seq, sp_size=world_size, dtype="fp32", device="cpu", chunk_size=CHUNK, optimizer=False,
            host_memory="unlimited" if budget is None else budget, search_longest=False,
        )  # fmt: skip
        out.append((mem.bytes, p.peak, p.replay_layers))
        del model, inputs
        gc.collect()
    return out


def _budget_keeping(keep: int, layers: int, sp_size: int, seq: int = SEQ) -> int:
    full = plan(_config(layers), seq, sp_size=sp_size, dtype="fp32", device="cpu", host_memory="unlimited")
    return full.host_kept - (full.layers - keep - 1) * full.replay_per_layer


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plan_predicts_the_cpu_peak_within_15_percent(monkeypatch):
    """2 layers (no limit), 6 layers (the floor), and 6 layers on SP 2 with a budget keeping 3 of them."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the spawned processes inherit it
    one = run_distributed(_measured_and_planned, 1, [(2, "unlimited", SEQ), (6, 0, SEQ)], timeout=300)[0]
    # SP 2 at twice the length: the same tokens per rank as the one-process cases
    sp2 = run_distributed(_measured_and_planned, 2, [(6, _budget_keeping(3, 6, 2, 2 * SEQ), 2 * SEQ)], timeout=300)
    got = {"2 layers": one[0], "6 layers, floor": one[1]}
    got.update({f"6 layers, sp 2, rank {r}": x[0] for r, x in enumerate(sp2)})
    assert [kept for _, _, kept in got.values()] == [2, 0, 3, 3]
    for name, (measured, planned, _) in got.items():
        print(f"{name}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
        assert abs(planned - measured) <= 0.15 * measured, f"{name}: measured {measured}, planned {planned}"


# ---------------------------------------------------------------------------- arithmetic, no step run


def test_shape_counts_the_parameters_of_the_built_model():
    for layers in (2, 6):
        model = tiny_model(_config(layers), None, dtype=None, seed=None)
        assert ModelShape.from_config(_config(layers)).params == sum(p.numel() for p in model.parameters())


def test_placement_keeps_what_fits_and_refuses_what_cannot():
    cfg = _config(6)
    full = plan(cfg, SEQ, dtype="fp32", device="cpu", host_memory="unlimited")
    assert full.replay_layers == 6 and full.fits and full.replay_budget is None
    for keep in (0, 1, 3, 4):  # (keeping 5 of 6 costs what keeping 6 does: the 6th would recompute into the pool)
        p = plan(cfg, SEQ, dtype="fp32", device="cpu", host_memory=_budget_keeping(keep, 6, 1))
        assert (p.replay_layers, p.fits) == (keep, True)
        assert p.host_kept <= _budget_keeping(keep, 6, 1)  # what is kept stays within the budget
        assert p.replay_budget == keep * full.replay_per_layer
    floor = plan(cfg, SEQ, dtype="fp32", device="cpu", host_memory=0)
    assert floor.replay_layers == 0 and floor.fits  # the floor is never refused
    short = plan(cfg, SEQ, dtype="fp32", device="cpu", host_memory=_budget_keeping(0, 6, 1) - 1)
    assert not short.fits and "host_memory is" in short.error() and "shorter sequence" in short.error()
    assert short.longest is not None and short.longest < SEQ
    assert plan(cfg, short.longest, dtype="fp32", device="cpu", host_memory=short.host_budget).fits
    assert not plan(cfg, short.longest + 1, dtype="fp32", device="cpu", host_memory=short.host_budget).fits


def test_sp_shares_the_sequence_and_replicates_kv_heads():
    one = plan(_config(2), 4096, dtype="bf16", host_memory="unlimited")
    two = plan(_config(2), 4096, sp_size=2, dtype="bf16", host_memory="unlimited")
    assert two.local_len == 2048 and two.layer_input * 2 == one.layer_input
    assert two.replay_per_layer * 2 == one.replay_per_layer
    gqa = _config(2)
    gqa.num_key_value_heads = 1  # sp 2 > 1 KV head: each rank holds a replica
    assert (
        plan(gqa, 4096, sp_size=2, host_memory="unlimited").replay_per_layer
        > plan(gqa, 4096, sp_size=1, host_memory="unlimited").replay_per_layer // 2
    )


def test_auto_host_memory_is_shared_by_the_local_processes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = auto_host_memory()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert 0 < auto_host_memory() <= alone // 3  # 4 processes (RAM may move a little in between)


def test_bench_plan_cli_for_the_llama_3_1_8b_shape(capsys):
    from hf_fpdt.bench.__main__ import main

    argv = ["plan", "--model", "llama-3.1-8b", "--seq-len", "262144,1048576", "--host-memory", "128GiB"]
    assert main(argv + ["--device-memory", "80GiB"]) == 1  # 1M tokens does not fit one GPU's host
    out = capsys.readouterr().out
    for line in ("weights", "optimizer state", "layer inputs", "replay chunks", "loss tile", "longest sequence"):
        assert line in out
    assert re.search(r"layer inputs \(last \d+ of 32\) +\d", out)  # the device tier: the last layers' inputs
    assert main(argv + ["--device-memory", "80GiB", "--resident-memory", "0"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"layer inputs +64\.00 GiB", out)  # 32 x 262144 x 4096 x 2 bytes, all on the host
    assert "DOES NOT FIT" in out and out.count("fits\n") == 1
    assert hf_fpdt.plan("llama-3.1-8b", 262144, host_memory="128GiB").fits


def test_plan_names_the_smallest_segment_size_that_fits():
    # 52 GiB: over with one input per layer (the attention working set, 12 GiB at chunk 65536, and a layer's backward
    # transients, 36 GiB at 256K in bf16, are on the device: the device tier keeps 4 inputs), within it with one per
    # segment of 2
    from hf_fpdt.memory.planner import plan as plan_step

    over = plan_step("llama-3.1-8b", 262144, lora_rank=16, host_memory="52GiB", device_memory="80GiB")
    assert not over.fits and over.segments_needed == 2
    assert "segments of 2 layers" in over.error()
    two = plan_step("llama-3.1-8b", 262144, lora_rank=16, host_memory="52GiB", device_memory="80GiB", segments=2)
    assert two.fits and two.segments == 2
    on_device = two.device[f"layer inputs (last {two.resident_inputs} of 16)"]
    assert two.host["layer inputs"] + on_device == 16 * two.layer_input  # one input per segment
    assert two.device["a segment's recomputed activations (2 layers)"] > 0  # held while its backward runs
    assert plan_step("llama-3.1-8b", 262144, lora_rank=16, host_memory="128GiB").segments_needed is None
    with pytest.raises(ValueError, match="segments"):
        plan_step("llama-3.1-8b", 4096, segments=0)
    # "auto", the runtime's rule: k=1 where it fits the host, else the smallest k that does
    auto = plan_step("llama-3.1-8b", 262144, lora_rank=16, host_memory="52GiB", device_memory="80GiB", segments="auto")
    assert auto.segments == 2 and auto.fits and auto.longest is not None
    assert plan_step("llama-3.1-8b", 262144, lora_rank=16, host_memory="128GiB", segments="auto").segments == 1


def test_bench_plan_cli_segments_auto_prints_the_k_it_picks(capsys):
    from hf_fpdt.bench.__main__ import main

    argv = ["plan", "--seq-len", "262144", "--device-memory", "80GiB", "--segments", "auto", "--host-memory"]
    assert main(argv + ["52GiB"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_segments=auto: k=2" in out and "placement: checkpoint segments of k=2" in out
    assert main(argv + ["128GiB"]) == 0
    assert "checkpoint_segments=auto: k=1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--segments", "two"])


def test_device_tier_takes_the_last_layers_and_segments_name_their_pool():
    from hf_fpdt.memory.planner import plan as plan_step

    base = dict(lora_rank=16, host_memory="64GiB", device_memory="80GiB", search_longest=False)
    none = plan_step("llama-3.1-8b", 262144, resident_memory=0, **base)
    auto = plan_step("llama-3.1-8b", 262144, **base)  # the device tier: what 80 GiB leave after the working set
    assert none.resident == 0 and auto.resident == auto.resident_budget > 0
    assert auto.resident_inputs > 0 and auto.replay_layers >= none.replay_layers  # device + host hold more
    assert auto.host_kept == none.host_kept - auto.resident + (auto.replay_layers - none.replay_layers) * (
        auto.replay_per_layer
    )
    assert f"layer inputs (last {auto.resident_inputs} of 32)" in auto.describe()
    two = plan_step("llama-3.1-8b", 262144, segments=2, resident_memory=0, **base)
    assert "chunks of a segment (2 layers) + dO/dq (pool)" in two.describe()
    assert "one layer's chunks" not in two.describe()


SEARCHES = [  # per-layer checkpointing over the host budget, some k fitting or none, a device tier, sp > 1
    ("llama-1b", 524288, dict(device="cpu", host_memory="40GiB")),
    ("llama-1b", 131072, dict(device="cpu", host_memory="4GiB", host_capacity=20 << 30)),
    ("llama-3.1-8b", 1 << 20, dict(sp_size=8, device_memory="200GiB", host_memory="30GiB", resident_memory=0)),
    ("llama-3.1-8b", 1 << 19, dict(sp_size=4, device_memory="80GiB", host_memory="64GiB", chunk_size=16384)),
]


@pytest.mark.parametrize("model, seq, settings", SEARCHES)
def test_the_searches_answer_what_they_name(model, seq, settings):
    """``longest`` fits and one sp step more does not; ``segments_needed`` is the smallest k > 1 that fits;
    ``segments="auto"`` is the plan of k=1 when that fits the host (or no k does), else of that k; and
    ``search_longest`` adds the longest and changes nothing else."""
    p = plan(model, seq, **settings)
    assert p == dataclasses.replace(plan(model, seq, search_longest=False, **settings), longest=p.longest)
    step = settings.get("sp_size", 1)
    if p.longest is not None:
        assert plan(model, p.longest, search_longest=False, **settings).fits
        assert not plan(model, p.longest + step, search_longest=False, **settings).fits
    if p.segments_needed is not None:
        assert not p.host_fits and plan(model, seq, segments=p.segments_needed, **settings).fits
        smaller = range(2, p.segments_needed)
        assert not any(plan(model, seq, segments=k, search_longest=False, **settings).fits for k in smaller)
    k = p.segments_needed if not p.host_fits and p.segments_needed else 1
    assert plan(model, seq, segments="auto", **settings) == plan(model, seq, segments=k, **settings)


# ---------------------------------------------------------------------------- arguments plan() refuses

BAD_ARGUMENTS = [  # (keyword arguments, what the ValueError must say): the argument's name and what to pass
    (dict(seq_len=0), r"seq_len=0: use an int >= 1"),
    (dict(seq_len=-5), r"seq_len=-5: use an int >= 1"),
    (dict(seq_len=4096.0), r"seq_len=4096.0: use an int >= 1"),
    (dict(seq_len=True), r"seq_len=True: use an int >= 1"),
    (dict(batch=0), r"batch=0: use an int >= 1 \(samples per rank\)"),
    (dict(dp_size=0), r"dp_size=0: use an int >= 1"),
    (dict(sp_size=0), r"sp_size=0: use an int >= 1"),
    (
        dict(sp_size=33, ring_degree=1),  # Ulysses alone (33 ranks over 32 heads); "auto" is U 11 x R 3
        r"ring_degree=1 .*leaves 33 ranks to split the model's 32 attention heads .*use 'auto' or one of 3, 11, 33$",
    ),
    (dict(sp_size=64, ring_degree=3), r"ring_degree=3 .*does not divide sp_size=64; .*one of 2, 4, 8, 16, 32, 64$"),
    (dict(chunk_size=-1), r"chunk_size=-1: use an int >= 1 or 'auto'"),
    (dict(chunk_size=0), r"chunk_size=0: use an int >= 1 or 'auto'"),
    (dict(lora_rank=-1), r"lora_rank=-1: use an int >= 0 or None"),
    (dict(trainable_params=-1), r"trainable_params=-1: use an int >= 0 or None"),
    (dict(mlp_chunks=0), r"mlp_chunks=0: use an int >= 1 or None"),
    (dict(loss_chunks=0), r"loss_chunks=0: use an int >= 1 or None"),
    (dict(segments=0), r"segments=0: use an int >= 1 or 'auto'"),
    (dict(device_memory=-1), r"^device_memory=-1: a budget cannot be negative"),
    (dict(device_memory="-1"), r"^device_memory='-1': use a number of bytes"),
    (dict(host_memory="lots"), r"^host_memory='lots': use a number of bytes"),
    (dict(resident_memory=-1), r"^resident_memory=-1: a budget cannot be negative"),
    (dict(host_capacity=-1), r"^host_capacity=-1: a budget cannot be negative"),
    (dict(host_capacity=[1, 2]), r"^host_capacity=\[1, 2\]: use bytes"),
    (dict(dtype="int8"), r"dtype='int8' is unknown: use bf16, fp16, fp32 or fp64"),
    (dict(device=""), r"device='': use a device type"),
]


@pytest.mark.parametrize("settings, message", BAD_ARGUMENTS, ids=[str(s) for s, _ in BAD_ARGUMENTS])
def test_plan_refuses_a_bad_argument_by_its_name(settings, message):
    """Every argument out of range is a ValueError naming it and what to pass, never a plan (a length of 0 or
    a negative chunk once gave a plan that fit, or did not, without a word)."""
    settings = {"seq_len": 4096, **settings}
    with pytest.raises(ValueError, match=message):
        plan("llama-3.1-8b", **settings)


def test_plan_of_no_tokens_and_unknown_models_are_refused():
    with pytest.raises(ValueError, match="seq_len=0"):
        hf_fpdt.plan(_config(2), 0)  # the call: once fits=True
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        plan("no-such-model", 4096)
    with pytest.raises(ValueError, match="model=42: use a ModelShape, an HF config"):
        plan(42, 4096)


def test_the_planner_splits_heads_over_sp_as_the_runtime_does():
    """One rule (``hf_fpdt.config.sp_degrees``: U x R, the Ulysses degree bounded by ``check_sp_heads``) for the
    planner, ``apply`` and the attention: every rank of a Ulysses group needs a query head (1 <= U <= heads); the heads
    split evenly or not (:mod:`hf_fpdt.data.head_split`); beyond the heads a ring."""
    from hf_fpdt.attention import chunk_parts, runtime
    from hf_fpdt.config import check_sp_heads, sp_degrees
    from hf_fpdt.memory import planner

    assert planner.sp_degrees is runtime.sp_degrees is sp_degrees
    assert chunk_parts.check_sp_heads is check_sp_heads

    def verdict(heads, kv, sp):
        try:
            check_sp_heads(heads, kv, sp)
        except ValueError:
            return False
        return True

    cases = [(h, kv, sp) for h in (1, 4, 6, 12, 32) for kv in range(1, h + 1) if h % kv == 0 for sp in range(1, 17)]
    for heads, kv, sp in cases:
        assert verdict(heads, kv, sp) == (sp <= heads), (heads, kv, sp)
        u, r = sp_degrees(heads, kv, sp)
        assert u * r == sp and verdict(heads, kv, u) and (r == 1) == (sp <= heads), (heads, kv, sp)
    mqa = _config(2)
    mqa.num_key_value_heads = 1  # sp 4 > 1 KV head: replicated, fine; sp 3: heads 2, 1, 1 (uneven), fine
    assert plan(mqa, 4096, sp_size=4, host_memory="unlimited").fits
    assert plan(mqa, 4096, sp_size=3, host_memory="unlimited").fits
    assert plan(mqa, 4096, sp_size=5, host_memory="unlimited").ring == 5  # beyond 4 heads: U 1 x R 5
    with pytest.raises(ValueError, match="ring_degree=1 .*leaves 5 ranks to split the model's 4 attention heads"):
        plan(mqa, 4096, sp_size=5, ring_degree=1)


def test_an_uneven_split_plans_the_largest_ranks_share():
    """28 heads / 4 KV heads at SP 8 (Qwen2.5-7B's shape): query heads 4,4,4,4,3,3,3,3; rank 1 (query heads 4..7:
    three of KV head 0, one of KV head 1) holds 4 KV heads in its kernels' layout. The plan counts that rank's
    bytes: 4 query and 4 KV heads per rank, as if 32 and 32 over 8."""
    from hf_fpdt.memory.plan_types import model_shape
    from hf_fpdt.memory.planner import rank_heads, replay_bytes_per_layer

    qwen = model_shape("qwen2.5-7b")
    assert (qwen.heads, qwen.kv_heads) == (28, 4)
    assert rank_heads(qwen, 8) == (32, 32)
    assert rank_heads(qwen, 4) == (28, 4)  # even: as before
    assert rank_heads(qwen, 28) == (28, 28)  # even, KV heads replicated: max(Hkv, P) as before
    local, d = 4096, qwen.head_dim
    assert replay_bytes_per_layer(qwen, 1, local, 8, 2) == local * ((32 + 32) * d * 2 * 2 + 32 * 4)
    assert plan("qwen2.5-7b", 8 * local, sp_size=8, dtype="bf16").replay_per_layer == (
        replay_bytes_per_layer(qwen, 1, local, 8, 2)
    )
    # more than the even SP 7's share per token of the local sequence, less than SP 4's per rank
    seven = plan("qwen2.5-7b", 7 * local, sp_size=7, dtype="bf16").replay_per_layer
    assert seven < plan("qwen2.5-7b", 8 * local, sp_size=8, dtype="bf16").replay_per_layer


def test_chunk_size_auto_plans_the_largest_chunk_the_rule_may_pick():
    from hf_fpdt.attention.autotune import MAX_CHUNK as TUNER_MAX
    from hf_fpdt.config import AUTO_CHUNK_MAX as MAX_CHUNK

    assert TUNER_MAX == MAX_CHUNK  # the rule's bound is the planner's
    settings = dict(lora_rank=16, device_memory="80GiB", host_memory="unlimited", search_longest=False)
    for seq in (8192, 1 << 20):
        auto = plan("llama-3.1-8b", seq, chunk_size="auto", **settings)
        assert auto == plan("llama-3.1-8b", seq, chunk_size=min(MAX_CHUNK, seq), **settings)


def test_bench_plan_reads_offload_and_segments_as_the_runtime_does(capsys):
    # FPDTConfig's defaults: offload "auto" (the device tier as device_memory says) and checkpoint_segments "auto";
    # offload=True sends everything lasting to the host, so device_memory "auto" is 0 there (the runtime's rule)
    from hf_fpdt.bench.__main__ import main
    from hf_fpdt.memory.planner import resident_setting

    assert resident_setting("auto", True, "cuda") == 0 and resident_setting("auto", "auto", "cuda") == "auto"
    assert resident_setting("auto", "auto", "cpu") == 0 and resident_setting("unlimited", True, "cuda") is None
    assert resident_setting("1GiB", True, "cuda") == 1 << 30
    argv = ["plan", "--seq-len", "131072", "--device-memory", "80GiB", "--host-memory", "128GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoint_segments=auto: k=1" in out and "on the device (budget 0 B)" not in out
    assert main(argv + ["--offload", "on"]) == 0
    assert "on the device (budget 0 B)" in capsys.readouterr().out
