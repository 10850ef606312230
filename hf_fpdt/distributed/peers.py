"""A rank that fails says so, and a peer left waiting names it: failure notes in the group's store, guarded
collectives, and the world's :class:`CollectiveWatch` (the agreement the ranks reach before they compute is
:mod:`hf_fpdt.distributed.agreement`).

**Failure notes.** An exception raised on one rank inside the model's forward leaves its peers waiting
in the next all-to-all. Gloo cannot interrupt that wait from another process (aborting or destroying a
gloo group does not close its connections), so the wait is bounded by the group's timeout
(:func:`hf_fpdt.distributed.groups.build_groups` takes one; ``FPDTPlugin`` sets ``sp_timeout``). Before its exception
leaves the model, the failing rank writes a note into the group's store (:func:`leave_note`, called by
:meth:`hf_fpdt.distributed.agreement.StepAgreement.note_failure`);
a peer whose collective then fails or times out raises :class:`SPPeerFailure` naming the failing rank,
its step and its error (:func:`peer_failure`, used by :mod:`hf_fpdt.distributed.all_to_all`'s collectives).

**Guards.** Every collective hf_fpdt issues runs under :func:`guarded` (or, over the world, a
:class:`CollectiveWatch`): an error or timeout of the collective becomes :class:`SPPeerFailure` naming this
rank, the peer (the one that left a note, else the group's other ranks), the collective and the group's
timeout.

**Waiting on the host.** Gloo's ``work.wait()`` blocks the host and raises when the group's timeout passes. NCCL's
(and other device backends') only makes the current stream wait for the collective: without
``TORCH_NCCL_BLOCKING_WAIT`` a dead or stalled peer never makes it raise, and the process ends in NCCL's watchdog
abort at the timeout instead of in :class:`SPPeerFailure`. :func:`wait_collective` waits for a collective issued with
``async_op=True`` on any backend: on gloo as before, elsewhere by polling the work up to a deadline inside the group's
timeout (:data:`HOST_WAIT_SHARE`), so every rank ends with :class:`SPPeerFailure` within ``sp_timeout``. The
attention's all-to-alls (:mod:`hf_fpdt.distributed.all_to_all`) wait there.

**Collectives outside the SP group** (the world's token count and logged loss, DDP's buffer sync and
gradient reduction, Trainer's gathers) are watched by a :class:`CollectiveWatch`: each rank marks in the
world's store which collective it enters (one small store write per watched call, a few per step), and a
collective that fails or times out becomes an :class:`SPPeerFailure` naming the peers that did not reach it
(late, or gone), the collective and the timeout. ``FPDTPlugin`` sets the world group's timeout to its
``sp_timeout`` (:func:`~hf_fpdt.distributed.timeouts.set_group_timeout`), so these waits end as soon as the SP
group's do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .timeouts import DEFAULT_TIMEOUT, group_timeout

NOTE_KEY = "hf_fpdt/sp_failure"
MARK_KEY = "hf_fpdt/at/"  # + world rank: "<number of watched calls>|<the collective>" (CollectiveWatch)
# Share of the group's timeout after which a polling host wait gives up (wait_collective): before NCCL's watchdog,
# which times the same collective out at the full timeout, counted from its issue, and then tears the process down
# (TORCH_NCCL_ASYNC_ERROR_HANDLING), so the error every rank sees is SPPeerFailure naming the peer.
HOST_WAIT_SHARE = 0.9
POLL_FIRST_S, POLL_MOST_S = 2e-5, 2e-3  # the polling host's first sleep, doubled up to this


class SPPeerFailure(RuntimeError):
    """A collective of the SP group failed because another rank raised, died or stalled."""


def _rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def _store(group: dist.ProcessGroup | None):
    if group is None:
        return None
    try:
        return group.get_group_store()
    except (AttributeError, RuntimeError):  # a backend without a store: no notes, the timeout still ends the wait
        return None


def group_device(group: dist.ProcessGroup) -> torch.device:
    """A device ``group``'s collectives take tensors on: the CPU for gloo, else the current accelerator."""
    backend = str(dist.get_backend(group)).lower()
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def leave_note(group: dist.ProcessGroup, note: str) -> None:
    """Write ``note`` (a failed rank's error) into ``group``'s store for the peers it leaves waiting."""
    store = _store(group)
    if store is None:
        return
    try:
        store.set(NOTE_KEY, note)
    except RuntimeError:
        pass  # the store is gone too: the peers' timeout still ends their wait


def clear_note(group: dist.ProcessGroup) -> None:
    """Delete ``group``'s failure note (on its rank 0): every rank got past the failed step, so it is stale."""
    store = _store(group)
    if store is not None and _rank(group) == 0:
        store.delete_key(NOTE_KEY)


def peer_failure(
    group: dist.ProcessGroup | None, error: BaseException, what: str | None = None, waited: float | None = None
) -> SPPeerFailure:
    """The error to raise when a collective over ``group`` failed with ``error`` (a gloo/NCCL error or timeout).

    Names this rank, the collective (``what``, after ``waited`` seconds) and the group's timeout, and the
    failing peer, its step and its error when that peer left a note; otherwise the group's other ranks
    (one of which died, raised outside the model's forward, or stalled).
    """
    store, note = _store(group), None
    if store is not None:
        try:
            if store.check([NOTE_KEY]):
                note = store.get(NOTE_KEY).decode()
        except RuntimeError:
            note = None
    me = f"SP rank {_rank(group)} of {dist.get_world_size(group)} (world rank {dist.get_rank()})"
    timeout = group_timeout(group)
    timeout = None if timeout is None else timeout.total_seconds()
    detail = [what or ""]
    if waited is not None:
        detail.append(f"after {waited:.1f} s")
    if timeout is not None:
        detail.append(f"timeout {timeout:g} s")
    detail = [d for d in detail if d]
    where = f" ({'; '.join(detail)})" if detail else ""
    if note is not None:
        cause = f"{note}; this rank's collective of that step could not complete"
    else:
        others = [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
        who = f"world rank {others[0]}" if len(others) == 1 else f"one of world ranks {', '.join(map(str, others))}"
        if any(s in str(error).lower() for s in ("connection closed", "connection reset", "broken pipe")):
            happened = f"{who} closed its connection (it died, or exited with an error)"
        else:
            happened = (
                f"{who} did not arrive: it died, raised outside the model's forward (e.g. in backward or the loss), "
                "or stalled beyond the group's timeout"
            )
        cause = f"no SP rank reported an error: {happened}; see the other ranks' logs"
    return SPPeerFailure(f"{me}: a collective of the sequence-parallel group failed{where}: {cause} ({error})")


@contextmanager
def guarded(group: dist.ProcessGroup | None, what: str) -> Iterator[None]:
    """Run collectives over ``group``: an error or timeout they raise (a peer died, raised or stalled) becomes
    :class:`SPPeerFailure` naming ``what`` (see :func:`peer_failure`); other errors pass unchanged."""
    start = time.monotonic()
    try:
        yield
    except RuntimeError as exc:
        if group is None or not is_collective_error(exc):
            raise
        raise peer_failure(group, exc, what, time.monotonic() - start) from exc


def host_polls(backend: str) -> bool:
    """Whether a host waiting for a collective of a group on ``backend`` (``dist.get_backend(group)``) must poll its
    work to bound the wait: on every backend but gloo. Gloo's ``work.wait()`` blocks and raises at the group's
    timeout; NCCL's returns at once (it orders the current stream after the collective) and never raises for a
    missing peer unless ``TORCH_NCCL_BLOCKING_WAIT`` is set; a mixed ``"cpu:gloo,cuda:nccl"`` group may run either."""
    return str(backend).strip().lower() != "gloo"


def wait_collective(
    work, group: dist.ProcessGroup, what: str, *, started: float | None = None, poll: bool | None = None
) -> None:
    """Wait for ``work`` (a collective over ``group`` issued with ``async_op=True``); a peer that raised, died or
    stalled becomes :class:`SPPeerFailure` naming ``what`` (:func:`peer_failure`) within the group's timeout.

    ``started``: when the collective was issued (``time.monotonic()``; default now): the deadline counts from there,
    as the backend's own timeout does. ``poll``: whether the host polls ``work.is_completed()`` (default
    :func:`host_polls` of the group's backend). When it polls, it gives up at :data:`HOST_WAIT_SHARE` of the group's
    timeout (``sp_timeout``; :data:`~hf_fpdt.distributed.timeouts.DEFAULT_TIMEOUT` where torch does not say), then
    calls ``work.wait()`` once (it orders the current stream after the collective and raises a failed one's error).

    Polling is a host synchronisation with the collective (and, through the stream it waits on, with the work
    queued before its issue); callers wait once per collective, never per block of a chunk loop.
    """
    start = time.monotonic() if started is None else started
    if poll is None:
        poll = host_polls(dist.get_backend(group))
    try:
        if poll:
            timeout = group_timeout(group)
            limit = HOST_WAIT_SHARE * (DEFAULT_TIMEOUT if timeout is None else timeout.total_seconds())
            deadline, delay = start + limit, POLL_FIRST_S
            while not work.is_completed():
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(
                        f"not completed after {now - start:.1f} s; this rank stopped waiting at {HOST_WAIT_SHARE:.0%} "
                        "of the group's timeout, before the backend's watchdog would end the process"
                    )
                time.sleep(min(delay, deadline - now))
                delay = min(2 * delay, POLL_MOST_S)
        work.wait()
    except (RuntimeError, TimeoutError) as exc:
        raise peer_failure(group, exc, what, time.monotonic() - start) from exc


def gather_rows(group: dist.ProcessGroup, tensor: torch.Tensor, what: str, equal_rows: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` of ``group`` concatenated along dim 0, in group rank order, guarded (``what``
    names the collective in a failure). Bool tensors come back as bool (gloo gathers none); a 0-d tensor is one
    row; the dims after the first must match.

    ``equal_rows``: every rank holds the same number of rows (the agreement's fixed-size digest rows): one
    all-gather. Otherwise the row counts may differ (results of an uneven last batch): an all-gather of the
    counts first, then of the rows padded to the longest.
    """
    if tensor.dtype == torch.bool:
        return gather_rows(group, tensor.to(torch.uint8), what, equal_rows).bool()
    flat = tensor if tensor.dim() else tensor.reshape(1)
    world = dist.get_world_size(group)
    if equal_rows:
        rows = [flat.shape[0]] * world
    else:
        size = torch.tensor([flat.shape[0]], dtype=torch.int64, device=flat.device)
        sizes = [torch.empty_like(size) for _ in range(world)]
        with guarded(group, f"{what}: the row counts"):
            dist.all_gather(sizes, size, group=group)
        rows = [int(s.item()) for s in sizes]
    padded = flat
    if max(rows) != flat.shape[0]:
        padded = flat.new_zeros((max(rows), *flat.shape[1:]))
        padded[: flat.shape[0]] = flat
    pieces = [torch.empty_like(padded) for _ in rows]
    with guarded(group, what):
        dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, rows)])


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer died, left or stalled past the timeout."""
    if isinstance(error, SPPeerFailure):
        return False  # already explained
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "timed out", "connection closed", "connection reset", "broken pipe")
    )


def _torch_collective(error: BaseException) -> str | None:
    """The torch.distributed / DDP function a collective error came from, read off its traceback."""
    names = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        if ("torch/distributed/" in path or "torch/nn/parallel/" in path or "accelerate/" in path) and (
            "c10d_logger" not in path
        ):
            names.append(getattr(code, "co_qualname", code.co_name))
        tb = tb.tb_next
    if not names:
        return None
    return names[0] if len(names) == 1 else f"{names[0]} -> {names[-1]}"


class CollectiveWatch:
    """Names the peer and the collective when a collective over ``group`` (the world) fails or times out.

    Every rank calls the watched points in the same order (:meth:`guard` around a collective, or
    :meth:`mark` before code that runs collectives); each call writes ``"<count>|<what>"`` under
    :data:`MARK_KEY` in the group's store. A failed collective then reads every rank's mark: a peer
    whose count is behind this rank's has not reached it (late or dead), one that reached it and closed
    its connection has died or left with an error.

    Args:
        group: the group whose collectives are watched (the world).
        timeout: that group's timeout in seconds (named in the error).
    """

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.calls = 0
        self.where = "(no watched collective yet)"
        self.since = time.monotonic()

    def mark(self, where: str) -> None:
        """This rank enters ``where`` (a collective, or a stretch of code that runs collectives)."""
        self.calls += 1
        self.where, self.since = where, time.monotonic()
        store = _store(self.group)
        if store is None:
            return
        try:
            store.set(f"{MARK_KEY}{dist.get_rank()}", f"{self.calls}|{where}")
        except RuntimeError:
            pass  # the store is gone: the collective itself will fail and be explained

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Mark ``where`` and turn a collective error raised inside into :class:`SPPeerFailure`."""
        self.mark(where)
        try:
            yield
        except RuntimeError as exc:
            if not is_collective_error(exc):
                raise
            raise self.failure(exc) from exc

    def failure(self, error: BaseException, where: str | None = None) -> SPPeerFailure:
        """The :class:`SPPeerFailure` for ``error`` raised by a collective in ``where`` (default: the last mark)."""
        where = where or self.where
        inner = _torch_collective(error)
        what = where if inner is None or inner in where else f"{where} [{inner}]"
        rank, world = dist.get_rank(), dist.get_world_size()
        waited = time.monotonic() - self.since
        closed = any(s in str(error).lower() for s in ("connection closed", "connection reset", "broken pipe"))
        peers = self._peers(rank, world, closed)
        return SPPeerFailure(
            f"world rank {rank} of {world}: the collective {what} failed after {waited:.1f} s "
            f"(timeout {self.timeout:g} s, FPDTPlugin(sp_timeout=...)): {peers} ({error})"
        )

    def _peers(self, rank: int, world: int, closed: bool) -> str:
        store = _store(self.group)
        if store is None:
            return "a peer rank died or stalled; see the other ranks' logs"
        late, gone, unknown = [], [], []
        for peer in range(world):
            if peer == rank:
                continue
            key = f"{MARK_KEY}{peer}"
            try:
                mark = store.get(key).decode() if store.check([key]) else None
            except RuntimeError:
                unknown.append(f"world rank {peer}")
                continue
            if mark is None:
                state = "closed its connection (died) before" if closed else "has not reached"
                late.append(f"world rank {peer} ({state} any watched collective)")
                continue
            count, _, at = mark.partition("|")
            if int(count) < self.calls:
                state = "closed its connection (died) at" if closed else "still at"
                late.append(f"world rank {peer} ({state} {at}, watched call {count}; this rank: {self.calls})")
            elif closed:
                gone.append(f"world rank {peer} (reached {at}, watched call {count})")
        parts = []
        if late:
            parts.append("did not arrive: " + ", ".join(late))
        if gone:
            parts.append("closed its connection (died or exited with an error): " + ", ".join(gone))
        if unknown:
            parts.append("the store is unreachable (its host may have died): " + ", ".join(unknown))
        if not parts:
            parts.append("a peer rank died or stalled inside this collective; see the other ranks' logs")
        return "; ".join(parts)
