"""The chunk loops with a ring beside Ulysses: SP beyond the head count (``P = U x R``).

The SP group is R Ulysses groups of U ranks (:mod:`hf_fpdt.distributed.ring_exchange`); Ulysses group g holds a
share of the sequence in the layout of :mod:`hf_fpdt.data.chunks`: round i (its ranks' local chunks i) is R global
chunks, group g's at position g on even rounds and R - 1 - g on odd ones (zig-zag, so the ring's causal work
balances). Shapes on rank ``(g, u)``, ``l_i`` its local chunk length, ``C_i = U * l_i``::

    q_local_i            [B, l_i, H, D]        from the chunk source
    q_c, k_c, v_c        [B, C_i, h, D]        after the Ulysses all-to-all: global chunk c = ring_chunk(i, g, R)
    k_c', v_c'           [B, C_i, hkv, D]      the other members' chunks of round i (the ring's all-gather)
    o_c, lse_c           as the Ulysses loop's, for c only

Forward, round i: the chunk projected and exchanged inside the Ulysses group; its k, v issued round the ring
(:func:`~hf_fpdt.distributed.ring_exchange.start_ring_gather`); while they travel, the blocks that need no chunk
of round i from another member run: the diagonal block and the earlier rounds' chunks (from the host store,
prefetched as in the Ulysses loop). Then the exchange is waited and the blocks against round i's earlier chunks of
the other members run. Every chunk's k, v (the members' too: later rounds and the backward need them) goes to the
store; q, o, lse of c only. A window, documents or a sparse pattern skip blocks as without a ring (the pattern is
over the R x m global chunks, :func:`~hf_fpdt.data.chunks.ring_chunk_sizes`); the round's k, v are gathered whole
even where a window needs none of them (simple; at most one chunk's k, v per member and round).

Backward: outer loop over the global key chunks of round i (all R members'), inner over this rank's query chunks in
their band; ``dq`` accumulates in float32 in the store as in the Ulysses loop. After round i's rows this rank's
shares of the R chunks' ``dk, dv`` are final: one all-to-all in the ring group sums each chunk's shares on its owner
(:func:`~hf_fpdt.distributed.ring_exchange.start_ring_reduce`, in flight while round i + 1's rows run); then its
own chunk's ``dq, dk, dv`` go back through the Ulysses all-to-all to ``source.backward_chunk(i)``, as without a ring
(overlapped: that exchange travels while the following round's rows run, and dO's scatter of chunk i + 1 while chunk i's
is parked in the store; ``sync_exchanges`` waits each where it is issued, with the same bits).

Attention sinks fold into each query chunk's result as without a ring; their heads are those of the rank's Ulysses
group (:meth:`~hf_fpdt.attention.runtime.FPDTRuntime.head_group`), and the sum over the SP group of the ranks' sink
gradients is the whole (ring members hold the same heads for different query rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..data.chunks import chunk_spans, ring_chunk, ring_chunk_sizes
from ..data.head_split import HeadSplit
from ..distributed.all_to_all import Exchange, start_gather_heads_split, start_scatter_heads_split
from ..distributed.ring_exchange import RingGroups, start_ring_gather, start_ring_reduce
from ..memory.host_store import Prefetch
from .chunk_parts import (
    QKV,
    ChunkSource,
    OutputGather,
    Stored,
    block_forward,
    block_pattern,
    final_output,
    head_split,
    overlaps,
    start_chunk,
)
from .merge import merge_block, merge_rows
from .runtime import FPDTRuntime
from .sinks import sinks_of


def ring_nbytes(q: torch.Tensor, k: torch.Tensor, sizes: list[int], ring: RingGroups, split: HeadSplit) -> int:
    """Bytes a ring call stores for backward, from its first chunk's ``q, k``: q, o, lse of this rank's chunks and
    k, v of every member's (R times its own). With an uneven split the largest rank's (every rank's the same)."""
    rows = q.shape[0] * ring.ulysses_size * sum(sizes)
    hq, hk = (q.shape[2], k.shape[2]) if split.even else (split.max_heads, split.max_kv_heads)
    size = q.element_size() * q.shape[3]
    return rows * (2 * hq * size + hq * 4) + ring.ring_size * rows * 2 * hk * size


def ring_attention_forward(
    source: ChunkSource,
    inputs: tuple,
    runtime: FPDTRuntime,
    ring: RingGroups,
    scale: float,
    keep_for_backward: bool | Callable[[int], bool],
    lasting: bool | None = None,
    blocks=None,
) -> tuple[torch.Tensor, Stored]:
    """:func:`~hf_fpdt.attention.chunked.chunked_attention_forward` on a ring (the module docstring); the same
    arguments and results, ``ring`` this rank's groups."""
    sinks = sinks_of(source)  # attention sinks: folded once into each query chunk's merged result (their heads: U's)
    group, width, r, me = ring.ulysses, ring.ulysses_size, ring.ring_size, ring.index
    split = head_split(source, width)
    softcap = source.spec.softcap
    stored = Stored(split=split, blocks=blocks, ring=ring)
    spans, overlap = chunk_spans(source.sizes), overlaps(runtime)
    output = OutputGather(group, split, sum(source.sizes), overlap)  # round t - 1's output in flight (overlap)
    store = None
    ahead: Exchange | None = None  # round t's q/k/v Ulysses exchange, issued during round t - 1 (overlap)
    for t, span in enumerate(spans):
        exchange = ahead if ahead is not None else start_chunk(source, inputs, t, group, split)
        q, k, v = exchange.wait()
        del exchange
        gathered = start_ring_gather((k, v), ring.ring)  # round t's k, v of every member, travelling
        if not overlap:
            gathered.wait()
        ahead = start_chunk(source, inputs, t + 1, group, split) if overlap and t + 1 < len(spans) else None
        if store is None:
            store = stored.store = runtime.store(q.device)
            if stored.blocks is None:
                lengths = tuple(ring_chunk_sizes(source.sizes, width, r))
                stored.blocks = block_pattern(source, width, q.shape[0], lengths)
            pattern = stored.blocks
            merge = merge_rows if pattern.may_empty_rows else merge_block
        if callable(keep_for_backward):
            keep_for_backward = bool(keep_for_backward(ring_nbytes(q, k, source.sizes, ring, split)))
        if lasting is None:
            lasting = bool(keep_for_backward)
        router = runtime.router(q.device, q.dtype, q.shape[-1])
        c, base = ring_chunk(t, me, r), t * r
        band = pattern.keys(c)
        earlier = [j for j in band if j < base]  # earlier rounds: in the store
        remote = [j for j in band if base <= j < c]  # this round's, from the other members: after the exchange
        kv = Prefetch(store, [(stored.k[j], stored.v[j]) for j in earlier])
        o = lse = None
        if c in band:
            o, lse = merge(None, None, *block_forward(q, k, v, pattern, c, c, scale, softcap, router), take=True)
        if keep_for_backward:
            stored.q.append(store.put(q, lasting=lasting))
        dv = v.shape[-1]
        for j in earlier:  # need nothing of this round: they run while the ring's exchange travels
            kj, vj = kv.take()
            o, lse = merge(o, lse, *block_forward(q, kj, vj, pattern, c, j, scale, softcap, router), take=True)
            del kj, vj
        got = gathered.wait()
        del gathered
        round_kv = {ring_chunk(t, m, r): (got[2 * m], got[2 * m + 1]) for m in range(r) if m != me}
        round_kv[c] = (k, v)
        del got, k, v
        for j in remote:
            kj, vj = round_kv[j]
            o, lse = merge(o, lse, *block_forward(q, kj, vj, pattern, c, j, scale, softcap, router), take=True)
            del kj, vj
        for j in range(base, base + r):  # global order: slot j of the store is global chunk j
            kj, vj = round_kv.pop(j)
            stored.k.append(store.put(kj, lasting=lasting))
            stored.v.append(store.put(vj, lasting=lasting))
            del kj, vj
        o, lse = final_output(o, lse, q, dv, sinks)
        if keep_for_backward:
            stored.o.append(store.put(o, lasting=lasting))
            stored.lse.append(store.put(lse, lasting=lasting))
        output.push(span, o)
        del o, q
    out = output.result()
    if not keep_for_backward:
        stored.release()
    return out, stored


def ring_attention_backward(
    source: ChunkSource, saved: tuple, stored: Stored, dout: torch.Tensor, runtime: FPDTRuntime, scale: float
) -> None:
    """:func:`~hf_fpdt.attention.chunked.chunked_attention_backward` on a ring (the module docstring)."""
    ring: RingGroups = stored.ring
    group, r, me, split = ring.ulysses, ring.ring_size, ring.index, stored.split
    pattern, softcap = stored.blocks, source.spec.softcap
    sinks = sinks_of(source)
    store = runtime.store(dout.device)
    spans = chunk_spans(source.sizes)
    m = len(spans)
    local = {ring_chunk(t, me, r): t for t in range(m)}  # global chunk -> this rank's local chunk
    overlap = overlaps(runtime)
    do_slots, ahead = [], None  # dO of this rank's chunks, parked in the store: each is read by every row of its band
    for t, span in enumerate(spans):  # overlapping: chunk t+1's dO travels while chunk t's goes to the store
        exchange = ahead if ahead is not None else start_scatter_heads_split((dout[:, span],), group, split)
        ahead = start_scatter_heads_split((dout[:, spans[t + 1]],), group, split) if overlap and t + 1 < m else None
        do_slots.append(store.put(exchange.wait()[0]))
        del exchange
    dq_slots: list = [None] * m
    router = runtime.router(dout.device, stored.q[0].dtype, stored.q[0].shape[-1])
    dtype = stored.k[0].dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    # k_i, v_i of the rows this rank has queries in, PREFETCH_DEPTH rows ahead (they never change)
    rows = {i: [j for j in pattern.queries(i) if j in local] for i in range(m * r)}
    kv = Prefetch(store, [(stored.k[i], stored.v[i]) for i, queries in rows.items() if queries])

    def row(i: int) -> list[torch.Tensor]:
        """This rank's shares of key chunk i's dk, dv (its query chunks in the band), dq accumulated on the way."""
        if not rows[i]:
            return [torch.zeros(stored.k[i].shape, dtype=acc_dtype, device=dout.device),
                    torch.zeros(stored.v[i].shape, dtype=acc_dtype, device=dout.device)]  # fmt: skip
        k, v = kv.take()
        # The row's query sets, fetched ahead of their blocks: each local chunk once per row, and its running dq
        # was last updated by an earlier row (queued before this Prefetch is made), so no fetch reads it stale.
        slots = [(stored.q[t], stored.o[t], stored.lse[t], do_slots[t], *([dq_slots[t]] if dq_slots[t] else []))
                 for t in (local[j] for j in rows[i])]  # fmt: skip
        sets = Prefetch(store, slots)
        dk = dv = None
        for j in rows[i]:
            t = local[j]
            got = sets.take()
            qj, oj, lsej, doj = got[:4]
            if sinks is not None:  # the sink's gradient, once per query chunk, from its final (o', lse') and dO
                sinks.backward_chunk(j, oj, lsej, doj)
            causal, mask = pattern.block(j, i, qj.device)
            if pattern.may_empty_rows:  # rows that see no key: exp(s - inf) = 0 in every kernel
                lsej = lsej.masked_fill(torch.isneginf(lsej), float("inf"))
            dq_b, dk_b, dv_b = router.backward(doj, qj, k, v, oj, lsej, causal, scale, mask=mask, softcap=softcap)
            if dk is None:
                dk = dk_b.to(acc_dtype, memory_format=torch.contiguous_format)
                dv = dv_b.to(acc_dtype, memory_format=torch.contiguous_format)
            else:
                dk += dk_b
                dv += dv_b
            if len(got) == 4:
                dq_slots[t] = store.put(dq_b.to(acc_dtype))
            else:
                store.put(got[4].add_(dq_b), dq_slots[t])
            del got, qj, oj, lsej, doj, dq_b, dk_b, dv_b
        return [dk, dv]

    gathers: list[tuple[int, Exchange]] = []  # the chunk whose dq, dk, dv Ulysses exchange is in flight (overlap)

    def hand_over() -> None:
        # The exchange in flight waited (guarded: a failed peer is SPPeerFailure here), its chunk to the source.
        if gathers:
            t, exchange = gathers.pop()
            source.backward_chunk(t, saved, *exchange.wait())

    def finish(t: int, reduced: Exchange) -> None:
        # Local chunk t's dk, dv summed over the ring; its dq final since round t: back through the Ulysses exchange,
        # which travels while the next round's rows run (overlapping; the chunks reach the source in order).
        dk, dv = reduced.wait()
        q_slot = stored.q[t]
        dq = store.get(dq_slots[t]) if dq_slots[t] is not None else torch.zeros(q_slot.shape, device=dout.device)
        grads = (dq.to(dtype), dk.to(dtype), dv.to(dtype))
        del dq, dk, dv
        exchange = start_gather_heads_split(grads, group, split, QKV)
        del grads
        hand_over()  # chunk t - 1's, which travelled while this round's rows ran
        gathers.append((t, exchange))
        if not overlap or ring.ulysses_size == 1:  # one rank: nothing travels, and its result may be a pooled buffer
            hand_over()  # (dq fetched on CPU), which must reach the source before its slot is released just below
        for s in (stored.q[t], stored.o[t], stored.lse[t], do_slots[t], dq_slots[t]):
            store.release(s)

    pending: tuple[int, Exchange] | None = None  # the previous round's ring reduce, in flight
    for t in range(m):
        base = t * r
        shares = {i: row(i) for i in range(base, base + r)}
        for i in range(base, base + r):
            store.release(stored.k[i])
            store.release(stored.v[i])
        # member g's chunk of round t: its share goes to g
        reduced = start_ring_reduce([shares.pop(ring_chunk(t, g, r)) for g in range(r)], ring.ring)
        if pending is not None:
            finish(*pending)
        pending = (t, reduced)
        if not overlap:
            finish(*pending)
            pending = None
    if pending is not None:
        finish(*pending)
    hand_over()  # the last chunk's gradients
