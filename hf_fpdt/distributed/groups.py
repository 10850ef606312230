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
:class:`~hf_fpdt.distributed.peers.SPPeerFailure`. The groups it creates are destroyed at interpreter
exit unless the program destroyed them first (:func:`destroy_at_exit`): a gloo group left to interpreter
shutdown can abort a finished process with ``terminate called without an active exception``.

**Nodes.** Launchers number ranks node by node (torchrun and ``accelerate launch``: node ``n`` holds ranks
``n * L .. n * L + L - 1`` for ``L`` = ``LOCAL_WORLD_SIZE`` processes per node), so the SP groups stay inside a
node whenever ``sp_size`` divides ``L``, and the DP groups run across nodes. :func:`build_groups` checks that
rather than assuming it: the ranks exchange which node each runs on (:func:`node_identity`: the host name and
torchrun's node rank ``GROUP_RANK``; two guarded all-gathers over the new SP and DP groups), rank 0 logs the
placement (:class:`Placement`, one INFO line on the ``hf_fpdt`` logger) and warns when an SP group spans nodes,
naming the group, why (``sp_size`` above or not dividing the processes per node, ranks not numbered node by
node) and the fix. The launcher's variables are cross-checked too (:func:`launch_env_problem`): ``GROUP_RANK`` set
on some ranks of a host and not on others (the ranks are then placed by host name alone), or a ``LOCAL_WORLD_SIZE``
that is not the number of ranks on that node, is a warning naming the variable and the ranks instead. A warning,
not an error: the results are the same, only the SP all-to-alls (several per layer
and chunk) cross the network between nodes, which is slower than a node's own links; an ``sp_size`` above the
processes per node is a legitimate choice for sequences one node cannot hold.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .agreement import digest
from .peers import SPPeerFailure, gather_rows, group_device, is_collective_error
from .timeouts import DEFAULT_TIMEOUT, check_timeout

_log = logging.getLogger("hf_fpdt")


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


def node_identity(env: Mapping[str, str] | None = None, hostname: str | None = None) -> str:
    """Which node this process runs on, as the ranks compare it: the host name, and the launcher's node rank
    ``GROUP_RANK`` where it sets one (torchrun and ``accelerate launch`` do; several launchers on one host, e.g.
    two "nodes" on loopback, are then told apart). ``env``: the launcher's environment (``None``: ``os.environ``);
    ``hostname``: ``None`` for :func:`socket.gethostname`."""
    env = os.environ if env is None else env
    host = socket.gethostname() if hostname is None else hostname
    node = env.get("GROUP_RANK")
    return host if node is None else f"{host} GROUP_RANK={node}"


def _numbers(values: Sequence[int]) -> str:
    """``0-3`` for consecutive values, ``0, 2, ..., 14`` for a longer even stride, else ``0, 2, 5``."""
    values = list(values)
    step = values[1] - values[0] if len(values) > 1 else 1
    stride = step > 0 and values == list(range(values[0], values[-1] + 1, step))
    if len(values) > 2 and stride and step == 1:
        return f"{values[0]}-{values[-1]}"
    if len(values) > 4 and stride:
        return f"{values[0]}, {values[1]}, ..., {values[-1]}"
    return ", ".join(map(str, values))


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0-3]``, ``[0, 2, ..., 14]`` or ``[0, 2]``."""
    return f"[{_numbers(ranks)}]"


def _nodes_text(nodes: Sequence[int]) -> str:
    """``node 0``, ``nodes 0-1`` or ``nodes 0, 2``."""
    nodes = sorted(set(nodes))
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {_numbers(nodes)}"


_SHOWN = 8  # groups named per kind in the placement line and the warning; the rest are counted


def _listed(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


@dataclass(frozen=True)
class Placement:
    """Where the SP and DP groups of a world sit on its nodes (pure: built from every rank's node).

    Attributes:
        nodes: the node index of each world rank; nodes are numbered in the order of their first rank (under
            torchrun and ``accelerate launch``, node ``n`` is the launcher's ``--node-rank n``).
        sp_size: ranks per SP group (the groups are :func:`group_ranks`' blocks of consecutive ranks).
    """

    nodes: tuple[int, ...]
    sp_size: int

    @classmethod
    def from_identities(cls, identities: Sequence[object], sp_size: int) -> Placement:
        """The placement of a world whose rank ``r`` runs on the node named ``identities[r]`` (any comparable
        value: :func:`node_identity`'s string, or its digest)."""
        index: dict[object, int] = {}
        return cls(tuple(index.setdefault(i, len(index)) for i in identities), sp_size)

    @property
    def sp_groups(self) -> list[list[int]]:
        return group_ranks(len(self.nodes), self.sp_size)[0]

    @property
    def dp_groups(self) -> list[list[int]]:
        return group_ranks(len(self.nodes), self.sp_size)[1]

    @property
    def node_sizes(self) -> list[int]:
        """Processes per node, node by node."""
        return [self.nodes.count(n) for n in range(max(self.nodes) + 1)]

    def nodes_of(self, ranks: Sequence[int]) -> list[int]:
        """The nodes ``ranks`` run on (sorted, each once)."""
        return sorted({self.nodes[r] for r in ranks})

    @property
    def spanning(self) -> list[list[int]]:
        """The SP groups whose ranks run on more than one node."""
        return [g for g in self.sp_groups if len(self.nodes_of(g)) > 1]

    def ranks_on(self, node: int) -> list[int]:
        """The world ranks that run on ``node``."""
        return [r for r, n in enumerate(self.nodes) if n == node]

    def _scattered(self) -> list[int]:
        """The nodes whose ranks are not consecutive."""
        return [n for n in range(len(self.node_sizes)) if (r := self.ranks_on(n)) != list(range(r[0], r[-1] + 1))]

    @property
    def node_major(self) -> bool:
        """Whether each node's ranks are consecutive (launchers number ranks node by node)."""
        return not self._scattered()

    def describe(self) -> str:
        """The placement in one line: the nodes, each SP group and each DP group with the nodes it spans."""
        sizes = self.node_sizes
        per = f"{sizes[0]} per node" if len(set(sizes)) == 1 else "per node: " + ", ".join(map(str, sizes))
        world, sp = len(self.nodes), self.sp_size
        spanning = self.spanning
        where = "each inside one node" if not spanning else "across nodes"
        if 0 < len(spanning) < world // sp:
            where = f"{len(spanning)} of {world // sp} across nodes"
        sp_text = _listed([f"{_ranks_text(g)} {_nodes_text(self.nodes_of(g))}" for g in self.sp_groups])
        dp_text = _listed([f"{_ranks_text(g)} {_nodes_text(self.nodes_of(g))}" for g in self.dp_groups])
        return (
            f"hf_fpdt placement: {world} ranks on {len(sizes)} node{'s' * (len(sizes) > 1)} ({per}); "
            f"SP groups of {sp} ({where}): {sp_text}; DP groups of {world // sp}: {dp_text}"
        )

    def warning(self) -> str | None:
        """What to tell the user when an SP group spans nodes (``None`` when none does): which groups, why, and
        the ``sp_size`` values that keep every SP group inside a node."""
        spanning = self.spanning
        if not spanning:
            return None
        sizes, sp, world = self.node_sizes, self.sp_size, len(self.nodes)
        smallest = min(sizes)
        if sp > smallest:
            where = "per node" if len(set(sizes)) == 1 else "on the smallest node"
            why = f"sp_size {sp} is more than the {smallest} processes {where}"
        elif not self.node_major:
            node = self._scattered()[0]
            held = _ranks_text(self.ranks_on(node))
            why = (
                f"the ranks are not numbered node by node (node {node} holds ranks {held}; torchrun and accelerate "
                "launch number them node by node)"
            )
        elif len(set(sizes)) > 1:  # node-major and sp_size dividing every node's count would not span
            why = f"sp_size {sp} does not divide the processes of every node ({', '.join(map(str, sizes))})"
        else:
            why = f"sp_size {sp} does not divide the {smallest} processes per node"
        common = math.gcd(*sizes)
        fits = [d for d in range(1, common + 1) if common % d == 0 and world % d == 0]
        groups = _listed([f"{_ranks_text(g)} on {_nodes_text(self.nodes_of(g))}" for g in spanning])
        one, count = len(spanning) == 1, world // sp
        which = f"{len(spanning)} of {count} sequence-parallel groups"
        if count == 1:
            which = "the sequence-parallel group"
        elif len(spanning) == count:
            which = f"all {count} sequence-parallel groups"
        return (
            f"hf_fpdt: {which} span{'s' * one} nodes ({groups}): "
            f"{why}. The results are the same, but each all-to-all of {'that group' if one else 'those groups'} "
            "(several per layer and chunk) crosses the network between nodes, which is slower than the links inside "
            "a node. To keep every SP group inside a node (and DP across nodes), use an sp_size that divides the "
            f"processes of every node ({', '.join(map(str, fits))}), with ranks numbered node by node"
        )


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups and coordinates.

    Attributes:
        sp: the SP group (ranks sharing one batch; pass it to ``hf_fpdt.apply``).
        dp: the DP group (ranks holding different batches; gradient averaging).
        sp_size, dp_size: group sizes (``sp_size * dp_size`` = world size).
        sp_rank: rank within ``sp`` (use for ``hf_fpdt.data.layout.shard_batch(rank=...)``).
        dp_rank: rank within ``dp`` (which batch of the global batch this rank's SP group takes).
        placement: which node every rank runs on and which nodes each group spans (:class:`Placement`).
    """

    sp: dist.ProcessGroup
    dp: dist.ProcessGroup
    sp_size: int
    dp_size: int
    sp_rank: int
    dp_rank: int
    placement: Placement | None = None


def build_groups(
    sp_size: int,
    backend: str | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    env: Mapping[str, str] | None = None,
) -> ParallelGroups:
    """Create the SP and DP groups of an initialised world (a collective: every rank must call it).

    Then the ranks exchange their nodes (:func:`node_identity`) over the new groups, and rank 0 logs the
    :class:`Placement` at INFO on the ``hf_fpdt`` logger and, when an SP group spans nodes, a warning
    naming it and the ``sp_size`` values that keep SP inside a node.

    Args:
        sp_size: ranks per SP group; must divide the world size.
        backend: backend of the new groups; ``None`` = the world's backend.
        timeout: how long a collective of the new groups waits for a missing rank (seconds or a
            ``timedelta``; positive and finite) before it fails: :data:`DEFAULT_TIMEOUT` (600 s) unless given.
            It bounds how long the ranks of an SP group wait for a peer that failed
            (:mod:`hf_fpdt.distributed.agreement`), and how long the group creation waits for every rank to arrive.
        env: the launcher's environment, read for ``GROUP_RANK`` (:func:`node_identity`); ``None``: ``os.environ``.

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
    placement = gather_placement(mine["sp"], mine["dp"], sp_size, node_identity(env))
    # the launcher's variables, cross-checked: one inconsistent rank would otherwise make up nodes (or hide them)
    rows = gather_launch_env(mine["sp"], mine["dp"], env)
    problem, hosts_only = launch_env_problem(rows)
    if hosts_only:  # GROUP_RANK set on some ranks of a host only: placed by host name alone
        placement = Placement.from_identities([row[0] for row in rows], sp_size)
    if rank == 0:  # every rank holds the same placement: one line, not one per rank
        _log.info(placement.describe())
        if problem is not None:
            _log.warning(problem)
        elif (warning := placement.warning()) is not None:
            _log.warning(warning)
    return ParallelGroups(
        sp=mine["sp"],
        dp=mine["dp"],
        sp_size=sp_size,
        dp_size=world // sp_size,
        sp_rank=rank % sp_size,
        dp_rank=rank // sp_size,
        placement=placement,
    )


def gather_placement(sp: dist.ProcessGroup, dp: dist.ProcessGroup, sp_size: int, identity: str) -> Placement:
    """Every rank's node, exchanged over this rank's SP group ``sp`` and DP group ``dp`` (a collective of the
    world: every rank calls it with its own groups and ``identity``, :func:`node_identity`).

    Two guarded all-gathers of int64 digests: over the SP group (each rank learns its SP group's nodes), then of
    those rows over the DP group, which holds one rank of every SP group, so every rank ends with the whole
    world's nodes. Both run under the groups' own timeout (:func:`build_groups`' ``timeout``): a rank that
    died or stalled is an :class:`~hf_fpdt.distributed.peers.SPPeerFailure` on its peers, not a hang.
    """
    what = "build_groups (exchanging each rank's node)"
    mine = torch.tensor([digest(identity)], dtype=torch.int64, device=group_device(sp))
    block = gather_rows(sp, mine, what, equal_rows=True).tolist()  # this SP group's nodes, in SP rank order
    rows = torch.tensor([block], dtype=torch.int64, device=group_device(dp))
    table = gather_rows(dp, rows, what, equal_rows=True).tolist()
    return Placement.from_identities([node for row in table for node in row], sp_size)  # row d: SP group d


LAUNCH_VARIABLES = ("GROUP_RANK", "LOCAL_WORLD_SIZE")  # set per process by torchrun / accelerate launch


def _env_int(env: Mapping[str, str], name: str) -> int:
    """The launcher variable ``name`` as a number; -1 where unset, -2 where not a number."""
    value = env.get(name)
    if value is None:
        return -1
    try:
        return int(value)
    except ValueError:
        return -2


def gather_launch_env(
    sp: dist.ProcessGroup, dp: dist.ProcessGroup, env: Mapping[str, str] | None = None, hostname: str | None = None
) -> list[list[int]]:
    """Every world rank's ``[digest of its host name, GROUP_RANK, LOCAL_WORLD_SIZE]`` (-1: unset), in world rank
    order: two guarded all-gathers of 3 int64 per rank, over the SP group and then the DP group, as
    :func:`gather_placement` (a collective of the world)."""
    env = os.environ if env is None else env
    host = socket.gethostname() if hostname is None else hostname
    what = "build_groups (exchanging each rank's launcher variables)"
    mine = [digest(host), *(_env_int(env, n) for n in LAUNCH_VARIABLES)]
    width = len(mine)
    block = gather_rows(sp, torch.tensor([mine], dtype=torch.int64, device=group_device(sp)), what, equal_rows=True)
    flat = block.reshape(1, -1)  # this SP group's ranks, in SP rank order
    table = gather_rows(dp, flat, what, equal_rows=True).tolist()  # row d: SP group d
    return [row[i : i + width] for row in table for i in range(0, len(row), width)]  # rank d * sp + s


def launch_env_problem(rows: Sequence[Sequence[int]]) -> tuple[str | None, bool]:
    """What is inconsistent in the ranks' launcher variables (``rows``: :func:`gather_launch_env`), as a warning
    naming the variable and the ranks (``None``: nothing), and whether the placement must then go by host name
    alone (``GROUP_RANK`` set on some ranks of a host and not on others: it cannot tell that host's nodes apart).

    Checked: ``GROUP_RANK`` (torchrun's node rank) set on every rank of a host or on none, and a number;
    ``LOCAL_WORLD_SIZE`` (processes per node) equal to the number of ranks that run on that rank's node."""
    by_host: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        by_host.setdefault(row[0], []).append(rank)
    for host_ranks in by_host.values():
        unset = [r for r in host_ranks if rows[r][1] == -1]
        bad = [r for r in host_ranks if rows[r][1] == -2]
        if bad:
            return (
                f"hf_fpdt: GROUP_RANK is not a number on world ranks {_ranks_text(bad)}: it is the launcher's node "
                "rank (torchrun and accelerate launch set it); the ranks are placed by host name alone",
                True,
            )
        if unset and len(unset) < len(host_ranks):
            given = sorted(r for r in host_ranks if r not in unset)
            return (
                f"hf_fpdt: GROUP_RANK (the launcher's node rank) is set on world ranks {_ranks_text(given)} "
                f"({', '.join(f'{rows[r][1]}' for r in given)}) but not on world ranks {_ranks_text(unset)}, which run "
                "on the same host: the ranks are placed by host name alone. Start every process of a node with one "
                "launcher (torchrun and accelerate launch set GROUP_RANK and LOCAL_WORLD_SIZE on every process), or "
                "set it on every rank",
                True,
            )
    nodes: dict[tuple[int, int], list[int]] = {}
    for rank, row in enumerate(rows):
        nodes.setdefault((row[0], row[1]), []).append(rank)
    for node_ranks in nodes.values():
        wrong = [r for r in node_ranks if rows[r][2] not in (-1, len(node_ranks))]
        if wrong:
            sizes = ", ".join(sorted({str(rows[r][2]) for r in wrong}))
            return (
                f"hf_fpdt: LOCAL_WORLD_SIZE (processes per node) is {sizes} on world ranks {_ranks_text(wrong)}, but "
                f"{len(node_ranks)} ranks run on their node (world ranks {_ranks_text(node_ranks)}, the same host and "
                "GROUP_RANK): start every process of a node with one launcher, or set LOCAL_WORLD_SIZE to the "
                "number of processes on that node",
                False,
            )
    return None, False


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
