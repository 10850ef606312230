"""Ulysses sequence parallelism: the chunked all-to-all between sequence and head layouts.

Every function takes the sequence-parallel (SP) process group explicitly; ``group=None`` means one
process (the identity). Shapes, with P the SP size::

    local chunk   [B, l, H, D]        (this rank's l tokens, all heads)
    global chunk  [B, P * l, H / P, D] (all ranks' tokens of the chunk, this rank's heads)

Key/value heads: when P exceeds the number of key/value heads (GQA/MQA), each KV head is replicated
``P / Hkv`` times before the scatter, so every rank receives the KV head its query heads use; in
backward the replicas' gradients are summed. The same code runs on gloo (CPU) and NCCL (GPU).

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
    ) -> None:
        self._group, self._work, self._buffers, self._unpack = group, work, buffers, unpack
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
                wait_collective(self._work, self._group, EXCHANGE, started=self._started, poll=self._poll)
                self._work = None
            self._result = self._unpack()
            self._buffers, self._unpack = (), None  # send and receive buffers go; the results are copies
        return self._result


def _start(
    send: torch.Tensor, group: dist.ProcessGroup, unpack: Callable[[torch.Tensor], list[torch.Tensor]]
) -> Exchange:
    """Issue the all-to-all of ``send [P, ...]`` with ``async_op=True``: an :class:`Exchange` unpacking its result."""
    recv = torch.empty_like(send)
    started = time.monotonic()
    try:
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    except RuntimeError as exc:
        raise peer_failure(group, exc, EXCHANGE) from exc
    return Exchange(group, work, (send, recv), lambda: unpack(recv), started=started)


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

    return _start(send, group, unpack)


def gather_heads_packed(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Global chunks ``[B, P*l, h_t, D_t]`` -> local chunks ``[B, l, P*h_t/r_t, D_t]`` (inverse of
    :func:`scatter_heads_packed`), all in one all-to-all; replicated heads are summed (the adjoint)."""
    return start_gather_heads_packed(xs, group, replicas).wait()


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
    widths = [x.shape[2] * x.shape[3] for x in xs]
    send = xs[0].new_empty(p, b, n, sum(widths))
    at = 0
    for x, w in zip(xs, widths):  # [B, P*n, h, D] -> [P, B, n, h, D]: sequence piece r goes to rank r
        h, d = x.shape[2:]
        send[..., at : at + w].view(p, b, n, h, d).copy_(x.reshape(b, p, n, h, d).permute(1, 0, 2, 3, 4))
        at += w
    shapes = [tuple(x.shape[2:]) for x in xs]

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:  # recv [P (source rank = head group), B, n, widths]
        out, at = [], 0
        for (h, d), w, r in zip(shapes, widths, reps):
            piece = recv[..., at : at + w].view(p, b, n, h, d)
            out.append(sum_repeated_heads(piece.permute(1, 2, 0, 3, 4).reshape(b, n, p * h, d).contiguous(), r))
            at += w
        return out

    return _start(send, group, unpack)


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
