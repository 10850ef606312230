"""The ring beside Ulysses: an SP group of ``P = U x R`` ranks as R Ulysses groups of U ranks, and the exchanges
of key/value chunks (forward) and of their gradients (backward) between the groups.

SP rank ``s = g * U + u`` (``g``: which Ulysses group, its place in the ring; ``u``: its rank inside it)::

    Ulysses group g = SP ranks {g*U + u : u}     the chunked all-to-all (heads <-> sequence), as without a ring
    ring group u    = SP ranks {g*U + u : g}     the same heads, the R groups' chunks of each round

Both are made once per runtime by :func:`build_ring_groups` (``dist.new_group`` with ``use_local_synchronization``:
only the members of a group create it, so the ranks of other SP groups, under data parallelism, need not take part;
every rank creates its Ulysses group first and then its ring group, one global order, so no two creations wait on
each other; destroyed at interpreter exit, :func:`~hf_fpdt.distributed.groups.destroy_at_exit`), and passed
explicitly. Shapes of round i (``l_i`` local tokens, ``C_i = U * l_i``)::

    k_i, v_i       [B, C_i, h, D]       this rank's global chunk of round i (its heads: those of rank u of a group)
    gathered       R x (k, v)           every ring member's, in ring order (:func:`start_ring_gather`)
    partial dk/dv  R x [B, C_i, h, D]   this rank's share of the gradient of each member's chunk (float32)
    reduced        dk, dv               its own chunk's, the R shares summed (:func:`start_ring_reduce`)

Both exchanges are issued with ``async_op=True`` and return an :class:`~hf_fpdt.distributed.all_to_all.Exchange`
whose wait is guarded (a peer that failed is :class:`~hf_fpdt.distributed.peers.SPPeerFailure` on every rank within
the group's timeout). Bytes per rank and round: the gather receives ``(R - 1) x`` its k, v; the reduce sends and
receives ``(R - 1) x`` its dk, dv (float32).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .all_to_all import Exchange, start_all_to_all
from .groups import destroy_at_exit
from .peers import SPPeerFailure, is_collective_error, peer_failure
from .timeouts import group_timeout

RING_GATHER = "all_gather of the ring's key/value chunks"
RING_REDUCE = "all_to_all of the ring's key/value gradients"


@dataclass(frozen=True)
class RingGroups:
    """This rank's Ulysses group and ring group inside its SP group of ``ulysses_size * ring_size`` ranks.

    Attributes:
        ulysses: the Ulysses group (the head all-to-all; ``ulysses_size`` ranks).
        ring: the ring group (the same heads in every Ulysses group; ``ring_size`` ranks).
        index: this rank's Ulysses group, its place in the ring (``g``).
        member: its rank inside the Ulysses group (``u``).
    """

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    ulysses_size: int
    ring_size: int
    index: int
    member: int


def ring_ranks(sp_size: int, ring: int) -> tuple[list[list[int]], list[list[int]]]:
    """SP ranks of every Ulysses group and every ring group (pure; ``ring`` must divide ``sp_size``)."""
    if ring < 1 or sp_size % ring:
        raise ValueError(f"ring_degree={ring} must be a positive divisor of sp_size={sp_size}")
    u = sp_size // ring
    return [[g * u + m for m in range(u)] for g in range(ring)], [[g * u + m for g in range(ring)] for m in range(u)]


def build_ring_groups(sp_group: dist.ProcessGroup, ring: int) -> RingGroups:
    """Create this rank's Ulysses and ring groups inside ``sp_group`` (every rank of ``sp_group`` calls it, with the
    same ``ring``; ranks of other SP groups need not). Raises ``SPPeerFailure`` when a member does not arrive."""
    sp, rank = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    world = dist.get_process_group_ranks(sp_group)  # SP rank -> world rank
    ulysses_ranks, ring_group_ranks = ring_ranks(sp, ring)
    u = sp // ring
    g, m = divmod(rank, u)
    timeout = group_timeout(sp_group)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    try:
        ulysses = dist.new_group([world[r] for r in ulysses_ranks[g]], use_local_synchronization=True, **kwargs)
        ring_group = dist.new_group([world[r] for r in ring_group_ranks[m]], use_local_synchronization=True, **kwargs)
    except RuntimeError as exc:
        if not is_collective_error(exc):
            raise
        raise SPPeerFailure(
            f"SP rank {rank} of {sp}: creating the ring's groups (ring_degree={ring}) failed: a peer did not arrive "
            f"(it died, or raised before its first attention call); see the other ranks' logs ({exc})"
        ) from exc
    destroy_at_exit(ulysses, ring_group)  # before interpreter shutdown, as build_groups' groups
    return RingGroups(ulysses, ring_group, u, ring, g, m)


def _flat(xs: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.cat([x.reshape(-1).to(dtype or x.dtype) for x in xs])


def _split(buf: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(buf[at : at + n].view(shape).clone())
        at += n
    return out


def start_ring_gather(xs: Sequence[torch.Tensor], group: dist.ProcessGroup) -> Exchange:
    """Every ring member's ``xs`` (this rank's k, v of a round; the same shapes on every member), gathered in one
    collective: :meth:`Exchange.wait` returns ``[x_0 of member 0, x_1 of member 0, ..., x_0 of member R-1, ...]``."""
    r = dist.get_world_size(group)
    shapes = [x.shape for x in xs]
    send = _flat(xs)
    recv = [torch.empty_like(send) for _ in range(r)]
    started = time.monotonic()
    try:
        work = dist.all_gather(recv, send, group=group, async_op=True)
    except RuntimeError as exc:
        raise peer_failure(group, exc, RING_GATHER) from exc

    def unpack() -> list[torch.Tensor]:
        return [t for buf in recv for t in _split(buf, shapes)]

    return Exchange(group, work, (send, recv), unpack, started=started, what=RING_GATHER)


def start_ring_reduce(parts: Sequence[Sequence[torch.Tensor]], group: dist.ProcessGroup) -> Exchange:
    """``parts[g]``: this rank's share of the gradients (dk, dv) of ring member g's chunk (every member's chunks of
    a round have the same shapes). One all-to-all; :meth:`Exchange.wait` returns this rank's own chunk's gradients,
    the members' shares summed in ring order (float32, or the shares' dtype when wider)."""
    r = dist.get_world_size(group)
    shapes = [x.shape for x in parts[0]]
    dtype = torch.float64 if parts[0][0].dtype == torch.float64 else torch.float32
    send = torch.cat([_flat(p, dtype) for p in parts])

    def unpack(recv: torch.Tensor) -> list[torch.Tensor]:
        total = recv.view(r, -1).sum(0)  # the members' shares of this rank's chunk, summed in ring order
        return _split(total, shapes)

    return start_all_to_all(send, group, unpack, RING_REDUCE)
