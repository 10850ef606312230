"""Host store: where the chunk pipeline parks key/value/query chunks between their uses.

A :class:`HostStore` owns a pool of host buffers keyed by (element count, dtype). Buffers are taken
from the pool by :meth:`HostStore.put` and returned by :meth:`HostStore.release`, so after the first
training step every layer and every later step reuses the same memory: nothing is allocated per
chunk per step in steady state. On CUDA the buffers are pinned and copies run on two side streams
(device-to-host and host-to-device) ordered by events, so :meth:`fetch` of the next chunk overlaps the
attention of the current one and no host synchronisation happens inside the chunk loops.

On CPU the same code runs synchronously: ``put`` copies into a pooled buffer and ``fetch`` hands that
buffer back without a copy (it already lives in the memory the kernels read).

With ``enabled=False`` the store keeps device tensors as they are (``offload=False``). Between the two,
``resident_bytes`` is a device-memory budget (SPPO's two-level idea): tensors are kept on the device,
first come first served, while they fit in it, and only the rest goes to host memory. Chunks are put in
order, so the first chunks of the first layers stay resident; they are also the ones fetched most often
in forward (``k_0`` is read by every later chunk).

Exposed transfer time: with ``stats.enabled`` on CUDA, :meth:`Fetched.wait` brackets the compute stream's
wait for a copy with timing events; their elapsed time is how long compute stalled on the host link. The
events are read (one synchronisation) only by :meth:`TransferStats.collect`, after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    device_tensor: torch.Tensor | None = None
    written: object | None = None  # CUDA event: the device-to-host copy into ``host`` finished
    read: object | None = None  # CUDA event: the last host-to-device copy out of ``host`` finished
    resident_nbytes: int = 0  # bytes this slot holds of the store's resident budget


@dataclass
class Fetched:
    """A tensor on its way to the device; :meth:`wait` orders the compute stream after its copy."""

    tensor: torch.Tensor
    event: object | None = None
    stats: TransferStats | None = None

    def wait(self) -> torch.Tensor:
        """The tensor, with the compute stream ordered after its copy (no host synchronisation)."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            if self.stats is not None and self.stats.enabled:
                self.stats.wait(stream, self.event)
            else:
                stream.wait_event(self.event)
            self.event = None
        return self.tensor


@dataclass
class HostStore:
    """Pooled host memory for offloaded chunks (pinned with copy streams on CUDA).

    Args:
        device: the device the kernels compute on.
        enabled: offload to host (True) or keep tensors on the device (False).
        resident_bytes: with ``enabled``, device bytes that may still stay on the device (first come,
            first served); 0 offloads everything.
        stats: where exposed transfer time is accumulated (see :class:`TransferStats`).
    """

    device: torch.device
    enabled: bool = True
    resident_bytes: int = 0
    stats: TransferStats = field(default_factory=TransferStats)
    _free: dict = field(default_factory=dict, repr=False)
    _streams: tuple | None = field(default=None, repr=False)
    host_bytes: int = 0  # bytes of host memory the pool has allocated in all
    resident_used: int = 0  # bytes of the resident budget held by live slots

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)

    @property
    def is_async(self) -> bool:
        return self.enabled and self.device.type == "cuda"

    def _copy_streams(self) -> tuple:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def _take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, object | None]:
        # Returns a flat buffer and the event of the last copy that read it (None if none pending).
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        self.host_bytes += numel * torch.empty((), dtype=dtype).element_size()
        return torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda"), None

    def _keep_resident(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        # (tensor to keep, bytes charged to the resident budget), or None: offload it.
        if not self.enabled:
            return t, 0
        nbytes = t.numel() * t.element_size()
        if self.resident_used + nbytes > self.resident_bytes:
            return None
        if t.untyped_storage().nbytes() > nbytes:
            t = t.clone()  # a view would keep its whole base alive, uncharged
        self.resident_used += nbytes
        return t, nbytes

    def put(self, t: torch.Tensor, slot: Slot | None = None) -> Slot:
        """Store ``t`` (into ``slot``'s buffer when given, e.g. to update an accumulator)."""
        if slot is not None and slot.host is None:  # a resident slot stays resident
            slot.device_tensor = t
            return slot
        if slot is None:
            kept = self._keep_resident(t)
            if kept is not None:
                return Slot(t.shape, t.dtype, device_tensor=kept[0], resident_nbytes=kept[1])
            buf, last_read = self._take(t.numel(), t.dtype)
            slot = Slot(t.shape, t.dtype, host=buf.view(t.shape), read=last_read)
        if slot.host.data_ptr() == t.data_ptr():
            return slot  # updated in place through a zero-copy fetch (CPU)
        if not self.is_async:
            slot.host.copy_(t)
            return slot
        d2h, _ = self._copy_streams()
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            if slot.read is not None:
                d2h.wait_event(slot.read)  # an earlier fetch of this buffer must finish first
            self._copy(d2h, slot.host, t)
            t.record_stream(d2h)  # keep t's memory alive until the copy has run
            slot.written = d2h.record_event()
        return slot

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stats.enabled:
            self.stats.copy(stream, lambda: dst.copy_(src, non_blocking=True))
        else:
            dst.copy_(src, non_blocking=True)

    def fetch(self, slot: Slot) -> Fetched:
        """Start bringing ``slot`` back to the device; call ``.wait()`` before using the tensor."""
        if slot.device_tensor is not None:
            return Fetched(slot.device_tensor)
        if not self.is_async:
            return Fetched(slot.host)
        _, h2d = self._copy_streams()
        compute = torch.cuda.current_stream(self.device)
        out = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)  # owned by the compute stream
        h2d.wait_stream(compute)
        with torch.cuda.stream(h2d):
            if slot.written is not None:
                h2d.wait_event(slot.written)
            self._copy(h2d, out, slot.host)
            slot.read = h2d.record_event()
        return Fetched(out, slot.read, self.stats)

    def get(self, slot: Slot) -> torch.Tensor:
        """Fetch and wait (no overlap): for tensors needed at once."""
        return self.fetch(slot).wait()

    def release(self, slot: Slot | None) -> None:
        """Return ``slot``'s buffer to the pool; pending copies are ordered before any reuse (idempotent)."""
        if slot is None:
            return
        self.resident_used -= slot.resident_nbytes
        slot.resident_nbytes = 0
        if slot.host is not None:
            buf = slot.host
            self._free.setdefault((buf.numel(), buf.dtype), []).append((buf.view(-1), slot.read))
        slot.host = None
        slot.device_tensor = None

    def pooled_bytes(self) -> int:
        """Bytes currently idle in the pool (allocated, not holding a live chunk)."""
        return sum(b.numel() * b.element_size() for bufs in self._free.values() for b, _ in bufs)
