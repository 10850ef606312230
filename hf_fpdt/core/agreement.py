"""The ranks of a sequence-parallel (SP) group agree before they compute, and a rank that fails says so.

Every SP rank runs the same collectives in the same order; ranks that disagree on the shape of a step
(another sequence length, batch size or chunk size) would otherwise meet in an all-to-all with buffers
of different sizes, which gloo answers by aborting a process and NCCL by hanging. Two mechanisms:

**Agreement, once per forward.** :meth:`StepAgreement.check` all-gathers one small int64 vector per rank
(step number, batch size, local sequence length, chunk size, the settings that decide the collectives)
over the SP group: one collective of ``P x len(FIELDS)`` integers per step, never per chunk. A mismatch
raises :class:`SPAgreementError` (a ``ValueError``) with the same message on every rank, naming each
rank's value.

**Failure notes.** An exception raised on one rank inside the model's forward leaves its peers waiting
in the next all-to-all. Gloo cannot interrupt that wait from another process (aborting or destroying a
gloo group does not close its connections), so the wait is bounded by the group's timeout
(:func:`hf_fpdt.core.groups.build_groups` takes one; ``FPDTPlugin`` sets ``sp_timeout``). Before its exception
leaves the model, the failing rank writes a note into the group's store (:meth:`StepAgreement.note_failure`);
a peer whose collective then fails or times out raises :class:`SPPeerFailure` naming the failing rank,
its step and its error (:func:`peer_failure`, used by :mod:`hf_fpdt.core.all_to_all`'s collectives).

**Collectives outside the SP group** (the world's token count and logged loss, DDP's buffer sync and
gradient reduction, Trainer's gathers) are watched by a :class:`CollectiveWatch`: each rank marks in the
world's store which collective it enters (one small store write per watched call, a few per step), and a
collective that fails or times out becomes an :class:`SPPeerFailure` naming the peers that did not reach it
(late, or gone), the collective and the timeout. ``FPDTPlugin`` sets the world group's timeout to its
``sp_timeout`` (:func:`hf_fpdt.core.groups.set_group_timeout`), so these waits end as soon as the SP group's do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import FPDTConfig

FIELDS = (
    "step",
    "batch size",
    "local sequence length",
    "chunk size",
    "position_ids given",
    "training",
    "grad enabled",
    "offload",
    "offload_layer_inputs",
    "mlp_chunks",
    "loss_chunks",
    "checkpoint_segments",
    "gradient checkpointing",
)
NOTE_KEY = "hf_fpdt/sp_failure"
MARK_KEY = "hf_fpdt/at/"  # + world rank: "<number of watched calls>|<the collective>" (CollectiveWatch)


SP_ADVICE = (
    "Every SP rank must run the same FPDT settings on its shard of the same batch: build the same FPDTConfig on "
    "every rank and shard batches with hf_fpdt.FPDTPlugin (or hf_fpdt.data.layout.shard_batch) using that config's "
    "chunk_size"
)


def settings_values(config: FPDTConfig, model: nn.Module) -> dict[str, int]:
    """The settings part of :data:`FIELDS` for one forward of ``model`` (what decides the collectives and
    the step's plan besides the shape). The memory budgets are not compared: ranks may be given different
    ones, and the plan agrees on the smallest (:func:`hf_fpdt.integrations.step_plan.plan_step`)."""
    segments = config.checkpoint_segments
    return {
        "training": model.training,
        "grad enabled": torch.is_grad_enabled(),
        "offload": {True: 1, False: 0}.get(config.offload, 2),
        "offload_layer_inputs": bool(config.offload_layer_inputs),
        "mlp_chunks": config.mlp_chunks or 0,
        "loss_chunks": config.loss_chunks or 0,
        "checkpoint_segments": segments if isinstance(segments, int) else 0,  # 0: "auto"
        # what HF's is_activation_checkpointing reads (its deprecated alias is_gradient_checkpointing warns)
        "gradient checkpointing": any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules()),
    }


class SPAgreementError(ValueError):
    """The SP ranks disagree on the shape or settings of a step (raised alike on every rank)."""


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


def peer_failure(group: dist.ProcessGroup | None, error: BaseException) -> SPPeerFailure:
    """The error to raise when a collective over ``group`` failed with ``error`` (a gloo/NCCL error or timeout).

    Names the failing peer, its step and its error when that peer left a note; otherwise says that no
    rank reported one.
    """
    store, note = _store(group), None
    if store is not None:
        try:
            if store.check([NOTE_KEY]):
                note = store.get(NOTE_KEY).decode()
        except RuntimeError:
            note = None
    me = f"SP rank {_rank(group)} of {dist.get_world_size(group)} (world rank {dist.get_rank()})"
    if note is not None:
        cause = f"{note}; this rank's collective of that step could not complete"
    else:
        cause = (
            "no SP rank reported an error: a rank died, raised outside the model's forward (e.g. in backward or "
            "the loss), or stalled beyond the group's timeout; see the other ranks' logs"
        )
    return SPPeerFailure(f"{me}: a collective of the sequence-parallel group failed: {cause} ({error})")


@dataclass
class StepAgreement:
    """The per-step agreement of one model's SP ranks (``hf_fpdt.apply`` installs one per model).

    Args:
        group: the SP process group (at least two ranks), or another group whose ranks must make the same
            calls (DeepSpeed ZeRO-3's partition group, :mod:`hf_fpdt.integrations.deepspeed`).
        scope: how the error names the group.
        advice: what the error tells the user to do.
    """

    group: dist.ProcessGroup
    step: int = 0
    scope: str = "sequence-parallel group"
    advice: str = SP_ADVICE
    _failed: bool = field(default=False, repr=False)  # a failure was seen since the last agreed step

    def check(self, device: torch.device, **values: int) -> None:
        """All-gather ``values`` (keys: :data:`FIELDS` except ``step``) over the group and compare them.

        One collective per call (call it once per forward). Raises :class:`SPAgreementError` on every
        rank when any value differs; :class:`SPPeerFailure` when a peer never arrives.
        """
        self.step += 1
        names = FIELDS[1:]
        if sorted(values) != sorted(names):
            raise ValueError(f"StepAgreement.check takes {names}, got {sorted(values)}")
        mine = torch.tensor([self.step] + [int(values[n]) for n in names], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        try:
            dist.all_gather(rows, mine, group=self.group)
        except RuntimeError as exc:
            raise peer_failure(self.group, exc) from exc
        table = torch.stack(rows).tolist()  # one host sync per step
        if self._failed:  # every rank got here, so the note of the failed step is stale now
            self._failed = False
            store = _store(self.group)
            if store is not None and _rank(self.group) == 0:
                store.delete_key(NOTE_KEY)
        differ = [i for i, name in enumerate(FIELDS) if len({row[i] for row in table}) > 1]
        if differ:
            parts = [
                f"{FIELDS[i]}: " + ", ".join(f"rank {r} has {row[i]}" for r, row in enumerate(table)) for i in differ
            ]
            raise SPAgreementError(
                f"the {len(table)} ranks of the {self.scope} disagree at step {table[0][0]} on "
                + "; ".join(parts)
                + ". "
                + self.advice
            )

    def note_failure(self, error: BaseException) -> None:
        """Called on a rank whose forward raised ``error``: leave a note for the peers it leaves waiting."""
        self._failed = True
        if isinstance(error, (SPAgreementError, SPPeerFailure)):
            return  # raised alike on every rank, or a consequence of another rank's failure
        store = _store(self.group)
        if store is None:
            return
        rank = _rank(self.group)
        note = f"SP rank {rank} (world rank {dist.get_rank()}) raised {type(error).__name__} in step {self.step}: "
        note += str(error)[:500]
        try:
            store.set(NOTE_KEY, note)
        except RuntimeError:
            pass  # the store is gone too: the peers' timeout still ends their wait


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
                late.append(f"world rank {peer} (has not reached any watched collective)")
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
