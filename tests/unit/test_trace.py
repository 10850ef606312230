"""The traced step (hf_fpdt/bench/trace*.py), its allocator models and its timeline (timeline.py, gpus.py): a real
step at real widths and head counts traced shape-only, with what it records checked against what the step must do."""

from __future__ import annotations

import json

import pytest
import torch

from hf_fpdt.bench import plan
from hf_fpdt.bench.gpus import GPUS, gpu
from hf_fpdt.bench.timeline import play
from hf_fpdt.bench.trace import trace_step
from hf_fpdt.bench.trace_alloc import MIB, DeviceAllocator, HostAllocator, round_request, segment_bytes
from hf_fpdt.bench.trace_device import TraceDevice
from hf_fpdt.bench.trace_events import ATTENTION, GEMM, Alloc, Collective, Copy, EventLog, Kernel, Record, Sync, Wait
from hf_fpdt.models.presets import preset_config

GIB = 1 << 30


# ----------------------------------------------------------------------------- allocator models
def test_caching_allocator_rounds_splits_reuses_and_merges():
    assert round_request(1) == 512 and round_request(513) == 1024
    assert segment_bytes(1 * MIB) == 2 * MIB and segment_bytes(3 * MIB) == 20 * MIB
    assert segment_bytes(11 * MIB) == 12 * MIB
    a = DeviceAllocator(capacity=1 << 40)
    small = a.malloc(100, stream=0)
    assert (small.size, a.allocated, a.reserved) == (512, 512, 2 * MIB)
    big = a.malloc(3 * MIB, stream=0)  # a 20 MiB segment, split: the rest stays cached
    assert a.reserved == 22 * MIB and big.size == 3 * MIB
    again = a.malloc(5 * MIB, stream=0)  # from the cached rest of the 20 MiB segment, no new segment
    assert a.reserved == 22 * MIB and again.segment is big.segment
    other = a.malloc(5 * MIB, stream=1)  # another stream's pool: a segment of its own
    assert a.reserved == 42 * MIB and other.segment is not big.segment
    a.free(big)
    a.free(again)  # merged with the freed neighbour and the cached rest: the whole segment is free again
    assert a.release_cached() == 20 * MIB and a.reserved == 22 * MIB  # stream 1's segment is still in use
    assert a.peak_reserved == 42 * MIB and a.allocated == 512 + 5 * MIB


def test_caching_allocator_counts_what_does_not_fit():
    a = DeviceAllocator(capacity=64 * MIB)
    a.malloc(40 * MIB, stream=0)
    a.malloc(40 * MIB, stream=0)
    assert a.failures == 1 and a.short_by == 16 * MIB


def test_pinned_blocks_are_powers_of_two_and_cached():
    h = HostAllocator()
    size = h.malloc_pinned(3 * MIB)
    assert size == 4 * MIB and h.pinned_reserved == 4 * MIB
    h.free_pinned(size)
    h.malloc_pinned(4 * MIB)  # the cached block of its size class
    assert h.pinned_reserved == 4 * MIB and h.peak == 4 * MIB


def test_a_record_stream_free_leaves_the_allocated_bytes_at_once_and_its_block_later():
    # CUDA's allocator counts a freed block out of memory_allocated at its free, and reuses it only once the streams
    # passed to record_stream have run the work queued before the free (here: at the next host sync)
    dev = TraceDevice(EventLog(), total_memory=80 * GIB)
    with dev:
        side = torch.cuda.Stream()
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        x.record_stream(side)
        before = dev.allocator.reserved
        del x
        assert dev.allocator.allocated == 0 and dev.allocator.reserved == before
        y = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")  # the retired block is not handed out yet
        assert dev.allocator.reserved == 2 * before and dev.allocator.peak_allocated == 64 * MIB
        del y
        torch.cuda.synchronize()
        z = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")  # after the sync both cached blocks are free
        assert dev.allocator.reserved == 2 * before and z.numel() == 64 * MIB


# ----------------------------------------------------------------------------- timeline
def test_timeline_orders_streams_and_names_the_idle_cause():
    g = GPUS["h100"]
    one_ms_gemm = g.gemm * 1e-3
    events = [
        Copy("H2D", 1, int(g.pcie_pinned * 5e-3), pinned=True, blocking=False),  # 5 ms on stream 1
        Record(0, 1),
        Kernel("mm", 0, GEMM, one_ms_gemm, 0),
        Wait(0, 0),  # the compute stream waits for the copy
        Kernel("mm", 0, GEMM, one_ms_gemm, 0),
        Sync("item()", stream=0),
    ]
    t = play(events, g)
    assert t.step_s == pytest.approx(6e-3 + 4 * 10e-6, rel=0.05)
    cause, seconds = t.top_idle(1)[0]
    assert cause == "waiting for H2D copies on stream 1" and seconds == pytest.approx(4e-3, rel=0.05)
    assert t.gaps == 1 and t.busy_s["compute"] == pytest.approx(2e-3, rel=0.01)


def test_gpu_table_names_a_source_for_every_rate():
    for row in GPUS.values():
        assert {"peak", "gemm", "attention", "hbm", "pcie_pinned", "pcie_pageable", "nvlink", "internode"} <= set(
            row.sources
        )
    assert gpu("H100").attention_rate("cudnn", 128) > gpu("H100").attention_rate("flash", 128)
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu("v100")


# ----------------------------------------------------------------------------- the traced step
def _shape(**overrides):
    # Llama-3.1-8B's widths, heads (32 / 8 KV, head dim 128) and vocabulary, two layers: the real step, quickly
    return preset_config("llama-3.1-8b", num_hidden_layers=2, **overrides)


@pytest.fixture(scope="module")
def traced():
    # offload=True: the device tier is 0 (everything lasting goes to the host), host_memory=0: inputs only
    return trace_step(_shape(), 16384, chunk_size=4096, device_memory=80 * GIB, host_memory=0, offload=True)


def test_trace_records_the_step_at_real_width(traced):
    cfg = _shape()
    kernels = traced.log.of(Kernel)
    attention = [k for k in kernels if k.kind == ATTENTION]
    assert {k.backend for k in attention} == {"cudnn"} and {k.head_dim for k in attention} == {128}
    # causal blocks of 4 chunks: 10 per layer forward and 10 backward (no replay recomputes attention)
    # causal blocks of 4 chunks of 4096: 6 full and 4 diagonal per layer; a forward block 4 * c * c * H * D FLOPs
    # (a diagonal one the causal share c(c+1)/2 of it), its backward 2.5 times that (gpu/README.md's kernel rates)
    c, h, d = 4096, 32, 128
    per_layer = 4 * h * d * (6 * c * c + 4 * c * (c + 1) / 2)
    forward = [k for k in attention if "backward" not in k.name]
    backward = [k for k in attention if "backward" in k.name]
    assert len(backward) == 2 * 10 and len(forward) in (2 * 10, 2 * 2 * 10)  # 2 x: the recompute runs attention again
    assert sum(k.flops for k in backward) == pytest.approx(2 * 2.5 * per_layer)
    assert sum(k.flops for k in forward) == pytest.approx(len(forward) / 10 * per_layer)
    gemm = sum(k.flops for k in kernels if k.kind == GEMM)
    nt = traced.n_params * 16384
    # LoRA: forward, the checkpoint's recompute and the backward's input gradients (no weight gradients but LoRA's)
    assert 4 * nt < gemm < 10 * nt
    weights = sum(p for p in (cfg.vocab_size * cfg.hidden_size * 2 * 2,))  # embedding + LM head, bf16
    assert traced.device_peak_allocated > weights
    assert traced.device_peak_reserved >= traced.device_peak_allocated
    d2h = [c for c in traced.log.of(Copy) if c.direction == "D2H"]
    assert d2h and all(c.pinned and not c.blocking for c in d2h)  # host_memory=0: offloaded, asynchronously
    assert traced.host_pinned > 0 and traced.stand_ins == 0 and traced.error is None


def test_trace_names_what_its_allocated_peak_holds(traced):
    # the storages alive at the peak add up to it; their frees were logged at their own sizes (the log balances)
    holders = traced.peak_holders
    assert holders and holders == sorted(holders, key=lambda h: -h[0])
    every = sum(b for b, _, _, _ in holders)
    assert every <= traced.device_peak_allocated
    allocated = peak = 0
    for e in traced.log.of(Alloc):  # the log replayed: the allocator's own peak, never below zero
        allocated += -e.block if e.free else e.block
        peak = max(peak, allocated)
        assert allocated >= 0
    assert peak == traced.device_peak_allocated
    whats = " ".join(what for _, _, what, _ in holders)
    assert "bfloat16" in whats and any(where != "autograd" for _, _, _, where in holders)


def test_trace_host_syncs_do_not_grow_with_the_chunks(traced):
    more = trace_step(_shape(), 16384, chunk_size=2048, host_memory=0, offload=True)
    assert more.syncs == traced.syncs


@pytest.mark.slow  # about 20 s alone: the SP step's per-step weights digest is traced too
def test_trace_under_sp_records_the_exchanges():
    t = trace_step(_shape(), 16384, sp_size=2, chunk_size=4096, lora_rank=16, optimizer=False)
    exchanges = [c for c in t.log.of(Collective) if c.op == "all_to_all"]
    assert exchanges and {c.group_size for c in exchanges} == {2}
    assert not torch.distributed.is_initialized()  # the fake world is gone


def test_timeline_of_a_trace_predicts_a_plausible_step(traced):
    from hf_fpdt.bench.common import step_flops

    t = play(traced.log.events, GPUS["h100"])
    mfu = step_flops(_shape(), traced.n_params, 1, 16384) / (t.step_s * GPUS["h100"].peak)
    assert 0.01 < mfu < 0.7 and 0 < t.busy_share("compute") <= 1


def test_plan_trace_json(capsys):
    args = plan_args(["--trace", "--model", "small-llama", "--seq-len", "4096", "--chunk-size", "2048", "--json"])
    assert plan.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["hf_fpdt", "HF sdpa + ckpt"]
    assert all(r["fits"] and r["step_s"] > 0 and r["device_peak"] > 0 for r in rows)
    assert rows[0]["planner_device_peak"] > 0


@pytest.mark.parametrize(
    "argv,said",
    [(["--sp", "29"], "argument --sp: sp_size=29"), (["--backend", "bogus"], "backend='bogus'")],
)
def test_plan_trace_refuses_a_bad_argument_before_tracing(capsys, argv, said):
    """One error line and exit code 2, as ``plan`` without ``--trace`` (a traceback before; SP 29 over 28 heads needs a
    ring, which the traced step does not run)."""
    args = plan_args(["--trace", "--model", "qwen2.5-7b", "--seq-len", "4096,8192", "--no-baseline", *argv])
    assert plan.run(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"python -m hf_fpdt.bench plan: error: {said}") and err.count("\n") == 1


def plan_args(argv: list[str]):
    from hf_fpdt.bench.__main__ import parse

    args, module = parse(["plan", *argv])
    assert module is plan
    return args


def test_trace_reports_hf_fpdts_refusal_of_a_host_too_small():
    from hf_fpdt.bench.trace import REFUSAL

    t = trace_step(_shape(), 16384, chunk_size=4096, offload=True, host_capacity=64 << 20, optimizer=False)
    assert t.error is not None and t.error.startswith(REFUSAL) and "host" in t.error


def test_the_planner_agrees_with_the_trace_at_real_width():
    # Llama-3.1-8B's widths (two layers), LoRA, 64K tokens on a 12 GiB device: the device tier is what the planner
    # leaves after its estimate of the backward's transients, so an estimate short of the float32 copies a bf16
    # layer's norms and LoRA casts make (UPCAST_TRANSIENT) fills the device past the plan (32% over it before)
    from hf_fpdt.memory.planner import plan as plan_step

    planned = plan_step(_shape(), 65536, lora_rank=16, device="cuda", device_memory=12 * GIB, host_memory="unlimited",
                        chunk_size=8192, segments="auto")  # fmt: skip
    traced = trace_step(_shape(), 65536, chunk_size=8192, device_memory=12 * GIB, host_memory="unlimited")
    assert traced.error is None
    assert traced.device_peak_allocated == pytest.approx(sum(planned.device.values()), rel=0.10)
