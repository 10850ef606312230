"""The attention working set (:func:`hf_fpdt.memory.working_set.attention_working_set`) against a CPU allocation probe.

The probe is torch's profiler with ``profile_memory``: every allocation and free of the CPU allocator, kernels'
scratch included, in order. Two chunks at one rank, nothing offloaded (a CPU store hands its tensors over, so no
fetch allocates: ``copies=False``): the backward's first row runs blocks (0, 0) and (0, 1) before anything of the
layer's outputs exists (the input gradients are allocated at the row's end, by the chunk source), so what it holds
above the backward's start at its peak block is exactly the formula's backward row: dq_0, dk_0, dv_0 and block
(0, 1)'s dq, dk, dv. The forward's peak block (1, 0) is checked the same way, less what the forward keeps
(chunk 0's o and lse, the full-length output), and with q a view of the caller's (the formula counts a fresh q,
as the projection makes it, so it bounds the forward from above by one q).

Tolerance: the formula leaves out the kernels' scratch, which is O(threads x tile), not O(chunk): torch's CPU flash
forward keeps per thread ``qSplit x kvSplit + qSplit x D + 2 qSplit`` floats (256 x 512 + 256 x 64 + 512: 0.57 MiB
at D = 64), its backward two ``qSplit x kvSplit`` float32 tiles (the block's probabilities and their gradient:
1 MiB), both bounded here by ``SCRATCH_PER_THREAD`` per thread (1 MiB). The formula's q-sized float32 dq accumulator
(FA2's ``dq_accum`` on CUDA) is not what torch's CPU backward allocates (measured: the backward row less the formula
without that term is 1.0 MiB at 1 thread, 2.0 at 2, 4.0 at 4, the same at chunks 1024 and 2048), so the backward row
is checked without it: measured - (formula - dq accumulator) must lie in ``[0, scratch]``, and the forward block
(measured - formula) too: it exceeds the formula by its scratch (1.13 MiB at 2 threads). The allocator's events are
exact (bytes asked). The chunk makes the working set (10-14 MiB) large against the scratch; the planner's figure
before this formula (``8 * c * H * D * es``, the forward's chunks only) was a third of it.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import hf_fpdt.attention.chunked as chunked
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention.autotune import attention_bytes_per_token
from hf_fpdt.memory import planner
from hf_fpdt.memory.working_set import attention_working_set, working_set_parts

MIB = 1 << 20
SCRATCH_PER_THREAD = 2 * 256 * 512 * 4  # two float32 tiles of the CPU flash kernels' largest split sizes
SMALL = 64 << 10  # the kernels' constant-size buffers besides the tiles (1 KiB measured at every thread count)


def _peak_before(prof, marker: str) -> int:
    """Peak of the bytes allocated (net of frees) from the profile's start up to the first ``marker`` range."""
    events = list(prof.profiler.kineto_results.events())
    stop = min((e.start_ns() for e in events if e.name() == marker), default=None)
    live = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if stop is not None and e.start_ns() >= stop:
            break
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_working_set_matches_the_backward_row_and_bounds_the_forward(monkeypatch, hkv):
    torch.manual_seed(0)
    b, h, d, chunk = 1, 4, 64, 2048
    s = 2 * chunk
    q = torch.randn(b, s, h, d, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, s, h, d)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=False))
    fpdt_attention(q, k, v, runtime).backward(dout)  # warm: lazy state (backend probe) before measuring

    real_place, real_finish = chunked._place, chunked.TensorSource.backward_chunk

    def place(*args):
        with record_function("place"):
            return real_place(*args)

    def finish(self, *args):
        with record_function("finish"):
            return real_finish(self, *args)

    monkeypatch.setattr(chunked, "_place", place)
    monkeypatch.setattr(chunked.TensorSource, "backward_chunk", finish)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as fwd:
        out = fpdt_attention(q, k, v, runtime)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as bwd:
        out.backward(dout)

    parts = working_set_parts(chunk, width=h * d, kv_ratio=hkv / h, heads=h, batch=b, elem_bytes=4, copies=False)
    scratch = torch.get_num_threads() * SCRATCH_PER_THREAD + SMALL
    row = _peak(bwd, until="finish")  # the backward's row 0, above its start
    dq_accumulator = b * chunk * h * d * 4  # FA2's on CUDA; torch's CPU kernel holds per-thread tiles instead
    assert 0 <= row - (parts.backward - dq_accumulator) <= scratch, (row / MIB, parts.backward / MIB)

    # forward: after chunk 0 is placed the output [B, S, H, D] and chunk 0's o, lse (float32) are kept; the peak
    # that follows is block (1, 0), with q a view of the caller's (the formula counts a fresh one)
    kept = b * s * h * d * 4 + b * chunk * h * (d + 1) * 4
    fresh_q = b * chunk * h * d * 4
    block = _peak(fwd, after="place") - kept
    assert 0 <= block - (parts.forward - fresh_q) <= scratch, (block / MIB, parts.forward / MIB)


def _peak(prof, until: str | None = None, after: str | None = None) -> int:
    """Peak of the bytes allocated (net of frees) since the profile's start: before the first ``until`` range, or
    after the end of the first ``after`` range."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    stop = next((e.start_ns() for e in events if e.name() == until), None)
    start = next((e.end_ns() for e in events if e.name() == after), None)
    live = peak = 0
    for e in events:
        if e.name() != "[memory]":
            continue
        if stop is not None and e.start_ns() >= stop:
            break
        live += e.nbytes()
        if start is None or e.start_ns() > start:
            peak = max(peak, live)
    return peak


def test_planner_and_autotuner_use_the_working_set():
    chunk, width = 16384, 4096
    per_token = attention_bytes_per_token(2, width, kv_ratio=0.25)
    assert per_token * chunk == pytest.approx(
        attention_working_set(chunk, width=width, kv_ratio=0.25, elem_bytes=2, copies=True), rel=1e-6
    )
    p = planner.plan("llama-3.1-8b", 65536, device="cuda", device_memory="80GiB", chunk_size=chunk, host_memory="1TiB")
    shape = planner.model_shape("llama-3.1-8b")
    expect = attention_working_set(
        chunk,
        width=shape.heads * shape.head_dim,
        kv_ratio=shape.kv_heads / shape.heads,
        heads=shape.heads,
        elem_bytes=2,
        copies=True,
    )
    assert p.device["attention working set (chunks)"] == expect
    old = 8 * chunk * shape.heads * shape.head_dim * 2  # the planner's figure before: a third of the backward's
    assert expect > 2.5 * old


def test_overlapped_exchanges_count_the_buffers_in_flight():
    """Under SP the exchanges overlap the compute (attention.chunked): beside a forward block the next chunk's q/k/v
    exchange (send and receive buffers) and the previous chunk's output exchange are alive, beside a backward block
    one chunk's dq/dk/dv exchange; synchronously (``sync_exchanges``) and at one rank, none of them."""
    chunk, width, b = 4096, 512, 2
    shape = dict(width=width, kv_ratio=0.25, heads=8, elem_bytes=b, copies=False)
    for sp in (2, 4):
        e_q, e_k = width / sp, width / sp * 0.25
        sync = working_set_parts(chunk, sp_size=sp, overlapped=False, **shape)
        over = working_set_parts(chunk, sp_size=sp, **shape)
        assert over.forward - sync.forward == chunk * (2 * b * (e_q + 2 * e_k) + 2 * b * e_q)
        assert over.diagonal - sync.diagonal == chunk * (2 * b * (e_q + 2 * e_k) + 2 * b * e_q)
        assert over.backward - sync.backward == chunk * 2 * b * (e_q + 2 * e_k)
        assert over.exchange == sync.exchange
        assert attention_working_set(chunk, sp_size=sp, **shape) == over.peak
    assert working_set_parts(chunk, sp_size=1, **shape) == working_set_parts(
        chunk, sp_size=1, overlapped=False, **shape
    )
