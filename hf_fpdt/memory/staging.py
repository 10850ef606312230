"""The staging ring: preallocated device buffers that fetches from the host store copy into, reused in turn.

A fetch (:meth:`hf_fpdt.memory.host_store.HostStore.fetch`) copies a host buffer into a device buffer on the
host-to-device stream. Allocating that buffer per fetch and handing it to the compute stream with
``record_stream`` lets device memory grow with how far the host runs ahead of the device: the allocator may hand
a freed buffer to the next copy only once the compute stream has passed its last use, so while the host queues
fetches faster than the device computes, each takes new memory (TRL's offloader calls this non-deterministic in
memory). The ring instead keeps device buffers (*stages*) per size class (the power of two at or above their
bytes, :func:`hf_fpdt.memory.host_pool.size_class`: a chunk's k and v share one, q and o another, nearby lengths
the same) and reuses a stage once nothing holds it:

* a stage is free when its storage has no holder but the ring (:func:`hf_fpdt.memory.compat_torch.storage_use_count`:
  no tensor, view, detached copy or autograd-saved tensor over it). Then every kernel that reads it has been queued;
* "slot free" event: when a free stage is taken again, the stream that consumed it last records an event and the
  copy stream waits for it (and for the events of other streams that read it, e.g. a device-to-host copy of an
  accumulator, :meth:`StagingRing.read_by`) before the new copy overwrites it. No host synchronisation;
* a new stage is allocated only when every stage of the class is held: the ring's size is the most fetched tensors
  of a class alive at once, which the code's structure sets (``PREFETCH_DEPTH`` groups ahead plus the ones in use),
  not the device's progress. Device memory (reserved, not only allocated) does not grow with how far the host runs
  ahead; the host waits for nothing either, the copy stream waits instead.

``record_stream`` is called once per stage and consumer stream, only so that a stage the ring drops (trimmed after
a step shape change, the store released) goes back to the allocator after its last reader, never per fetch.
Trimming follows the host pool's: :meth:`StagingRing.new_shape` marks a new step shape, :meth:`StagingRing.trim` at
the store's next idle point drops the free stages not taken since.

The writes' side (:class:`HeldSources`) is the same idea the other way round: a put's device tensor, read by its copy to
the host on the device-to-host stream, is not left to ``record_stream`` (which hands its memory back to the allocator
only once the copy stream's work queued by the time the tensor is dropped has run: with the host ahead, every chunk
put meanwhile, so device memory would grow with the host's lead). The store holds it with the event recorded after
its copy and lets it go once that event has completed (``query()``, no host synchronisation) or, when more than
``WRITES_IN_FLIGHT`` times the largest held tensor's bytes are held, after the stream that allocated it waits for the
event ("copy done": the allocator's stream-ordered reuse of the memory then comes after the copy).

Streams are duck-typed (``record_event()``, ``wait_event(event)``) and the allocation is a callable, so the ring's
reuse and ordering are tested on CPU with fake streams (``tests/unit/test_offload.py``), and on the virtual CUDA device
(``tests/virtual_cuda.py``) with the real store: ``tests/unit/test_virtual_offload.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compat_torch import storage_use_count
from .host_pool import drop_stale, size_class

# A store holds the device tensors its copies to the host still read up to this many times the largest one's bytes:
# two, so a chunk's k, v and q put back to back (GQA: 1.5 q) never wait for each other's copy, nor a layer input for
# the small tensors packed after it.
WRITES_IN_FLIGHT = 2


@dataclass(eq=False)
class Stage:
    """One device staging buffer: flat ``uint8`` memory and what must finish before it is overwritten."""

    data: torch.Tensor
    baseline: int  # its storage's holders when only the ring holds it
    consumer: object | None = None  # the stream that consumed it last (Fetched.wait)
    readers: list = field(default_factory=list)  # events of other streams' reads since it was last taken
    recorded: list = field(default_factory=list)  # streams passed to record_stream (for its final free)
    epoch: int = 0  # the step shape it was last taken in

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The first ``shape.numel() * dtype.itemsize`` bytes as a tensor of ``shape`` and ``dtype``."""
        return self.data[: shape.numel() * dtype.itemsize].view(dtype).view(shape)

    def used_on(self, stream: object) -> None:
        """``stream`` consumes the stage (after waiting for its copy); its next overwrite waits for this stream."""
        self.consumer = stream
        if self.data.is_cuda and stream not in self.recorded:  # streams compare by id (a new object per query)
            self.data.record_stream(stream)  # once: a dropped stage is reused by the allocator after its readers
            self.recorded.append(stream)


@dataclass(frozen=True)
class DeviceBuffers:
    """The ring's allocation: a flat ``uint8`` tensor on ``device`` (on the current stream, the copy stream)."""

    device: torch.device

    def __call__(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


@dataclass
class StagingRing:
    """Device staging buffers by size class, reused once free (see the module docstring).

    ``allocate(nbytes)``: a flat ``uint8`` device tensor (called on the copy stream). ``allocations`` counts the
    stages made (all time); :attr:`nbytes` is the device memory the ring holds now.
    """

    allocate: Callable[[int], torch.Tensor]
    allocations: int = 0
    epoch: int = 0
    _stages: dict = field(default_factory=dict, repr=False)  # size class -> [Stage], least recently taken first
    _trim_due: bool = False

    @staticmethod
    def supported(t: torch.Tensor) -> bool:
        """Whether this torch says when a stage is free (:func:`storage_use_count`); else no ring is used."""
        return storage_use_count(t) is not None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for stages in self._stages.values() for s in stages)

    def stages(self) -> dict[int, int]:
        """Stages per size class (``{class bytes: count}``)."""
        return {c: len(s) for c, s in sorted(self._stages.items()) if s}

    def _free(self, stage: Stage) -> bool:
        return storage_use_count(stage.data) == stage.baseline

    def take(self, nbytes: int, copy_stream: object) -> Stage:
        """A stage of at least ``nbytes`` bytes, with ``copy_stream`` ordered after its last users."""
        stages = self._stages.setdefault(size_class(nbytes), [])
        free = [s for s in stages if self._free(s)]
        stage = next((s for s in free if s.nbytes >= nbytes), None)
        if stage is None:
            if free:  # the free stages of the class are all too small: the smallest makes room for a larger one
                stages.remove(min(free, key=lambda s: s.nbytes))
            data = self.allocate(nbytes)
            self.allocations += 1
            stage = Stage(data, storage_use_count(data))
        else:
            stages.remove(stage)
            if stage.consumer is not None:  # "slot free": the consumer's kernels queued so far include its last use
                copy_stream.wait_event(stage.consumer.record_event())
            for event in stage.readers:
                copy_stream.wait_event(event)
            stage.readers.clear()
        stage.epoch = self.epoch
        stages.append(stage)
        return stage

    def read_by(self, t: torch.Tensor, event: object) -> bool:
        """``t`` (maybe a stage's view) was read by a copy that finishes at ``event``: a stage waits for it. Whether
        ``t`` is a stage's."""
        ptr = t.untyped_storage().data_ptr()
        for stages in self._stages.values():
            for stage in stages:
                if stage.data.untyped_storage().data_ptr() == ptr:
                    stage.readers.append(event)
                    return True
        return False

    def new_shape(self) -> None:
        """A new step shape begins: free stages it does not take by the next :meth:`trim` are dropped then."""
        self.epoch += 1
        self._trim_due = True

    def trim(self) -> int:
        """At an idle point after :meth:`new_shape`: drop the free stages not taken since; returns their bytes."""
        if not self._trim_due:
            return 0
        self._trim_due = False
        return drop_stale(self._stages, self.epoch, self._free)


@dataclass(eq=False)
class _Held:
    tensor: torch.Tensor
    event: object  # the copy stream's event after the copy that reads ``tensor``
    stream: object  # the stream ``tensor`` was allocated on (current at its put)
    nbytes: int  # its own (a view keeps its base, alive anyway as a rule: a chunk of a longer tensor)


@dataclass
class HeldSources:
    """Device tensors read by copies to the host still in flight, held until those copies are done (module
    docstring): at most ``factor`` times the largest one's bytes, whatever the host's lead. ``nbytes``: held now."""

    factor: int = WRITES_IN_FLIGHT
    _held: deque = field(default_factory=deque, repr=False)  # oldest first (their copies finish in this order)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._held)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, t: torch.Tensor, event: object, stream: object) -> None:
        """Keep ``t`` until ``event`` (recorded after its copy) is done; ``stream``: the one it was allocated on."""
        self.reap()
        self._held.append(_Held(t, event, stream, t.numel() * t.element_size()))
        while len(self._held) > 1 and self.nbytes > self.factor * max(h.nbytes for h in self._held):
            self._let_go()

    def reap(self) -> None:
        """Drop the tensors whose copies are done (``event.query()``: no host synchronisation)."""
        while self._held and self._held[0].event.query():
            self._held.popleft()

    def drain(self) -> None:
        """Drop all: each allocating stream waits for its tensor's copy first (an idle point of the store)."""
        while self._held:
            self._let_go()

    def _let_go(self) -> None:
        held = self._held.popleft()
        held.stream.wait_event(held.event)  # its memory is reused on that stream only after the copy has read it


__all__ = ["WRITES_IN_FLIGHT", "DeviceBuffers", "HeldSources", "Stage", "StagingRing"]
