"""Sequence-parallel (SP) and data-parallel (DP) process groups built from the world: world = dp x sp.

Ranks are laid out SP-major, so an SP group is a block of consecutive ranks (on GPUs: the fast
intra-node links carry the per-chunk all-to-alls)::

    world rank  w = d * sp + s           d = DP index (which batch), s = SP index (which tokens)
    SP group d  = [d * sp, ..., d * sp + sp - 1]       (shares one batch)
    DP group s  = [s, s + sp, ..., s + (dp - 1) * sp]  (same token positions of different batches)

Nothing is stored globally: :func:`build_groups` returns the groups, and callers pass them on
(``hf_fpdt.apply(model, config, group=groups.sp)``). Their collectives wait at most ``timeout`` for a missing
rank (:data:`DEFAULT_TIMEOUT`, 600 s, unless given; gloo's own default is 30 minutes), and so does the group
creation itself: a rank that never arrives ends :func:`build_groups` with an
:class:`~hf_fpdt.core.agreement.SPPeerFailure`. The groups it creates are destroyed at interpreter
exit unless the program destroyed them first (:func:`destroy_at_exit`): a gloo group left to interpreter
shutdown can abort a finished process with ``terminate called without an active exception``.
"""

from __future__ import annotations

import atexit
import math
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .agreement import SPPeerFailure, is_collective_error

DEFAULT_TIMEOUT = 600.0  # seconds: build_groups' default and FPDTPlugin's sp_timeout (gloo's own: 30 minutes)


def check_timeout(timeout: float | timedelta, name: str = "timeout") -> timedelta:
    """``timeout`` (seconds or a ``timedelta``) as a ``timedelta``; ``ValueError`` unless positive and finite.

    Zero is not "no timeout" to torch: a group created with it may block forever in its connection set-up
    (gloo), and every collective would fail at once."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{name}={timeout!r}: use a positive, finite number of seconds (how long a collective waits for a "
            f"missing rank before every rank fails with an error; 0 does not mean 'no timeout'; the default is "
            f"{DEFAULT_TIMEOUT:g})"
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def group_ranks(world_size: int, sp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """World ranks of every SP group and every DP group (pure; raises ``ValueError`` when sp does not divide)."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size={sp_size!r}: use a positive number of processes")
    if world_size % sp_size != 0:
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world_size}: world = dp x sp needs a "
            f"sequence-parallel size among the divisors of {world_size}"
        )
    dp_size = world_size // sp_size
    sp_groups = [list(range(d * sp_size, (d + 1) * sp_size)) for d in range(dp_size)]
    dp_groups = [list(range(s, world_size, sp_size)) for s in range(sp_size)]
    return sp_groups, dp_groups


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups and coordinates.

    Attributes:
        sp: the SP group (ranks sharing one batch; pass it to ``hf_fpdt.apply``).
        dp: the DP group (ranks holding different batches; gradient averaging).
        sp_size, dp_size: group sizes (``sp_size * dp_size`` = world size).
        sp_rank: rank within ``sp`` (use for ``hf_fpdt.data.layout.shard_batch(rank=...)``).
        dp_rank: rank within ``dp`` (which batch of the global batch this rank's SP group takes).
    """

    sp: dist.ProcessGroup
    dp: dist.ProcessGroup
    sp_size: int
    dp_size: int
    sp_rank: int
    dp_rank: int


def build_groups(
    sp_size: int, backend: str | None = None, timeout: float | timedelta = DEFAULT_TIMEOUT
) -> ParallelGroups:
    """Create the SP and DP groups of an initialised world (a collective: every rank must call it).

    Args:
        sp_size: ranks per SP group; must divide the world size.
        backend: backend of the new groups; ``None`` = the world's backend.
        timeout: how long a collective of the new groups waits for a missing rank (seconds or a
            ``timedelta``; positive and finite) before it fails: :data:`DEFAULT_TIMEOUT` (600 s) unless given.
            It bounds how long the ranks of an SP group wait for a peer that failed
            (:mod:`hf_fpdt.core.agreement`), and how long the group creation waits for every rank to arrive.

    Raises:
        ValueError: ``sp_size`` does not divide the world size, or ``timeout`` is not positive.
        SPPeerFailure: a rank did not arrive within ``timeout`` (it died, or is late).
    """
    timeout = check_timeout(timeout)
    if not dist.is_initialized():
        raise ValueError("build_groups needs torch.distributed initialised (init_process_group) first")
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_groups, dp_groups = group_ranks(world, sp_size)
    mine: dict = {}
    created = []
    start = time.monotonic()
    # new_group is collective over the world: every rank creates every group, in the same order.
    try:
        for kind, all_ranks in (("sp", sp_groups), ("dp", dp_groups)):
            for ranks in all_ranks:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                created.append(group)
                if rank in ranks:
                    mine[kind] = group
    except RuntimeError as exc:  # DistStoreError, gloo's connection errors: a rank missing
        if not is_collective_error(exc):
            raise
        others = [r for r in range(world) if r != rank]
        who = f"world rank {others[0]}" if len(others) == 1 else f"one of world ranks {others}"
        raise SPPeerFailure(
            f"world rank {rank} of {world}: build_groups (new_group, creating the SP and DP groups) failed after "
            f"{time.monotonic() - start:.1f} s (timeout {timeout.total_seconds():g} s): {who} did not arrive (it "
            f"died, raised before build_groups, or is late beyond the timeout); see the other ranks' logs ({exc})"
        ) from exc
    destroy_at_exit(*(g for g in created if g is not dist.GroupMember.NON_GROUP_MEMBER))
    return ParallelGroups(
        sp=mine["sp"],
        dp=mine["dp"],
        sp_size=sp_size,
        dp_size=world // sp_size,
        sp_rank=rank % sp_size,
        dp_rank=rank // sp_size,
    )


def set_group_timeout(group: dist.ProcessGroup, timeout: float | timedelta) -> None:
    """Set how long collectives of an existing ``group`` (e.g. the world, created by Accelerate or Trainer
    with their own 30-minute default) wait for a missing rank; collectives started afterwards use it.

    Uses torch's ``_set_pg_timeout`` (gloo and NCCL); raises ``ValueError`` when this torch lacks it.
    """
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=timeout)
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise ValueError(
            f"this torch ({torch.__version__}) cannot change a process group's timeout; create the world with "
            "init_process_group(timeout=...) (Accelerate: InitProcessGroupKwargs, Trainer: ddp_timeout)"
        )
    setter(timeout, group)


def destroy_at_exit(*groups: dist.ProcessGroup | None) -> None:
    """Destroy ``groups`` (``None``: the default group, i.e. every group) at interpreter exit, before
    shutdown, unless the program destroyed them first (then nothing happens). Register only groups
    that hf_fpdt created: a group the program created stays the program's to destroy."""
    atexit.register(_destroy, [dist.group.WORLD if g is None else g for g in groups], None in groups)


def _destroy(groups: list[dist.ProcessGroup], whole_world: bool) -> None:
    if not dist.is_initialized():
        return  # the program destroyed the world, and with it every group
    for group in groups:
        if group is dist.group.WORLD and whole_world:
            dist.destroy_process_group()
            return
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError, AssertionError, KeyError):
            pass  # already destroyed by the program, or from a world since replaced
