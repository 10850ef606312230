"""Host store: where the chunk pipeline parks key/value/query chunks between their uses.

A :class:`HostStore` owns a pool of host buffers in size classes (:class:`hf_fpdt.memory.host_pool.HostPool`:
nearby sizes share buffers; pinned buffers counted as the allocator takes them, power-of-two blocks). Buffers
are taken from the pool by :meth:`HostStore.put` and returned by :meth:`HostStore.release`, so after the first
training step every layer and every later step reuses the same memory: nothing is allocated per chunk per step
in steady state. When the step's shape changes (:meth:`DeviceBudget.new_shape`, called by the step's plan), the
buffers the new shape does not take are freed at the store's next idle point (no live chunk: the end of the new
shape's first step). On CUDA the buffers are pinned and copies run on two side streams (device-to-host and
host-to-device) ordered by events, so :meth:`fetch` of the next chunks overlaps the attention of the current one
and no host synchronisation happens inside the chunk loops. A fetch copies into a staging buffer of the device
ring (:class:`hf_fpdt.memory.staging.StagingRing`: preallocated per size class, reused once nothing holds it,
the copy stream waiting on a "slot free" event of the stream that consumed it), so device memory does not grow
with how far the host runs ahead; :class:`Prefetch` keeps ``PREFETCH_DEPTH`` fetches in flight. A put's device tensor
is held until its copy to the host is done (:class:`hf_fpdt.memory.staging.HeldSources`: at most ``WRITES_IN_FLIGHT``
times the largest one's bytes, the compute stream waiting for the oldest copy beyond that), not left to
``record_stream``, so neither direction's device memory grows with the host's lead.

On CPU the same code runs synchronously: ``put`` copies into a pooled buffer and ``fetch`` hands that
buffer back without a copy (it already lives in the memory the kernels read); nothing is pinned, no ring.

With ``enabled=False`` the store keeps device tensors as they are (``offload=False``). Between the two,
a :class:`DeviceBudget` (SPPO's two-level idea) lets tensors stay on the device while they fit in it; the
rest goes to host memory. One budget can be shared by several stores (the runtime shares one between
the attention's chunk store and the layer-input offloader: one device budget for the step). Two kinds
of puts charge it:

* ``lasting`` tensors, kept across layers until their backward (layer inputs, replay chunks): when the
  budget is full, the *oldest* lasting tensors are spilled to the host (copied out, their device memory
  freed) to make room. Forward puts layer after layer, so the device ends the forward holding the last
  layers' tensors: the first ones backward needs (no fetch at the start of backward, where nothing
  hides it), and the ones whose device memory is given back earliest in backward, when gradients and
  the backward's working set grow. Each spilled tensor is copied once, as it would have been had it
  gone to the host at once.
* transient tensors (a layer's own key/value chunks, dO and dq accumulators): resident only while the
  budget has room without spilling anything, else on the host; they never push out lasting ones.

Race check: with ``sync_copies`` (``FPDTConfig.sync_copies`` / ``FPDT_SYNC_COPIES=1``) every copy between device
and host is followed by a synchronisation of the device, so no copy overlaps anything; the results must be
bit-identical to the asynchronous run's (``tests/gpu``). ``synced`` counts those synchronisations. The other race
check delays the copies instead: ``before_copy(stream)`` runs on the copy stream before each copy is queued (the
GPU tests pass one that queues ``torch.cuda._sleep``); results must again equal the undelayed run's bit for bit.

Exposed transfer time: with ``stats.enabled`` on CUDA, :meth:`Fetched.wait` brackets the compute stream's
wait for a copy with timing events; their elapsed time is how long compute stalled on the host link. The
events are read (one synchronisation) only by :meth:`TransferStats.collect`, after the step.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .host_pool import HostAllocator, HostBuffer, HostPool, TorchHostAllocator, pins
from .staging import DeviceBuffers, HeldSources, Stage, StagingRing

PREFETCH_DEPTH = 2  # fetches kept in flight ahead of the block being computed


@dataclass
class TransferStats:
    """Exposed host-to-device transfer time of one runtime (filled only while ``enabled``, on CUDA).

    ``exposed_s``: seconds the compute stream waited for copies; ``copy_s``: seconds the copy streams
    spent copying (both directions); ``waits`` and ``copies`` count them. Call :meth:`collect` after the
    work to read the pending events (it synchronises on them), :meth:`reset` to start over.
    """

    enabled: bool = False
    exposed_s: float = 0.0
    copy_s: float = 0.0
    waits: int = 0
    copies: int = 0
    _waits: list = field(default_factory=list, repr=False)
    _copies: list = field(default_factory=list, repr=False)

    @staticmethod
    def _timing_event(stream) -> object:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        """Make ``stream`` wait for ``event``, timing the stall."""
        start = self._timing_event(stream)
        stream.wait_event(event)
        self._waits.append((start, self._timing_event(stream)))

    def copy(self, stream, fn) -> None:
        """Run ``fn()`` (a copy queued on ``stream``), timing it."""
        start = self._timing_event(stream)
        fn()
        self._copies.append((start, self._timing_event(stream)))

    def collect(self) -> TransferStats:
        """Add the elapsed time of all pending event pairs (synchronises on them)."""
        for pending, attr, count in ((self._waits, "exposed_s", "waits"), (self._copies, "copy_s", "copies")):
            for start, end in pending:
                end.synchronize()
                setattr(self, attr, getattr(self, attr) + start.elapsed_time(end) / 1e3)
            setattr(self, count, getattr(self, count) + len(pending))
            pending.clear()
        return self

    def reset(self) -> None:
        """Zero the counters and drop pending events."""
        self.exposed_s = self.copy_s = 0.0
        self.waits = self.copies = 0
        self._waits.clear()
        self._copies.clear()


@dataclass
class Slot:
    """One stored tensor: either a host buffer (offloaded) or the device tensor itself."""

    shape: torch.Size
    dtype: torch.dtype
    host: torch.Tensor | None = None
    buffer: HostBuffer | None = None  # the pooled buffer ``host`` views
    device_tensor: torch.Tensor | None = None
    written: object | None = None  # CUDA event: the device-to-host copy into ``host`` finished
    read: object | None = None  # CUDA event: the last host-to-device copy out of ``host`` finished
    resident_nbytes: int = 0  # bytes this slot holds of the store's resident budget


@dataclass
class DeviceBudget:
    """Device bytes that stored tensors may keep on the device, shared by the stores of one model.

    ``limit``: bytes (``None``: no limit, nothing is offloaded); set once per step by the plan
    (``planned``; see :func:`hf_fpdt.integrations.step_plan.plan_step`). ``used``: bytes held by live
    resident slots. ``spilled``: bytes moved to the host to make room for later lasting tensors (counted
    since the budget was made). See the module docstring for which tensors stay. ``shape``: counts the step
    shapes planned (:meth:`new_shape`); the stores sharing the budget trim their pools when it moves.
    """

    limit: int | None = 0
    used: int = 0
    spilled: int = 0
    planned: bool = False
    shape: int = 0
    _lasting: deque = field(default_factory=deque, repr=False)  # (weakref to slot, store), oldest first

    def room(self, nbytes: int, spill: bool) -> bool:
        """Whether ``nbytes`` more fit; with ``spill``, the oldest lasting tensors go to the host first."""
        if self.limit is None or self.used + nbytes <= self.limit:
            return True
        if not spill or nbytes > self.limit:
            return False
        while self._lasting and self.used + nbytes > self.limit:
            ref, store = self._lasting.popleft()
            slot = ref()
            if slot is not None and slot.resident_nbytes:
                store._spill(slot)
        return self.used + nbytes <= self.limit

    def new_shape(self) -> None:
        """A new step shape is planned: the stores' buffers it does not use are freed after its first step."""
        self.shape += 1

    def charge(self, slot: Slot, store: HostStore, lasting: bool) -> None:
        self.used += slot.resident_nbytes
        if lasting:
            self._lasting.append((weakref.ref(slot), store))

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes
        if self.used == 0:
            self._lasting.clear()  # every entry left is a released slot

    def __getstate__(self) -> dict:
        """A copy (``torch.save(model)``, ``copy.deepcopy``) without the lasting slots' weak references: they point
        at a step's tensors in flight, which a copy does not hold; it starts with none (``used`` and the rest
        are plain numbers)."""
        return {**vars(self), "_lasting": deque()}


@dataclass
class Fetched:
    """A tensor on its way to the device; :meth:`wait` orders the compute stream after its copy."""

    tensor: torch.Tensor
    event: object | None = None
    stats: TransferStats | None = None
    stage: Stage | None = None  # the staging buffer ``tensor`` views (None: a fresh buffer, or no copy)

    def wait(self) -> torch.Tensor:
        """The tensor, with the compute stream ordered after its copy (no host synchronisation)."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            if self.stats is not None and self.stats.enabled:
                self.stats.wait(stream, self.event)
            else:
                stream.wait_event(self.event)
            if self.stage is not None:
                self.stage.used_on(stream)  # its next copy waits for this stream's kernels queued by then
            else:
                # A fresh buffer allocated on the copy stream (no ring in this torch): when the consumer drops it,
                # the allocator must not hand it to the next copy before the consumer's kernels have read it.
                self.tensor.record_stream(stream)
            self.event = None
        return self.tensor


@dataclass
class HostStore:
    """Pooled host memory for offloaded chunks (pinned with copy streams on CUDA).

    Args:
        device: the device the kernels compute on.
        enabled: offload to host (True) or keep tensors on the device (False).
        resident_bytes: with ``enabled`` and no ``budget``, the limit of the store's own
            :class:`DeviceBudget`; 0 offloads everything.
        budget: a :class:`DeviceBudget` shared with other stores (overrides ``resident_bytes``).
        stats: where exposed transfer time is accumulated (see :class:`TransferStats`).
        sync_copies: synchronise the device after every device<->host copy (a debug switch for race checks).
        allocator: where host buffers come from (:class:`hf_fpdt.memory.host_pool.HostAllocator`; default torch's,
            pinned on CUDA). Tests pass a counting fake.
        before_copy: called with the copy stream before each copy is queued on it (race checks delay the copies).
    """

    device: torch.device
    enabled: bool = True
    resident_bytes: int = 0
    budget: DeviceBudget | None = None
    stats: TransferStats = field(default_factory=TransferStats)
    sync_copies: bool = False
    allocator: HostAllocator | None = None
    before_copy: Callable[[object], None] | None = None
    pool: HostPool = field(init=False, repr=False)
    ring: StagingRing = field(init=False, repr=False)
    writes: HeldSources = field(default_factory=HeldSources, repr=False)  # put tensors their copies still read
    _streams: tuple | None = field(default=None, repr=False)
    _live: int = field(default=0, repr=False)  # host slots holding a chunk now
    _shape: int = field(default=0, repr=False)  # the budget's step shape the pool last saw
    resident_used: int = 0  # bytes of the resident budget held by this store's live slots
    host_used: int = 0  # bytes of host buffers (as allocated) held by this store's live slots
    fetched_bytes: int = 0  # bytes brought back from host buffers by fetch (all time; benchmarks take deltas)
    synced: int = 0  # synchronisations after copies (``sync_copies``; all time)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.budget is None:
            self.budget = DeviceBudget(self.resident_bytes)
        if self.allocator is None:
            self.allocator = TorchHostAllocator(pinned=pins(self.device.type))
        self.pool = HostPool(self.allocator)
        self.ring = StagingRing(DeviceBuffers(self.device))
        self._shape = self.budget.shape

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (idle and in use), as the allocator takes them."""
        return self.pool.host_bytes

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging ring (CUDA fetches copy into them)."""
        return self.ring.nbytes

    @property
    def is_async(self) -> bool:
        return self.enabled and self.device.type == "cuda"

    def _copy_streams(self) -> tuple:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def _check_shape(self) -> None:
        # The budget's step shape moved: the pool and the ring keep what the new shape takes by the next idle point.
        if self.budget.shape != self._shape:
            self._shape = self.budget.shape
            self.pool.new_shape()
            self.ring.new_shape()

    def _keep_resident(self, t: torch.Tensor, lasting: bool) -> tuple[torch.Tensor, int] | None:
        # (tensor to keep, bytes charged to the resident budget), or None: offload it.
        if not self.enabled:
            return t, 0
        nbytes = t.numel() * t.element_size()
        if not self.budget.room(nbytes, spill=lasting):
            return None
        if t.untyped_storage().nbytes() > nbytes:
            t = t.clone()  # a view would keep its whole base alive, uncharged
        return t, nbytes

    def put(self, t: torch.Tensor, slot: Slot | None = None, *, lasting: bool = False) -> Slot:
        """Store ``t`` (into ``slot``'s buffer when given, e.g. to update an accumulator).

        ``lasting``: ``t`` is kept across layers until its backward (see the module docstring).
        """
        if slot is not None and slot.host is None:  # a resident slot stays resident
            slot.device_tensor = t
            return slot
        if slot is None:
            kept = self._keep_resident(t, lasting)
            if kept is not None:
                slot = Slot(t.shape, t.dtype, device_tensor=kept[0], resident_nbytes=kept[1])
                self.resident_used += kept[1]
                self.budget.charge(slot, self, lasting)
                return slot
            slot = self._host_slot(t.shape, t.dtype)
        self._write(slot, t)
        return slot

    def _host_slot(self, shape: torch.Size, dtype: torch.dtype) -> Slot:
        self._check_shape()
        buf = self.pool.take(shape.numel() * dtype.itemsize)
        self.host_used += buf.nbytes
        self._live += 1
        return Slot(shape, dtype, host=buf.view(shape, dtype), buffer=buf, read=buf.read)

    def _spill(self, slot: Slot) -> None:
        """Move a resident slot's tensor to a host buffer (the budget makes room for a later lasting put)."""
        t = slot.device_tensor
        host = self._host_slot(slot.shape, slot.dtype)
        slot.host, slot.buffer, slot.read, slot.device_tensor = host.host, host.buffer, host.read, None
        self.budget.spilled += slot.resident_nbytes
        self._refund(slot)
        self._write(slot, t)

    def _refund(self, slot: Slot) -> None:
        self.resident_used -= slot.resident_nbytes
        self.budget.refund(slot.resident_nbytes)
        slot.resident_nbytes = 0

    def _write(self, slot: Slot, t: torch.Tensor) -> None:
        if slot.host.data_ptr() == t.data_ptr():
            return  # updated in place through a zero-copy fetch (CPU)
        if not self.is_async:
            slot.host.copy_(t)
            self._sync_after_copy()
            return
        d2h, _ = self._copy_streams()
        compute = torch.cuda.current_stream(self.device)
        d2h.wait_stream(compute)
        with torch.cuda.stream(d2h):
            if slot.read is not None:
                d2h.wait_event(slot.read)  # an earlier fetch of this buffer must finish first
            self._copy(d2h, slot.host, t)
            slot.written = d2h.record_event()
        # t's memory must not be reused before the copy has read it. An accumulator fetched into a stage: the ring
        # orders the stage's next copy after this one. Anything else is held until its copy is done, not left to
        # record_stream, whose memory would come back only when d2h ran the work queued by t's free: with the host
        # ahead, every chunk put meanwhile (staging.HeldSources; t is taken as allocated on the current stream).
        if not self.ring.read_by(t, slot.written):
            self.writes.hold(t, slot.written, compute)
        self._sync_after_copy()

    def _sync_after_copy(self) -> None:
        # The debug switch: the copy just queued (and everything queued before it, on every stream) has run
        # before the host queues anything else, so nothing overlaps it.
        if not self.sync_copies:
            return
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        self.synced += 1

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.before_copy is not None:
            self.before_copy(stream)
        if self.stats.enabled:
            self.stats.copy(stream, lambda: dst.copy_(src, non_blocking=True))
        else:
            dst.copy_(src, non_blocking=True)

    def fetch(self, slot: Slot) -> Fetched:
        """Start bringing ``slot`` back to the device; call ``.wait()`` before using the tensor."""
        if slot.device_tensor is not None:
            return Fetched(slot.device_tensor)
        self.fetched_bytes += slot.shape.numel() * slot.dtype.itemsize
        if not self.is_async:
            return Fetched(slot.host)
        self.writes.reap()
        _, h2d = self._copy_streams()
        with torch.cuda.stream(h2d):
            # The copy stream never waits for the compute stream as a whole: a staging buffer of the ring (allocated
            # on this stream) is reused only once nothing holds it, after an event of the stream that consumed it
            # last ("slot free"); it starts as soon as that and the host buffer's write are done, while compute
            # runs the blocks queued before it. Fetched.wait orders compute after it.
            stage = None
            if StagingRing.supported(slot.host):
                stage = self.ring.take(slot.shape.numel() * slot.dtype.itemsize, h2d)
                out = stage.view(slot.shape, slot.dtype)
            else:  # this torch cannot say when a stage is free: a fresh buffer per fetch (record_stream on wait)
                out = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
            if slot.written is not None:
                h2d.wait_event(slot.written)
            self._copy(h2d, out, slot.host)
            slot.read = h2d.record_event()
        self._sync_after_copy()
        return Fetched(out, slot.read, self.stats, stage)

    def get(self, slot: Slot) -> torch.Tensor:
        """Fetch and wait (no overlap): for tensors needed at once."""
        return self.fetch(slot).wait()

    def release(self, slot: Slot | None) -> None:
        """Return ``slot``'s buffer to the pool; pending copies are ordered before any reuse (idempotent).

        When no slot of the store holds a chunk any more (the end of a step), the pool and the staging ring drop
        what a new step shape has not used (:meth:`DeviceBudget.new_shape`)."""
        if slot is None:
            return
        if slot.resident_nbytes:
            self._refund(slot)
        if slot.host is not None:
            buf = slot.buffer
            buf.read = slot.read
            self.host_used -= buf.nbytes
            self.pool.give(buf)
            self._live -= 1
            if self._live == 0:
                self.writes.drain()
                self.pool.trim()
                self.ring.trim()
        slot.host = slot.buffer = None
        slot.device_tensor = None

    def pooled_bytes(self) -> int:
        """Bytes currently idle in the pool (allocated, not holding a live chunk)."""
        return self.pool.idle_bytes()


class Prefetch:
    """Fetches of an ordered list of slot groups, kept ``depth`` groups ahead of the consumer.

    ``take()`` returns the next group's tensors (the compute stream ordered after their copies) and starts
    the fetch ``depth`` groups further on, so the host-to-device stream always has the next copies queued
    while a block computes. For slots whose content changes between fetches (an accumulator) the caller
    orders fetch after update itself (see ``chunked_attention_backward``).
    """

    def __init__(self, store: HostStore, groups: Sequence[Sequence[Slot]], depth: int = PREFETCH_DEPTH) -> None:
        self._store, self._groups, self._depth = store, groups, depth
        self._pending: deque = deque()
        self._next = 0
        self._fill()

    def _fill(self) -> None:
        while self._next < len(self._groups) and len(self._pending) < self._depth:
            self._pending.append([self._store.fetch(s) for s in self._groups[self._next]])
            self._next += 1

    def take(self) -> list[torch.Tensor]:
        """The next group, waited for; the next fetch starts before the wait."""
        group = self._pending.popleft()
        self._fill()
        return [f.wait() for f in group]
