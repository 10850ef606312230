"""Host store: where the chunk pipeline parks key/value/query chunks between their uses.

A :class:`HostStore` owns a pool of host buffers keyed by (element count, dtype). Buffers are taken
from the pool by :meth:`HostStore.put` and returned by :meth:`HostStore.release`, so after the first
training step every layer and every later step reuses the same memory: nothing is allocated per
chunk per step in steady state. On CUDA the buffers are pinned and copies run on two side streams
(device-to-host and host-to-device) ordered by events, so :meth:`fetch` of the next chunk overlaps the
attention of the current one and no host synchronisation happens inside the chunk loops.

On CPU the same code runs synchronously: ``put`` copies into a pooled buffer and ``fetch`` hands that
buffer back without a copy (it already lives in the memory the kernels read).

With ``enabled=False`` the store keeps device tensors as they are (``offload=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    """One stored tensor: either a host buffer (offloaded) or the device tensor itself."""

    shape: torch.Size
    dtype: torch.dtype
    host: torch.Tensor | None = None
    device_tensor: torch.Tensor | None = None
    written: object | None = None  # CUDA event: the device-to-host copy into ``host`` finished
    read: object | None = None  # CUDA event: the last host-to-device copy out of ``host`` finished


@dataclass
class Fetched:
    """A tensor on its way to the device; :meth:`wait` orders the compute stream after its copy."""

    tensor: torch.Tensor
    event: object | None = None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
            self.event = None
        return self.tensor


@dataclass
class HostStore:
    """Pooled host memory for offloaded chunks (pinned with copy streams on CUDA).

    Args:
        device: the device the kernels compute on.
        enabled: offload to host (True) or keep tensors on the device (False).
    """

    device: torch.device
    enabled: bool = True
    _free: dict = field(default_factory=dict, repr=False)
    _streams: tuple | None = field(default=None, repr=False)
    host_bytes: int = 0  # bytes of host memory the pool has allocated in all

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

    def put(self, t: torch.Tensor, slot: Slot | None = None) -> Slot:
        """Store ``t`` (into ``slot``'s buffer when given, e.g. to update an accumulator)."""
        if not self.enabled:
            if slot is None:
                return Slot(t.shape, t.dtype, device_tensor=t)
            slot.device_tensor = t
            return slot
        if slot is None:
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
            slot.host.copy_(t, non_blocking=True)
            t.record_stream(d2h)  # keep t's memory alive until the copy has run
            slot.written = d2h.record_event()
        return slot

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
            out.copy_(slot.host, non_blocking=True)
            slot.read = h2d.record_event()
        return Fetched(out, slot.read)

    def get(self, slot: Slot) -> torch.Tensor:
        """Fetch and wait (no overlap): for tensors needed at once."""
        return self.fetch(slot).wait()

    def release(self, slot: Slot | None) -> None:
        """Return ``slot``'s buffer to the pool; pending copies are ordered before any reuse."""
        if slot is None:
            return
        if slot.host is not None:
            buf = slot.host
            self._free.setdefault((buf.numel(), buf.dtype), []).append((buf.view(-1), slot.read))
        slot.host = None
        slot.device_tensor = None

    def pooled_bytes(self) -> int:
        """Bytes currently idle in the pool (allocated, not holding a live chunk)."""
        return sum(b.numel() * b.element_size() for bufs in self._free.values() for b, _ in bufs)
