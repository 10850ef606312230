"""The packed all-to-all: q, k, v (and dq, dk, dv) of a chunk in one collective, on real gloo processes.

Checked at SP 2 and 4 with GQA (4 query heads over 2 KV heads: SP 4 replicates the KV heads, and head dims differ
between the packed tensors): the packed scatter and gather equal the one-tensor ones exactly (they only move data);
the chunked attention's output and gradients at every rank equal one process's float64 reference; and the
attention calls ``dist.all_to_all_single`` 4 times per chunk (forward: q/k/v and the output; backward: dO and
dq/dk/dv), where it called it 8 times before packing (3 + 1 forward, 1 + 3 backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from standins import reference_attention
from testkit import rel_err

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.distributed.all_to_all import (
    gather_heads,
    gather_heads_packed,
    kv_replicas,
    scatter_heads,
    scatter_heads_packed,
)

pytestmark = pytest.mark.multiprocess

B, S, H, HKV, D, CHUNK = 2, 300, 4, 2, 16, 64


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7)
    # packing alone: tensors of different head counts and head dims, replicated KV heads at SP 4
    reps = kv_replicas(HKV, world)
    local = [torch.randn(B, 5, n, d, generator=g) + rank for n, d in ((H, D), (HKV, D), (HKV, 8))]
    packed = scatter_heads_packed(local, group, (1, reps, reps))
    single = [scatter_heads(x, group, r) for x, r in zip(local, (1, reps, reps))]
    back = gather_heads_packed(packed, group, (1, reps, reps))
    back_single = [gather_heads(x, group, r) for x, r in zip(single, (1, reps, reps))]
    exact = all(torch.equal(a, b) for a, b in zip(packed + back, single + back_single))
    contiguous = all(t.is_contiguous() for t in packed + back)

    # the attention: this rank's rank-ordinal shard of the global q, k, v, dout
    q, k, v, dout = (torch.randn(B, S, n, D, generator=g) for n in (H, HKV, HKV, H))
    index = shard_batch(torch.zeros(B, S, dtype=torch.long), None, rank=rank, sp_size=world, chunk_size=CHUNK).index
    pad = world * index.numel() - S  # the layout pads S to a multiple of the SP size
    q, k, v, dout = (torch.cat([t, t.new_zeros(B, pad, *t.shape[2:])], 1) if pad else t for t in (q, k, v, dout))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=CHUNK, offload=True), group=group)
    mine = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
    calls = {"n": 0}
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        out = fpdt_attention(*mine, runtime)
        forward_calls = calls["n"]
        out.backward(dout[:, index])
    finally:
        dist.all_to_all_single = real
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, D**-0.5)
    ref.backward(dout.double())
    ours = (out.detach(), *(t.grad for t in mine))
    errors = [rel_err(a, r[:, index]) for a, r in zip(ours, (ref, q64.grad, k64.grad, v64.grad))]
    chunks = len(runtime.chunk_sizes(q.shape[1] // world, q.device))
    return {
        "exact": exact,
        "contiguous": contiguous,
        "errors": errors,
        "forward": forward_calls,
        "total": calls["n"],
        "chunks": chunks,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_packed_all_to_all_matches_and_halves_the_calls(world):
    for r in run_distributed(_worker, world):
        assert r["exact"] and r["contiguous"]
        assert max(r["errors"]) < 1e-5, r["errors"]
        n = r["chunks"]
        assert (r["forward"], r["total"]) == (2 * n, 4 * n), r  # unpacked: (4 n, 8 n)
