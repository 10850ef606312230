"""Activation checkpointing with FPDT, in one place: what survives a layer's forward until its backward.

Under checkpointing (HF 5.x checkpoints each decoder layer non-reentrantly, ``torch.utils.checkpoint``)
a layer keeps two kinds of things from its first forward until its backward:

* **the layer input** ``[B, S, E]``, saved by the checkpoint to recompute the layer.
  :class:`LayerInputOffloader` puts it in a pooled store (``saved_tensors_hooks`` installed around the
  checkpointing layer's call) and brings it back one layer ahead in backward.
* **the replay chunks**: the q/k/v/o/lse chunks the attention stored in the first forward. Backward of
  the first forward's autograd node runs on them, and the recomputation rebuilds the attention output
  from the stored ``o_i`` instead of computing attention again (:class:`CheckpointState`, the
  record/replay log shared by the two scopes the checkpoint's ``context_fn`` returns).

The replay chunks are several times the layer input, so they are kept only while the host budget
(``FPDTConfig.host_memory``) holds them: :meth:`CheckpointState.may_keep` decides per layer, first come
first served, against a replay budget set once per step from the sequence length
(:mod:`hf_fpdt.memory.planner`). A layer over the budget stores nothing in its first forward; its
recomputation computes attention again, stores the chunks, and hands them through its log entry
(:class:`ReplayEntry`) to the first forward's autograd node, whose backward then uses them. With
``host_memory=0`` only the layer inputs survive across layers.

Both kinds are placed in two tiers by one device budget for the step (``FPDTConfig.device_memory``, the
runtime's :class:`hf_fpdt.memory.host_store.DeviceBudget`, shared by the layer-input store and the attention's
chunk store, its size planned once per step by :mod:`hf_fpdt.memory.planner`): they stay on the device while
it holds them and the oldest go to the host when later ones need the room, so the forward ends with
the *last* layers' inputs and chunks on the device. Those are the first backward needs (its first
fetch has nothing to hide behind) and the first whose device memory backward gives back, as the
gradients grow. The host tier is bounded by ``host_memory``; what neither holds is recomputed
(attention again, then checkpoint segments of k layers: :mod:`hf_fpdt.integrations.layer_wrappers`).
On CPU the device is the host and nothing is copied.

The HF side (wrapping a ``GradientCheckpointingLayer``'s call with the offload hooks and the
``context_fn``) is in :mod:`hf_fpdt.integrations.layer_wrappers`. Recomputation of the chunked
projection's and the tiles' pieces (their RNG/autocast replay) is :mod:`hf_fpdt.memory.replay`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .host_store import DeviceBudget, Fetched, HostStore, Slot
from .replay import RngState


@dataclass
class ReplayEntry:
    """What one attention call's first forward logs for its recomputation (and its own backward).

    ``stored``: a weak reference to the first forward's chunks when it kept them (the recomputation
    replays the output from them; ``rng_after`` is where that forward left the random generators).
    ``recomputed``: when the first forward kept nothing, the chunks the recomputation stored; the
    first forward's backward takes them from here (the checkpoint differentiates the first forward's
    graph, not the recomputed one). ``blocks``: then, the first forward's block pattern, which the
    recomputation reuses (a ``mask_mod`` is evaluated once per step).
    """

    stored: weakref.ref | None = None
    rng_after: RngState | None = None
    recomputed: object | None = None
    blocks: object | None = None

    @property
    def kept(self) -> bool:
        return self.stored is not None


class CheckpointState:
    """Record/replay log of the running checkpoints of one runtime, and the replay budget of the step.

    ``scopes()`` is the checkpoint's ``context_fn``: the first forward's scope records one
    :class:`ReplayEntry` per attention call, the recomputation's scope hands them back in order.
    ``replay_budget`` (bytes, ``None`` = no limit) is what replay chunks may hold across layers; it is
    set once per step (:func:`hf_fpdt.memory.planner.plan`), and :meth:`may_keep` charges it per layer.
    """

    def __init__(self, replay_budget: int | None = None) -> None:
        self.depth = 0  # > 0 while a marked checkpoint recomputes a layer
        self.replay_budget = replay_budget
        self.kept_bytes = 0  # replay chunks of layers whose backward has not run yet
        self.planned: object = None  # the step shape the replay budget was planned for
        self.segments = 1  # k layers per checkpoint segment now applied (fixed, or "auto"'s pick of the step)
        self._recording: deque | None = None
        self._replaying: deque | None = None
        self._replay = True  # False in a checkpoint segment's first forward: nothing is kept for replay

    def scopes(
        self, replay: bool = True
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The (first forward, recomputation) contexts of one non-reentrant checkpoint call.

        ``replay=False`` (a checkpoint segment of several layers): the first forward keeps no replay chunks,
        its recomputation computes attention again and hands the chunks to the first forward's backward.
        """
        log: deque = deque()
        return self._record_scope(log, replay), self.recompute_scope(log)

    @contextlib.contextmanager
    def _record_scope(self, log: deque, replay: bool = True) -> Iterator[None]:
        outer = self._recording, self._replay
        self._recording, self._replay = log, replay
        try:
            yield
        finally:
            self._recording, self._replay = outer

    @contextlib.contextmanager
    def recompute_scope(self, log: deque | None = None) -> Iterator[None]:
        """Marks a checkpoint's recomputation of a layer (``log``: the first forward's entries)."""
        self.depth += 1
        outer = self._recording, self._replaying
        self._recording, self._replaying = None, log
        try:
            yield
        finally:
            self.depth -= 1
            self._recording, self._replaying = outer

    @property
    def recomputing(self) -> bool:
        """True inside a marked checkpoint's recomputation."""
        return self.depth > 0

    @property
    def recording(self) -> bool:
        """True inside the first forward of a marked checkpoint (what :meth:`record` logs is kept)."""
        return self._recording is not None

    def record(self, entry: ReplayEntry) -> None:
        """Log ``entry`` for the recomputation of the running checkpoint (no-op outside one)."""
        if self._recording is not None:
            self._recording.append(entry)

    def replayed(self) -> ReplayEntry | None:
        """The next entry the first forward logged, during its recomputation; None when there is none."""
        return self._replaying.popleft() if self._replaying else None

    def may_keep(self, nbytes: int) -> bool:
        """Whether a layer's replay chunks of ``nbytes`` fit in what the budget still holds."""
        if not self._replay:
            return False
        return self.replay_budget is None or self.kept_bytes + nbytes <= self.replay_budget

    def charge(self, stored: object, nbytes: int) -> None:
        """Count ``nbytes`` against the budget until ``stored`` (the kept chunks) dies after its backward."""
        self.kept_bytes += nbytes
        weakref.finalize(stored, self._refund, nbytes)

    def _refund(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes


class _Saved:
    """One offloaded tensor: its host slot, then (after the first unpack) the device tensor.

    The slot goes back to the store at the first unpack, or (:meth:`release`) when this object dies without one:
    a graph dropped without its backward (a forward whose loss is never differentiated, an exception raised in the
    forward or in backward before this input's layer). Otherwise its host buffer and its share of the step's
    :class:`~hf_fpdt.memory.host_store.DeviceBudget` would stay charged, and every later lasting put would go to
    the host as if the budget were full.
    """

    def __init__(self, store: HostStore, slot: Slot, previous: _Saved | None) -> None:
        self.store, self.slot = store, slot
        # The tensor packed just before this one: the next one backward will ask for.
        self.previous = weakref.ref(previous) if previous is not None else None
        self._fetched: Fetched | None = None
        self._tensor: torch.Tensor | None = None

    def prefetch(self) -> None:
        if self._tensor is None and self._fetched is None and self.slot is not None:
            self._fetched = self.store.fetch(self.slot)

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            self.prefetch()
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.prefetch()  # overlaps this layer's recompute and backward
            self._tensor = self._fetched.wait()
            # The host buffer goes back to the pool now; the device copy stays for a repeated unpack
            # (retain_graph) and is freed with this object when autograd drops the saved tensor.
            self.release()
        return self._tensor

    def release(self) -> None:
        """Give the slot back to the store and drop a pending fetch (idempotent; an unpacked tensor stays).

        A pending fetch needs no more than dropping it: the store orders the buffer's next use after its copy
        (the slot's ``read`` event goes with the buffer), and a staging buffer is free once nothing holds it."""
        slot, self.slot, self._fetched = self.slot, None, None
        self.store.release(slot)  # None after the first release: a no-op

    def __del__(self) -> None:
        # As the attention's ``_Stored``: a finalizer that holds nothing but this object's own fields, so it
        # keeps nothing alive; at interpreter shutdown the store may be half torn down, and its pool goes anyway.
        try:
            self.release()
        except Exception:
            pass


class LayerInputOffloader:
    """Pack/unpack hooks that keep checkpointed layer inputs in a pooled store: on the device while the
    step's device budget holds them (oldest spilled to the host first), else in host memory.

    One offloader serves all layers of a model (its pool is reused across layers and steps).

    Args:
        budget: the device budget shared with the attention's chunk store (``FPDTRuntime.residency``);
            ``None``: a budget of 0 (every input goes to the host).
        enabled: copy to the host at all; ``None``: on every device but the CPU (whose tensors already
            live in host memory, a copy would only cost time and memory). Tests set it on CPU.
        sync_copies: synchronise the device after every copy (``FPDTConfig.sync_copies``, race checks).
    """

    def __init__(
        self, budget: DeviceBudget | None = None, enabled: bool | None = None, sync_copies: bool = False
    ) -> None:
        self._stores: dict[str, HostStore] = {}
        self._last: weakref.ref | None = None
        self.budget = budget if budget is not None else DeviceBudget(0)
        self.enabled = enabled
        self.sync_copies = sync_copies

    def use(self, budget: DeviceBudget, sync_copies: bool | None = None) -> None:
        """Charge ``budget`` from now on (a re-applied runtime's), and synchronise after copies as
        ``sync_copies`` says (``None``: unchanged); the stores are made again when either changes."""
        sync = self.sync_copies if sync_copies is None else sync_copies
        if budget is not self.budget or sync != self.sync_copies:
            self.budget, self.sync_copies = budget, sync
            self.release()

    def store(self, device: torch.device) -> HostStore:
        key = str(device)
        if key not in self._stores:
            enabled = device.type != "cpu" if self.enabled is None else self.enabled
            self._stores[key] = HostStore(device, enabled=enabled, budget=self.budget, sync_copies=self.sync_copies)
        return self._stores[key]

    def placement(self) -> list[str]:
        """Where the inputs packed so far and not yet unpacked are, oldest first: ``"device"`` or ``"host"``."""
        tiers = []
        saved = self._last() if self._last is not None else None
        while saved is not None:
            if saved.slot is not None:
                tiers.append("host" if saved.slot.host is not None else "device")
            saved = saved.previous() if saved.previous is not None else None
        return tiers[::-1]

    def release(self) -> None:
        """Drop the host stores and their pooled buffers (re-created on next use)."""
        self._stores.clear()

    def __getstate__(self) -> dict:
        """A copy (``torch.save(model)``, ``copy.deepcopy``) without the weak reference to the last packed input
        (a step's tensor in flight, which a copy does not hold); its stores are pickled as they are."""
        return {**vars(self), "_last": None}

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t  # parameters live anyway; empty tensors (checkpoint's dummy) cost nothing
        store = self.store(t.device)
        previous = self._last() if self._last is not None else None
        saved = _Saved(store, store.put(t, lasting=True), previous)
        self._last = weakref.ref(saved)
        return saved

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed.get() if isinstance(packed, _Saved) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run a checkpointing layer's call under."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
