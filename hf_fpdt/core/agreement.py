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
"""

from __future__ import annotations

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
