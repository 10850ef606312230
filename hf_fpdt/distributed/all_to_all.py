"""Ulysses sequence parallelism: the chunked all-to-all between sequence and head layouts.

Every function takes the sequence-parallel (SP) process group explicitly; ``group=None`` means one
process (the identity). Shapes, with P the SP size::

    local chunk   [B, l, H, D]        (this rank's l tokens, all heads)
    global chunk  [B, P * l, H / P, D] (all ranks' tokens of the chunk, this rank's heads)

Key/value heads: when P exceeds the number of key/value heads (GQA/MQA), each KV head is replicated
``P / Hkv`` times before the scatter, so every rank receives the KV head its query heads use; in
backward the replicas' gradients are summed. The same code runs on gloo (CPU) and NCCL (GPU).

Uneven splits (P does not divide the query heads, or the KV heads neither divide P nor are divided by it; see
:mod:`hf_fpdt.data.head_split`): :func:`start_scatter_heads_split` / :func:`start_gather_heads_split` move
pieces of different sizes (``all_to_all_single`` with input and output split sizes): rank t receives its query
heads and exactly the KV heads they use; in the gather each source rank's heads land in their place, and the
gradients of a KV head several ranks held are summed. Where the split is even the two call the equal-piece
functions below, unchanged.

Packed: :func:`scatter_heads_packed` / :func:`gather_heads_packed` move several tensors of a chunk (q, k, v
forward; dq, dk, dv backward) in one collective. Each rank's piece is the tensors' head slices side by side
along the last axis, flattened per token (``[P, B, l, sum_t H_t / P * D_t]``), so GQA's different head counts
and head dims pack without padding; each result is copied out of the receive buffer into a tensor of its own
(a view would keep the whole buffer alive while any of them is stored: k and v outlive q). The ranks hold the
same chunk plan and model (agreed before the first step: :mod:`hf_fpdt.distributed.agreement`), so their
pieces have the same sizes; a rank that fails in the exchange is named by
:func:`hf_fpdt.distributed.peers.peer_failure`.

In flight: :func:`start_scatter_heads_packed` / :func:`start_gather_heads_packed` pack the send buffer and issue the
collective with ``async_op=True``, returning an :class:`Exchange` whose :meth:`Exchange.wait` waits for it and
unpacks the result (the same copies as the synchronous functions, which are ``start_...(...).wait()``: the bits
are the same). Its wait is guarded as the synchronous collective is: a peer that raised, died or stalled while the
exchange was in flight is :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming it, within the group's timeout.

Waits, on any backend, go through :func:`~hf_fpdt.distributed.peers.wait_collective`: gloo's blocking wait raises at
the group's timeout; NCCL's ``work.wait()`` only orders the stream and never raises for a missing peer, so there the
host polls the work up to a deadline inside the timeout. That is one host synchronisation per exchange (one per
chunk and direction, issued and waited by the chunk loop), never one per block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..data.head_split import HeadSplit
from .peers import peer_failure, wait_collective


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def kv_replicas(num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is replicated before the head scatter (1 = none)."""
    return sp_size // num_kv_heads if sp_size > num_kv_heads else 1


EXCHANGE = "all_to_all of an attention chunk"  # what a failed exchange names


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # x [P, ...] contiguous: slice r goes to rank r; the result's slice r came from rank r.
    out = torch.empty_like(x)
    started = time.monotonic()
    try:
        work = dist.all_to_all_single(out, x, group=group, async_op=True)
    except RuntimeError as exc:  # a peer raised, died or stalled: say which, when it left a note
        raise peer_failure(group, exc, EXCHANGE) from exc
    wait_collective(work, group, EXCHANGE, started=started)  # gloo: the blocking wait a synchronous call makes
    return out


class Exchange:
    """A packed all-to-all in flight (or done: one process, or a synchronous call).

    Holds the send buffer and the receive buffer until :meth:`wait`, which waits for the collective (guarded:
    an error or timeout becomes :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming the peer) and returns
    the unpacked tensors. Waited once; a second :meth:`wait` returns the same tensors.

    ``started``: when the collective was issued (``time.monotonic()``; the wait's deadline counts from it).
    ``poll``: whether the host polls the work (default: from the group's backend,
    :func:`~hf_fpdt.distributed.peers.host_polls`); see :func:`~hf_fpdt.distributed.peers.wait_collective`.
    ``what``: the collective a failure names (default: the head all-to-all).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        work: object | None,
        buffers: tuple,
        unpack: Callable[[], list[torch.Tensor]],
        *,
        started: float | None = None,
        poll: bool | None = None,
        what: str = EXCHANGE,
    ) -> None:
        self._group, self._work, self._buffers, self._unpack = group, work, buffers, unpack
        self._what = what
        self._started = time.monotonic() if started is None else started
        self._poll = poll
        self._result: list[torch.Tensor] | None = None

    @classmethod
    def done(cls, result: list[torch.Tensor]) -> Exchange:
        """An exchange with nothing to wait for (one process)."""
        return cls(None, None, (), lambda: result)

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            if self._work is not None:
                # As _all_to_all: the peer that raised, died or stalled, named, within the group's timeout. On NCCL
                # the host polls here: one host synchronisation per exchange, none per block.
                wait_collective(self._work, self._group, self._what, started=self._started, poll=self._poll)
                self._work = None
            self._result = self._unpack()
            self._buffers, self._unpack = (), None  # send and receive buffers go; the results are copies
        return self._result


def start_all_to_all(
    send: torch.Tensor,
    group: dist.ProcessGroup,
    unpack: Callable[[torch.Tensor], list[torch.Tensor]],
    what: str = EXCHANGE,
) -> Exchange:
    """Issue the all-to-all of ``send [P, ...]`` with ``async_op=True``: an :class:`Exchange` unpacking its result
    (``unpack(recv)``); ``what`` names the collective in a peer failure's message."""
    recv = torch.empty_like(send)
    started = time.monotonic()
    try:
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    except RuntimeError as exc:
        raise peer_failure(group, exc, what) from exc
    return Exchange(group, work, (send, recv), lambda: unpack(recv), started=started, what=what)


def repeat_heads(x: torch.Tensor, replicas: int) -> torch.Tensor:
    """``[B, S, H, D] -> [B, S, H * replicas, D]``, each head repeated in place (HF's ``repeat_kv`` order: head h of
    the result is head ``h // replicas``)."""
    if replicas == 1:
        return x
    b, n, h, d = x.shape
    return x.unsqueeze(3).expand(b, n, h, replicas, d).reshape(b, n, h * replicas, d)


def sum_repeated_heads(x: torch.Tensor, replicas: int) -> torch.Tensor:
    """The gradient of :func:`repeat_heads`: each group of ``replicas`` consecutive heads summed."""
    if replicas == 1:
        return x
    b, n, h, d = x.shape
    return x.reshape(b, n, h // replicas, replicas, d).sum(3)


def _check_packable(xs: Sequence[torch.Tensor], p: int, what: str) -> None:
    first = xs[0]
    for x in xs:
        if x.dim() != 4 or x.shape[:2] != first.shape[:2] or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"{what}: the tensors of one packed all-to-all must be [B, L, heads, D] with the same B, L, dtype and "
                f"device; got {[(tuple(t.shape), t.dtype, str(t.device)) for t in xs]}"
            )
        if x.shape[2] % p:
            raise ValueError(f"{what}: {x.shape[2]} heads do not split over {p} ranks")


def scatter_heads_packed(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Local chunks ``[B, l, H_t, D_t]`` -> global chunks ``[B, P*l, H_t*r_t/P, D_t]``, all in one all-to-all.

    ``replicas[t]`` (default 1): how many times tensor t's heads are replicated first (:func:`kv_replicas`).
    """
    return start_scatter_heads_packed(xs, group, replicas).wait()


def start_scatter_heads_packed(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: Sequence[int] | None = None
) -> Exchange:
    """:func:`scatter_heads_packed` issued, not waited: the send buffer is packed (a copy, so ``xs`` may go),
    the collective is in flight, and :meth:`Exchange.wait` returns the global chunks."""
    xs = [repeat_heads(x, r) for x, r in zip(xs, replicas or [1] * len(xs))]
    p = group_size(group)
    if p == 1:
        return Exchange.done(xs)
    _check_packable(xs, p, "scatter_heads_packed")
    b, n = xs[0].shape[:2]
    widths = [x.shape[2] // p * x.shape[3] for x in xs]  # per rank: its heads x D, per token
    send = xs[0].new_empty(p, b, n, sum(widths))
    at = 0
    for x, w in zip(xs, widths):  # [B, n, H, D] -> [P, B, n, H/P, D] into the piece of each rank
        h, d = x.shape[2:]
        send[..., at : at + w].view(p, b, n, h // p, d).copy_(x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4))
        at += w
    shapes = [(x.shape[2] // p, x.shape[3]) for x in xs]
    del xs

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:  # recv [P (source rank = sequence piece), B, n, widths]
        out, at = [], 0
        for (h, d), w in zip(shapes, widths):
            piece = recv[..., at : at + w].view(p, b, n, h, d)
            out.append(piece.permute(1, 0, 2, 3, 4).reshape(b, p * n, h, d).contiguous())
            at += w
        return out

    return start_all_to_all(send, group, unpack)


def gather_heads_packed(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Global chunks ``[B, P*l, h_t, D_t]`` -> local chunks ``[B, l, P*h_t/r_t, D_t]`` (inverse of
    :func:`scatter_heads_packed`), all in one all-to-all; replicated heads are summed (the adjoint)."""
    return start_gather_heads_packed(xs, group, replicas).wait()


def _pieces_by_rank(xs: Sequence[torch.Tensor], p: int, b: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """Global chunks ``[B, P*n, h_t, D_t]`` packed as one send buffer ``[P, B, n, sum of h_t*D_t]`` (sequence piece
    ``r`` of each goes to rank ``r``), and each tensor's width in it."""
    widths = [x.shape[2] * x.shape[3] for x in xs]
    send = xs[0].new_empty(p, b, n, sum(widths))
    at = 0
    for x, w in zip(xs, widths):  # [B, P*n, h, D] -> [P, B, n, h, D]
        h, d = x.shape[2:]
        send[..., at : at + w].view(p, b, n, h, d).copy_(x.reshape(b, p, n, h, d).permute(1, 0, 2, 3, 4))
        at += w
    return send, widths


def start_gather_heads_packed(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: Sequence[int] | None = None
) -> Exchange:
    """:func:`gather_heads_packed` issued, not waited: the send buffer is packed (a copy, so ``xs`` may go),
    the collective is in flight, and :meth:`Exchange.wait` returns the local chunks."""
    p = group_size(group)
    reps = list(replicas or [1] * len(xs))
    if p == 1:
        return Exchange.done([sum_repeated_heads(x, r) for x, r in zip(xs, reps)])
    _check_packable(xs, 1, "gather_heads_packed")
    b, pl = xs[0].shape[:2]
    n = pl // p
    send, widths = _pieces_by_rank(xs, p, b, n)
    shapes = [tuple(x.shape[2:]) for x in xs]

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:  # recv [P (source rank = head group), B, n, widths]
        out, at = [], 0
        for (h, d), w, r in zip(shapes, widths, reps):
            piece = recv[..., at : at + w].view(p, b, n, h, d)
            out.append(sum_repeated_heads(piece.permute(1, 2, 0, 3, 4).reshape(b, n, p * h, d).contiguous(), r))
            at += w
        return out

    return start_all_to_all(send, group, unpack)


def scatter_heads(x: torch.Tensor, group: dist.ProcessGroup | None, replicas: int = 1) -> torch.Tensor:
    """Local chunk ``[B, l, H, D]`` -> global chunk ``[B, P*l, H*replicas/P, D]``."""
    p = group_size(group)
    if replicas > 1:
        b, n, h, d = x.shape
        x = x.unsqueeze(3).expand(b, n, h, replicas, d).reshape(b, n, h * replicas, d)
    if p == 1:
        return x
    b, n, h, d = x.shape
    send = x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, n, H/P, D]
    recv = _all_to_all(send, group)  # [P (source rank = sequence piece), B, l, H/P, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)


def gather_heads(x: torch.Tensor, group: dist.ProcessGroup | None, replicas: int = 1) -> torch.Tensor:
    """Global chunk ``[B, P*l, h, D]`` -> local chunk ``[B, l, P*h/replicas, D]`` (inverse of scatter).

    With ``replicas > 1`` the replicated heads are summed, which is the adjoint of the replication
    and so the right thing for gradients.
    """
    p = group_size(group)
    if p > 1:
        b, pl, h, d = x.shape
        send = x.reshape(b, p, pl // p, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, B, l, h, D]
        recv = _all_to_all(send, group)  # [P (source rank = head group), B, l, h, D]
        x = recv.permute(1, 2, 0, 3, 4).reshape(b, pl // p, p * h, d)
    if replicas > 1:
        b, n, h, d = x.shape
        x = x.reshape(b, n, h // replicas, replicas, d).sum(3)
    return x


# Uneven head splits (hf_fpdt.data.head_split): pieces of different sizes, one flat buffer per direction.


def _kv_flags(xs: Sequence[torch.Tensor], kv: Sequence[bool] | None) -> list[bool]:
    return [False] * len(xs) if kv is None else list(kv)


def _start_split(
    send: torch.Tensor,
    send_sizes: list[int],
    recv_sizes: list[int],
    group: dist.ProcessGroup,
    unpack: Callable[[torch.Tensor], list[torch.Tensor]],
) -> Exchange:
    """Issue the all-to-all of the flat ``send`` (piece t, ``send_sizes[t]`` elements, to rank t) with
    ``async_op=True``; the result's piece s (``recv_sizes[s]`` elements) came from rank s."""
    recv = send.new_empty(sum(recv_sizes))
    started = time.monotonic()
    try:
        work = dist.all_to_all_single(
            recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group, async_op=True
        )
    except RuntimeError as exc:
        raise peer_failure(group, exc, EXCHANGE) from exc
    return Exchange(group, work, (send, recv), lambda: unpack(recv), started=started)


def _layout_runs(split: HeadSplit, rank: int) -> list[tuple[int, int]] | None:
    """Rank ``rank``'s kernel layout of KV heads as runs ``(received head, copies)`` in order (None: the received
    heads as they are). Slices and expands, no index tensor: nothing goes from the host to the device."""
    if not split.repeats(rank):
        return None
    a, runs = split.kv_range(rank)[0], []
    for h in split.kv_layout(rank):
        if runs and runs[-1][0] == h - a:
            runs[-1] = (h - a, runs[-1][1] + 1)
        else:
            runs.append((h - a, 1))
    return runs


def _repeat_runs(x: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``x [B, S, h, D]`` -> its heads repeated as ``runs`` say (a new tensor)."""
    b, n, _, d = x.shape
    return torch.cat([x[:, :, h : h + 1].expand(b, n, k, d) for h, k in runs], dim=2)


def _sum_runs(x: torch.Tensor, runs: list[tuple[int, int]], heads: int) -> torch.Tensor:
    """The adjoint of :func:`_repeat_runs`: ``x [B, S, sum k, D]`` -> ``[B, S, heads, D]``, each run summed onto its
    head."""
    out = x.new_zeros(*x.shape[:2], heads, x.shape[3])
    at = 0
    for h, k in runs:
        out[:, :, h] += x[:, :, at : at + k].sum(2)
        at += k
    return out


def start_scatter_heads_split(
    xs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    split: HeadSplit,
    kv: Sequence[bool] | None = None,
) -> Exchange:
    """Local chunks ``[B, l, H_t, D_t]`` -> global chunks ``[B, P*l, h_t, D_t]`` of this rank's heads, in one
    all-to-all: a query-head tensor (``kv[t]`` False) gives ``h_t`` = this rank's query heads
    (:meth:`HeadSplit.q_range`), a key/value one (``kv[t]`` True) its kernels' layout of the KV heads those use
    (:meth:`HeadSplit.kv_layout`). Even splits go the equal-piece way (:func:`start_scatter_heads_packed`, the KV
    heads replicated ``split.replicas`` times)."""
    flags = _kv_flags(xs, kv)
    p = group_size(group)
    if split.even or p == 1:
        return start_scatter_heads_packed(xs, group, [split.replicas if f else 1 for f in flags])
    me = group_rank(group)
    b, n = xs[0].shape[:2]
    ranges = [[split.kv_range(t) if f else split.q_range(t) for f in flags] for t in range(p)]
    widths = [[(c - a) * x.shape[3] for (a, c), x in zip(ranges[t], xs)] for t in range(p)]
    sizes = [b * n * sum(w) for w in widths]
    send = xs[0].new_empty(sum(sizes))
    at = 0
    for t in range(p):  # piece t: rank t's heads of every tensor, side by side per token
        piece = send[at : at + sizes[t]].view(b, n, sum(widths[t]))
        col = 0
        for x, (a, c), w in zip(xs, ranges[t], widths[t]):
            piece[..., col : col + w].view(b, n, c - a, x.shape[3]).copy_(x[:, :, a:c])
            col += w
        at += sizes[t]
    dims = [x.shape[3] for x in xs]
    mine = ranges[me]
    runs = _layout_runs(split, me)
    del xs

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:  # recv: P equal pieces, source rank = sequence piece
        grid = recv.view(p, b, n, sum(widths[me]))
        out, col = [], 0
        for (a, c), d, f in zip(mine, dims, flags):
            w = (c - a) * d
            t = grid[..., col : col + w].view(p, b, n, c - a, d).permute(1, 0, 2, 3, 4).reshape(b, p * n, c - a, d)
            out.append(_repeat_runs(t, runs) if f and runs is not None else t.contiguous())
            col += w
        return out

    return _start_split(send, sizes, [sizes[me]] * p, group, unpack)


def start_gather_heads_split(
    xs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    split: HeadSplit,
    kv: Sequence[bool] | None = None,
) -> Exchange:
    """Global chunks of this rank's heads ``[B, P*l, h_t, D_t]`` -> local chunks ``[B, l, H_t, D_t]`` (the adjoint
    of :func:`start_scatter_heads_split`), in one all-to-all: a query-head tensor's heads land in their place, a
    key/value one's (its kernels' layout, ``kv[t]`` True) are summed onto the KV heads they repeat, and onto the
    same KV head from every rank that held it (the gradients of replicated heads). Even splits go the equal-piece
    way (:func:`start_gather_heads_packed`)."""
    flags = _kv_flags(xs, kv)
    p = group_size(group)
    if split.even or p == 1:
        return start_gather_heads_packed(xs, group, [split.replicas if f else 1 for f in flags])
    me = group_rank(group)
    b, pl = xs[0].shape[:2]
    n = pl // p
    runs = _layout_runs(split, me)
    a, c = split.kv_range(me)
    # the layout's repeated heads summed onto the received ones
    parts = [_sum_runs(x, runs, c - a) if f and runs is not None else x for x, f in zip(xs, flags)]
    send, widths = _pieces_by_rank(parts, p, b, n)
    del parts
    shapes = [(split.kv_heads if f else split.heads, x.shape[3]) for x, f in zip(xs, flags)]
    ranges = [[split.kv_range(s) if f else split.q_range(s) for f in flags] for s in range(p)]
    recv_sizes = [b * n * sum((c - a) * d for (a, c), (_, d) in zip(ranges[s], shapes)) for s in range(p)]
    dtype, device = xs[0].dtype, xs[0].device
    del xs

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:  # piece s: rank s's heads of this rank's tokens
        make = {True: torch.zeros, False: torch.empty}  # KV heads are sums; query heads each written once
        out = [make[f](b, n, h, d, dtype=dtype, device=device) for (h, d), f in zip(shapes, flags)]
        at = 0
        for s in range(p):
            piece = recv[at : at + recv_sizes[s]].view(b, n, -1)
            col = 0
            for o, (a, c), (_, d), f in zip(out, ranges[s], shapes, flags):
                w = (c - a) * d
                got = piece[..., col : col + w].view(b, n, c - a, d)
                if f:  # a KV head other ranks held too: their gradients summed
                    o[:, :, a:c] += got
                else:
                    o[:, :, a:c] = got
                col += w
            at += recv_sizes[s]
        return out

    return _start_split(send.view(-1), [b * n * sum(widths)] * p, recv_sizes, group, unpack)
