"""The chunked FPDT attention: online-softmax forward and the nested backward, one chunk at a time.

Layout (P = sequence-parallel size, ``l_i`` = local length of chunk i, ``C_i = P * l_i``)::

    q_local_i   [B, l_i, H, D]         from the chunk source (HF's q/k/v, or the chunked projection)
    q_i         [B, C_i, H/P, D]       after the all-to-all: global chunk i, this rank's heads
    k_i, v_i    [B, C_i, Hkv'/P, D]    Hkv' = Hkv * replicas (KV heads replicated when P > Hkv)
    o_i         [B, C_i, H/P, D]       merged output of q_i over k_0..k_i
    lse_i       [B, H/P, C_i]          float32 log-sum-exp of q_i's rows

Where P does not split the heads evenly (:mod:`hf_fpdt.data.head_split`) ``H/P`` is this rank's share of
the query heads (28 heads at P 8: 4 on ranks 0-3, 3 on ranks 4-7) and ``Hkv'/P`` the key/value heads those use,
in the GQA layout the kernels take (:meth:`~hf_fpdt.data.head_split.HeadSplit.kv_layout`).

Forward, chunk i: the diagonal block (causal) first, then k_0..k_{i-1} fetched back from the host
store one at a time while the next is prefetched, merged with the stable sigmoid/logsigmoid form.
``k_i, v_i`` go to the store because later chunks attend to them; ``q_i, o_i, lse_i`` go there
because backward needs them and nothing else does until then.

Backward (FPDT Fig. 7): outer loop over key/value chunks i, inner loop over query chunks j >= i;
each block's backward uses the *final* ``o_j, lse_j``. ``dk_i, dv_i`` are final after outer step i,
and so is ``dq_i`` (its last contribution is the diagonal block, the first of the inner loop), so all
three go back through the all-to-all to the chunk source right then. ``dq_j`` of later chunks is
accumulated in float32 in the store.

Device memory is O(chunk): at any time one query chunk, one key/value chunk and the next prefetched
ones live on the device.

Beyond the query heads the SP group is a ring of Ulysses groups (``FPDTConfig.ring_degree``): the forward and the
backward then run :mod:`hf_fpdt.attention.ring`'s loops (the replay below only needs the Ulysses group); at ring
degree 1 nothing of it runs. What both loops share lives in :mod:`hf_fpdt.attention.chunk_parts`.

Under non-reentrant activation checkpointing (marked by ``hf_fpdt.apply``; see :mod:`hf_fpdt.memory.checkpointing`)
the recomputation of a layer does not compute attention again: it rebuilds the output from the ``o_i``
its first forward stored (one all-to-all per chunk), and sets the random generators to where that
forward's attention left them (LoRA dropout inside the chunked projection draws from them). Layers over
the host budget store nothing in the first forward; their recomputation computes attention again and
hands its chunks to the first forward's backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..data.chunks import chunk_spans
from ..data.head_split import HeadSplit
from ..distributed.all_to_all import Exchange, start_gather_heads_split, start_scatter_heads_split
from ..memory.checkpointing import ReplayEntry
from ..memory.host_store import PREFETCH_DEPTH, Fetched, Prefetch, Slot
from ..memory.replay import RngState
from .block_mask import BlockMask, MaskSpec
from .chunk_parts import QKV, ChunkSource, OutputGather, block_pattern, final_output, head_split, overlaps
from .chunk_parts import Stored as _Stored
from .chunk_parts import block_forward as _block_forward
from .chunk_parts import fetch_all as _fetch
from .chunk_parts import place as _place
from .chunk_parts import start_chunk as _start_chunk
from .merge import merge_block, merge_rows
from .ring import ring_attention_backward, ring_attention_forward
from .runtime import FPDTRuntime
from .sinks import sinks_of, with_sinks


def replay_nbytes(
    q: torch.Tensor, k: torch.Tensor, sizes: list[int], sp_size: int, split: HeadSplit | None = None
) -> int:
    """Bytes of the q/k/v/o/lse chunks one call stores for backward, from its first chunk's ``q, k``.

    With an uneven ``split`` the largest rank's bytes (every rank's the same number: the ranks' keep decisions,
    and so their collectives, must agree)."""
    rows = q.shape[0] * sp_size * sum(sizes)  # batch x global chunk rows, summed over chunks
    hq, hk = (q.shape[2], k.shape[2]) if split is None or split.even else (split.max_heads, split.max_kv_heads)
    return rows * ((hq + hk) * q.shape[3] * 2 * q.element_size() + hq * 4)


def chunked_attention_forward(
    source: ChunkSource,
    inputs: tuple,
    runtime: FPDTRuntime,
    scale: float,
    keep_for_backward: bool | Callable[[int], bool],
    lasting: bool | None = None,
    blocks: BlockMask | None = None,
) -> tuple[torch.Tensor, _Stored]:
    """Forward over all chunks; returns the local output ``[B, S_local, H, D]`` and the stored chunks.

    Query chunk i meets only the key chunks of its band (:meth:`BlockMask.keys`): the others are
    neither fetched nor computed. ``keep_for_backward`` may be a callable deciding from the bytes the
    call would keep (:func:`replay_nbytes`); it is asked once, at the first chunk. ``lasting`` (default:
    the keep decision): the kept chunks live across layers until their backward, so they may push older
    ones out of the device budget (:class:`hf_fpdt.memory.host_store.DeviceBudget`); ``False`` for chunks a
    recomputation hands straight to its backward. ``blocks``: the block pattern of the call's first forward,
    which a recomputation reuses (``None``: built here, from the first chunk's batch; :func:`block_pattern`).

    Under SP the exchanges overlap the compute (:func:`overlaps`): chunk i+1 is projected and its q/k/v
    all-to-all issued before chunk i's blocks run, and chunk i's output all-to-all travels while chunk i+1's
    blocks run (waited before chunk i+1's own is issued, and at the end). At most one chunk ahead: on top of
    the synchronous order this holds chunk i+1's q/k/v (the exchange's send and receive buffers, each the size
    of one chunk's q/k/v) and chunk i-1's output (two buffers of one output chunk). The kernels, merges and
    their order are the synchronous order's, so the results are bit-identical to it.
    """
    ring = runtime.ring_groups(source.num_heads, source.num_kv_heads)
    if ring is not None:  # SP beyond the heads: Ulysses groups in a ring (hf_fpdt.attention.ring)
        return ring_attention_forward(source, inputs, runtime, ring, scale, keep_for_backward, lasting, blocks)
    group, p = runtime.group, runtime.sp_size
    split = head_split(source, p)
    softcap = source.spec.softcap
    stored = _Stored(split=split, blocks=blocks)
    sinks = sinks_of(source)  # attention sinks: folded once into each query chunk's merged result
    spans, overlap = chunk_spans(source.sizes), overlaps(runtime)
    output = OutputGather(group, split, sum(source.sizes), overlap)  # chunk i - 1's output in flight (overlap)
    store = None
    ahead: Exchange | None = None  # chunk i's q/k/v exchange, issued during chunk i - 1 (overlap)
    for i, span in enumerate(spans):
        exchange = ahead if ahead is not None else _start_chunk(source, inputs, i, group, split)
        q, k, v = exchange.wait()  # one all-to-all
        del exchange
        ahead = _start_chunk(source, inputs, i + 1, group, split) if overlap and i + 1 < len(spans) else None
        if store is None:
            store = stored.store = runtime.store(q.device)
            if stored.blocks is None:
                stored.blocks = block_pattern(source, p, q.shape[0])
            pattern = stored.blocks
            # rows that may see no key (a padding mask) merge with the -inf-safe form
            merge = merge_rows if pattern.may_empty_rows else merge_block
        if callable(keep_for_backward):
            keep_for_backward = bool(keep_for_backward(replay_nbytes(q, k, source.sizes, p, split)))
        if lasting is None:
            lasting = bool(keep_for_backward)
        router = runtime.router(q.device, q.dtype, q.shape[-1])  # each block's kernel: resolved once per runtime
        # The band's first two k, v start travelling now, behind the diagonal block (k_i, v_i are here
        # already); then each block's wait starts the fetch PREFETCH_DEPTH chunks further on. A padding
        # mask may drop the diagonal block (a chunk of padding keys), or every block (padding queries).
        band = pattern.keys(i)
        earlier = [j for j in band if j != i]
        kv = Prefetch(store, [(stored.k[j], stored.v[j]) for j in earlier])
        o = lse = None
        if i in band:
            # the kernel's fresh output becomes the accumulator (merged into in place)
            o, lse = merge(None, None, *_block_forward(q, k, v, pattern, i, i, scale, softcap, router), take=True)
        stored.k.append(store.put(k, lasting=lasting))
        stored.v.append(store.put(v, lasting=lasting))
        if keep_for_backward:
            stored.q.append(store.put(q, lasting=lasting))
        dv = v.shape[-1]  # v's head dim (multi-head latent attention: not q's)
        del k, v
        for j in earlier:
            kj, vj = kv.take()
            block = _block_forward(q, kj, vj, pattern, i, j, scale, softcap, router)
            o, lse = merge(o, lse, *block, take=True)
            del kj, vj
        o, lse = final_output(o, lse, q, dv, sinks)
        if keep_for_backward:
            stored.o.append(store.put(o, lasting=lasting))
            stored.lse.append(store.put(lse, lasting=lasting))
        output.push(span, o)
        del o
    out = output.result()
    if not keep_for_backward:
        stored.release()
    return out, stored


def replay_attention_forward(stored: _Stored, sizes: list[int], runtime: FPDTRuntime) -> torch.Tensor:
    """The local output a forward produced, rebuilt from the ``o_i`` it stored: no attention computed."""
    store, out, overlap, behind = stored.store, None, overlaps(runtime), None
    group = runtime.group if stored.ring is None else stored.ring.ulysses  # a ring's outputs: its Ulysses group's
    chunks = Prefetch(store, [(o,) for o in stored.o])
    for span in chunk_spans(sizes):
        (o,) = chunks.take()
        exchange = start_gather_heads_split((o,), group, stored.split)
        del o
        if behind is not None:  # the previous chunk's output arrived while this one's was packed and issued
            out = _place(out, behind[1].wait()[0], behind[0], sum(sizes))
        behind = (span, exchange)
        if not overlap:
            out = _place(out, exchange.wait()[0], span, sum(sizes))
            behind = None
        del exchange
    if behind is not None:
        out = _place(out, behind[1].wait()[0], behind[0], sum(sizes))
    return out


def chunked_attention_backward(
    source: ChunkSource, saved: tuple, stored: _Stored, dout: torch.Tensor, runtime: FPDTRuntime, scale: float
) -> None:
    """Nested backward; hands each chunk's final ``dq, dk, dv`` to ``source.backward_chunk``.

    Outer step i visits only the query chunks of key chunk i's band (:meth:`BlockMask.queries`).
    Prefetch order: the blocks ``(i, j)`` run row by row; while block b computes, the query sets (and, at
    row starts, ``k_i, v_i``) of blocks b+1 .. b+PREFETCH_DEPTH travel. A query set whose running ``dq_j``
    an earlier block still updates is fetched only once that update is queued (right after it, ahead of
    ``source.backward_chunk`` when it was a row's last block), so no fetch reads a stale accumulator.

    Under SP the exchanges overlap the compute (:func:`overlaps`): dO's all-to-all of chunk i+1 travels while
    chunk i's is parked in the store; chunk i's final ``dq, dk, dv`` all-to-all is issued when row i ends and
    waited when row i+1 ends (its own issued first), so it travels while row i+1's blocks run; then
    ``source.backward_chunk(i)`` runs. The chunks reach the source in the same order with the same values, so
    the results are bit-identical to the synchronous order; on top of it one chunk's ``dq, dk, dv`` exchange
    (send and receive buffers) is held across a row.
    """
    if stored.ring is not None:
        return ring_attention_backward(source, saved, stored, dout, runtime, scale)
    group, p = runtime.group, runtime.sp_size
    overlap = overlaps(runtime)
    split = stored.split if stored.split is not None else head_split(source, p)
    pattern, softcap = stored.blocks, source.spec.softcap  # the forward's: no mask_mod evaluated again
    sinks = sinks_of(source)
    store = runtime.store(dout.device)
    n = len(source.sizes)
    # dO of every global chunk is needed by n - j outer steps. Under SP: all-to-all once, park the result in the
    # store. At one rank ``dout`` stays on the device until this backward returns (autograd holds it): its chunks
    # are views of it, neither copied nor sent to the host and back (contiguous() copies only an expanded dout).
    if p == 1:
        dout = dout.contiguous()
        do_slots = [Slot(t.shape, t.dtype, device_tensor=t) for t in (dout[:, s] for s in chunk_spans(source.sizes))]
    else:  # one exchange ahead when overlapping: chunk i+1's dO travels while chunk i's goes to the store
        spans, do_slots, ahead = chunk_spans(source.sizes), [], None
        for i in range(n):
            exchange = ahead if ahead is not None else start_scatter_heads_split((dout[:, spans[i]],), group, split)
            ahead = start_scatter_heads_split((dout[:, spans[i + 1]],), group, split) if overlap and i + 1 < n else None
            do_slots.append(store.put(exchange.wait()[0]))
            del exchange
    dq_slots: list[Slot | None] = [None] * n

    def fetch_query(j: int, i: int) -> list[Fetched]:
        # q_j, o_j, lse_j, dO_j and (once an earlier outer step has started it) the running dq_j
        slots = [stored.q[j], stored.o[j], stored.lse[j], do_slots[j]]
        if dq_slots[j] is not None:
            slots.append(dq_slots[j])
        return _fetch(store, slots)

    router = runtime.router(dout.device, stored.q[0].dtype, stored.q[0].shape[-1])
    blocks = [(i, j) for i in range(n) for j in pattern.queries(i)]
    row_start, depends, last = {}, [], {}  # row -> its first block; block -> the block it waits for
    for b, (i, j) in enumerate(blocks):
        row_start.setdefault(i, b)
        depends.append(last.get(j, -1))  # the previous block updating dq_j (-1: none)
        last[j] = b
    rows = list(row_start)  # the key chunks some query attends to (a padding mask may leave some out)
    kv_sets: dict[int, list[Fetched]] = {}  # row -> k_i, v_i on their way
    query_sets: dict[int, list[Fetched]] = {}  # block -> its query set on its way
    issued = {"kv": 0, "query": 0}

    def prefetch(b: int) -> None:
        # Fetch for blocks up to b + PREFETCH_DEPTH; blocks up to b - 1 have queued their dq updates.
        horizon = min(len(blocks) - 1, b + PREFETCH_DEPTH)
        while issued["kv"] < len(rows) and row_start[rows[issued["kv"]]] <= horizon:
            r = rows[issued["kv"]]
            kv_sets[r] = _fetch(store, (stored.k[r], stored.v[r]))
            issued["kv"] += 1
        while issued["query"] <= horizon and depends[issued["query"]] < b:
            i, j = blocks[issued["query"]]
            query_sets[issued["query"]] = fetch_query(j, i)
            issued["query"] += 1

    def finish(i: int, dq_i, dk, dv) -> None:
        # Chunk i's gradients are final: back through the all-to-all to the source. Where a padding mask
        # dropped the diagonal block, dq_i is what the earlier rows accumulated (zeros where none did);
        # where no query attends key chunk i, dk_i and dv_i are zeros.
        dtype = stored.k[i].dtype
        if dq_i is None:
            q_slot = stored.q[i]
            dq_i = (
                store.fetch(dq_slots[i]).wait()
                if dq_slots[i] is not None
                else torch.zeros(q_slot.shape, dtype=dtype, device=dout.device)
            )
        if dk is None:
            dk = torch.zeros(stored.k[i].shape, dtype=dtype, device=dout.device)
            dv = torch.zeros(stored.v[i].shape, dtype=dtype, device=dout.device)
        grads = (dq_i.to(dtype), dk.to(dtype), dv.to(dtype))
        exchange = start_gather_heads_split(grads, group, split, QKV)  # dq, dk, dv in one all-to-all
        del grads, dk, dv, dq_i
        hand_over()  # chunk i - 1's gradients, which travelled while row i ran (overlap)
        pending.append((i, exchange))
        if not overlap:
            hand_over()
        # Released only now: on CPU the fetched tensors are the pooled buffers themselves (at one rank the
        # gradients handed over may be one of them; under SP the exchange's send buffer holds copies).
        for s in (stored.k[i], stored.v[i], stored.q[i], stored.o[i], stored.lse[i], do_slots[i], dq_slots[i]):
            store.release(s)

    pending: list[tuple[int, Exchange]] = []  # the chunk whose dq, dk, dv exchange is in flight (overlap)

    def hand_over() -> None:
        # The exchange in flight waited (guarded: a failed peer is SPPeerFailure here), its chunk to the source.
        if pending:
            i, exchange = pending.pop()
            source.backward_chunk(i, saved, *exchange.wait())

    done = 0  # chunks handed to the source so far (in order)
    prefetch(0)
    for b, (i, j) in enumerate(blocks):
        if b == row_start[i]:  # a row starts (at its diagonal block unless a padding mask dropped it)
            while done < i:  # rows no query attends
                finish(done, None, None, None)
                done += 1
            k, v = (f.wait() for f in kv_sets.pop(i))
            dk = dv = dq_i = None
        got = [f.wait() for f in query_sets.pop(b)]
        qj, oj, lsej, doj = got[:4]
        if sinks is not None:  # the sink's gradient, once per query chunk, from its final (o', lse') and dO
            sinks.backward_chunk(j, oj, lsej, doj)
        causal, mask = pattern.block(j, i, qj.device)
        if pattern.may_empty_rows:  # rows that see no key: exp(s - inf) = 0 in every kernel, not exp(-inf + inf)
            lsej = lsej.masked_fill(torch.isneginf(lsej), float("inf"))
        dq_b, dk_b, dv_b = router.backward(doj, qj, k, v, oj, lsej, causal, scale, mask=mask, softcap=softcap)
        if dk is None:  # float32 accumulators (float64 stays float64), started from the first block
            acc_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
            dk = dk_b.to(acc_dtype, memory_format=torch.contiguous_format)
            dv = dv_b.to(acc_dtype, memory_format=torch.contiguous_format)
        else:
            dk += dk_b
            dv += dv_b
        acc = got[4] if len(got) > 4 else None
        if j == i:
            dq_i = dq_b if acc is None else acc.add_(dq_b)
        elif acc is None:
            dq_slots[j] = store.put(dq_b.to(dk.dtype))
        else:
            store.put(acc.add_(dq_b), dq_slots[j])
        del got, qj, oj, lsej, doj, dq_b, dk_b, dv_b, acc, mask
        prefetch(b + 1)  # block b's update is queued: fetches that waited for it can start
        if b + 1 < len(blocks) and blocks[b + 1][0] == i:
            continue  # the row goes on
        del k, v
        finish(i, dq_i, dk, dv)
        done = i + 1
        del dk, dv, dq_i
    while done < n:  # the last rows no query attends
        finish(done, None, None, None)
        done += 1
    hand_over()  # the last chunk's gradients


class FPDTAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(source, runtime, scale, *inputs) -> out [B, S_local, H, D]``.

    ``inputs`` are the tensors the source needs gradients for; what backward needs of them is saved
    through ``save_for_backward`` (so activation checkpointing's hooks see it), the chunks through the
    host store.
    """

    @staticmethod
    def forward(ctx, source: ChunkSource, runtime: FPDTRuntime, scale: float, *inputs: torch.Tensor):
        with runtime.threads.scope(inputs[0].device):  # many small kernels: see hf_fpdt.attention.threads
            return FPDTAttentionFunction._forward(ctx, source, runtime, scale, *inputs)

    @staticmethod
    def _forward(ctx, source: ChunkSource, runtime: FPDTRuntime, scale: float, *inputs: torch.Tensor):
        keep = any(ctx.needs_input_grad[3:])
        ckpt = runtime.checkpointing
        # A non-reentrant checkpoint's recomputation: its backward never runs (the first forward's does),
        # so it stores nothing of its own. Where the first forward kept its chunks, the output is rebuilt
        # from them; where it kept nothing (over the host budget), attention is computed again and the
        # chunks go to the first forward's backward through the log entry. Saved tensors stay the same as
        # the first forward's, which the checkpoint matches one by one.
        recompute = keep and ckpt.recomputing
        entry = ckpt.replayed() if recompute else None
        first = entry.stored() if entry is not None and entry.kept else None
        stored = None
        if first is not None and first.holds_output(source.sizes, runtime.sp_size):
            out = replay_attention_forward(first, source.sizes, runtime)
            entry.rng_after.restore()
        elif entry is not None and not entry.kept:
            out, entry.recomputed = chunked_attention_forward(
                source, inputs, runtime, scale, True, lasting=False, blocks=entry.blocks
            )
        elif keep and not recompute and ckpt.recording:
            asked: list[int] = []  # the bytes the call would keep, as the budget was asked about them
            out, stored = chunked_attention_forward(
                source, inputs, runtime, scale, lambda nbytes: asked.append(nbytes) or ckpt.may_keep(nbytes)
            )
            if stored.o:  # kept within the budget: replayed by the recomputation, counted until backward
                ckpt.charge(stored, asked[0])
                entry = ReplayEntry(weakref.ref(stored), RngState.capture(out.device))
            else:  # over the budget: the recomputation computes (with this forward's blocks) and stores the chunks
                entry, stored = ReplayEntry(blocks=stored.blocks), None
            ckpt.record(entry)
        else:
            out, stored = chunked_attention_forward(source, inputs, runtime, scale, keep and not recompute)
        if keep:
            ctx.source, ctx.runtime, ctx.scale = source, runtime, scale
            ctx.stored = None if recompute else stored
            ctx.entry = None if recompute else entry
            ctx.save_for_backward(*source.to_save(inputs))
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        stored, entry = ctx.stored, ctx.entry
        if stored is None and entry is not None:
            stored, entry.recomputed = entry.recomputed, None
        if stored is None:
            raise RuntimeError(
                "backward through an FPDT attention that stored nothing: either a non-reentrant checkpoint's "
                "recomputed graph is differentiated, or the first forward's graph without its recomputation"
            )
        with ctx.runtime.threads.scope(dout.device):
            chunked_attention_backward(ctx.source, ctx.saved_tensors, stored, dout, ctx.runtime, ctx.scale)
        ctx.stored = ctx.entry = None
        return (None, None, None, *ctx.source.input_grads())


class TensorSource:
    """Chunk source over full local q/k/v tensors (the ``attn_implementation="fpdt"`` path).

    ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]``. Nothing of them is saved: backward only writes the
    chunk gradients into full-size gradient tensors.
    """

    def __init__(self, sizes: list[int], num_heads: int, num_kv_heads: int, spec: MaskSpec | None = None) -> None:
        self.sizes, self.num_heads, self.num_kv_heads = sizes, num_heads, num_kv_heads
        self.spec = spec if spec is not None else MaskSpec()
        self._spans = chunk_spans(sizes)
        self._grads: list[torch.Tensor | None] = [None, None, None]
        self._shapes: tuple = ()

    def forward_chunk(self, i: int, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._shapes = tuple((t.shape, t.dtype, t.device) for t in inputs)
        return tuple(t[:, self._spans[i]] for t in inputs)

    def to_save(self, inputs: tuple) -> tuple:
        return ()

    def backward_chunk(self, i: int, saved: tuple, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self._grads[0] is None:
            self._grads = [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in self._shapes]
        for g, chunk in zip(self._grads, (dq, dk, dv)):
            g[:, self._spans[i]] = chunk

    def input_grads(self) -> tuple:
        grads, self._grads = tuple(self._grads), [None, None, None]
        return grads


def fpdt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runtime: FPDTRuntime,
    scale: float | None = None,
    spec: MaskSpec | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of local ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` chunk by chunk.

    With a sequence-parallel group in ``runtime`` the local tensors must be in FPDT's rank-ordinal
    layout (:mod:`hf_fpdt.data.layout`); the result is this rank's ``[B, S, H, D]`` output. ``spec``
    (:class:`hf_fpdt.attention.block_mask.MaskSpec`, in global token order; ``None``: plain causal) masks the call
    further: a sliding window (blocks outside it are skipped), a softcap, packed documents (blocks across a
    document boundary are skipped or masked), a block-sparse pattern (blocks it drops are neither fetched
    nor computed), a key padding mask or a causal 4D mask (:class:`hf_fpdt.attention.block_mask.BlockMask` reads
    both one block at a time; rows that see no key give 0, as sdpa does). ``sinks [H]``: attention sinks (HF's
    ``s_aux``), one logit per query head in every row's softmax denominator (:mod:`hf_fpdt.attention.sinks`).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    hints = {"dtype": q.dtype, "width": q.shape[2] * q.shape[3], "kv_ratio": k.shape[2] / q.shape[2]}
    sizes = runtime.chunk_sizes(q.shape[1], q.device, **hints)
    heads = runtime.head_group(q.shape[2], k.shape[2]) if sinks is not None else runtime.group  # the sinks' split
    source, inputs = with_sinks(TensorSource(sizes, q.shape[2], k.shape[2], spec), (q, k, v), sinks, heads)
    return FPDTAttentionFunction.apply(source, runtime, scale, *inputs)
