"""Host buffers as the allocator takes them: the rounding rule, the allocator seam, the pool of size classes.

torch's caching host allocator (``pin_memory=True``) rounds every block up to a power of two
(``PowerOf2Ceil`` in ``CachingHostAllocator.h``), unless the request is above ``pinned_max_round_threshold_mb``
or ``pinned_max_cached_size_mb`` of ``PYTORCH_ALLOC_CONF`` (``PYTORCH_CUDA_ALLOC_CONF``): a 1.5 GiB layer input
takes a 2 GiB block. :func:`host_block_nbytes` is that rule, in one place: the pool (:class:`HostPool`), the
planner (:mod:`hf_fpdt.memory.planner`) and ``python -m hf_fpdt.bench plan`` count host buffers with it, so the
budget holds what the allocator really takes. Pageable memory (the CPU path, where the device *is* the host and
nothing is pinned) is taken at its size.

:class:`HostPool` keeps idle buffers by size class (the power of two at or above their bytes; flat ``uint8``
buffers viewed as any dtype and shape), not by exact ``(numel, dtype)``: a request takes an idle buffer of its
class that is large enough (the last given back), so nearby sizes (the last chunk of another sequence length, a
float32 accumulator and a bfloat16 chunk of the same bytes) share buffers. A pinned buffer is allocated at its whole
block (what the allocator takes anyway), so every request of its class fits it; a pageable one at the request's size.

Trimming: :meth:`HostPool.new_shape` marks a new step shape; the buffers not taken again by the next idle
point (:meth:`HostPool.trim`, called by the store when none of its buffers holds a live chunk, i.e. at the end
of the new shape's first step) are freed, and the allocator is asked to give its cached blocks back
(``torch.accelerator.empty_host_cache`` for pinned memory: a freed pinned tensor otherwise stays in torch's
cache, pinned). Between the mark and that point the old shape's idle buffers and the new shape's both exist.

The allocator is a seam (:class:`HostAllocator`): :class:`TorchHostAllocator` by default, a fake one in tests
that counts what it hands out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

_MIB = 1 << 20


@dataclass(frozen=True)
class PinnedRounding:
    """torch's caching host allocator's rounding settings (``PYTORCH_ALLOC_CONF``); ``None``: no limit."""

    round_threshold: int | None = None  # pinned_max_round_threshold_mb, in bytes: larger requests are not rounded
    max_cached: int | None = None  # pinned_max_cached_size_mb, in bytes: larger blocks are neither rounded nor cached

    @classmethod
    def from_env(cls, environ: dict | None = None) -> PinnedRounding:
        """The settings torch reads: ``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF`` (``key:value,...``)."""
        env = os.environ if environ is None else environ
        raw = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
        values = {}
        for item in raw.split(","):
            key, _, value = item.partition(":")
            if value.strip().isdigit():
                values[key.strip()] = int(value) * _MIB
        return cls(values.get("pinned_max_round_threshold_mb"), values.get("pinned_max_cached_size_mb"))

    def block_nbytes(self, nbytes: int) -> int:
        """Bytes of the block a pinned request of ``nbytes`` takes."""
        if nbytes <= 0:
            return 0
        limits = [x for x in (self.round_threshold, self.max_cached) if x is not None]
        return nbytes if limits and nbytes > min(limits) else size_class(nbytes)


def size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (1 for 0 or 1): the pool's size classes and pinned blocks."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def pins(device_type: str) -> bool:
    """Whether the host store pins its buffers for a device of this type (CUDA; on CPU the device is the host)."""
    return device_type == "cuda"


def device_ints(rows: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Host integer lists as int64 tensors on ``device`` in one copy that never blocks the host: packed into one
    buffer (pinned where the device is CUDA: :func:`pins`), copied with
    ``non_blocking=True`` and split (views). A ``torch.tensor(list, device=cuda)`` per list would be a copy from
    pageable memory each, every one a host synchronisation, per block. The pinned source is the caching host
    allocator's, which keeps it until the copy has run."""
    device = torch.device(device)
    flat = [x for row in rows for x in row]
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type != "cpu":
        host = host.pin_memory() if pins(device.type) else host
        host = host.to(device, non_blocking=True)
    out, at = [], 0
    for row in rows:
        out.append(host[at : at + len(row)])
        at += len(row)
    return out


def host_block_nbytes(nbytes: int, pinned: bool, rounding: PinnedRounding | None = None) -> int:
    """Bytes the host allocator takes for a buffer of ``nbytes``: the pinned allocator's power-of-two block
    (:class:`PinnedRounding`, read from the environment when not given), or ``nbytes`` for pageable memory.
    The one rule the pool, the planner and ``bench plan`` count with."""
    if not pinned:
        return max(0, int(nbytes))
    return (rounding or PinnedRounding.from_env()).block_nbytes(int(nbytes))


class HostAllocator(Protocol):
    """Where the pool's buffers come from (the seam tests replace with a counting fake)."""

    pinned: bool

    def block_nbytes(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` takes."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` host tensor of ``block_nbytes(nbytes)`` bytes."""
        ...

    def free_cached(self) -> None:
        """Give blocks cached after their tensors were freed back to the system."""
        ...


def drop_stale(classes: dict, epoch: int, removable: Callable[[object], bool] = lambda item: True) -> int:
    """Remove from ``classes`` (size class -> items with ``epoch`` and ``nbytes``) the items last taken before
    ``epoch`` that ``removable`` allows, and the classes left empty; returns the bytes removed. The one trim rule
    of the host pool and the device staging ring: what a new step shape did not take goes."""
    removed = 0
    for c in list(classes):
        stale = [x for x in classes[c] if x.epoch != epoch and removable(x)]
        removed += sum(x.nbytes for x in stale)
        classes[c] = [x for x in classes[c] if not any(x is y for y in stale)]
        if not classes[c]:
            del classes[c]
    return removed


@dataclass
class TorchHostAllocator:
    """torch's host memory: pinned through its caching host allocator (``pinned``), or pageable."""

    pinned: bool
    rounding: PinnedRounding = field(default_factory=PinnedRounding.from_env)

    def block_nbytes(self, nbytes: int) -> int:
        return host_block_nbytes(nbytes, self.pinned, self.rounding)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(self.block_nbytes(nbytes), dtype=torch.uint8, pin_memory=self.pinned)

    def free_cached(self) -> None:
        empty = getattr(torch.accelerator, "empty_host_cache", None)  # torch >= 2.10
        if self.pinned and empty is not None:
            empty()


@dataclass(eq=False)
class HostBuffer:
    """One pooled buffer: flat ``uint8`` memory, the event of the last copy that read it, the shape it serves."""

    data: torch.Tensor
    read: object | None = None  # CUDA event: the last host-to-device copy out of it (None: none pending)
    epoch: int = 0  # the step shape (HostPool.epoch) it was last taken in

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The first ``shape.numel() * dtype.itemsize`` bytes as a tensor of ``shape`` and ``dtype``."""
        return self.data[: shape.numel() * dtype.itemsize].view(dtype).view(shape)


@dataclass
class HostPool:
    """Idle host buffers by size class; ``host_bytes`` is what the allocator handed out for them, as it takes it.

    ``take(nbytes)`` returns an idle buffer of ``nbytes``' class large enough (the last given back), else a new one;
    ``give(buffer)`` puts it back. See the module docstring for trimming.
    """

    allocator: HostAllocator
    host_bytes: int = 0  # bytes the allocator took for the pool's buffers (idle and in use)
    epoch: int = 0  # the step shape now (new_shape counts them)
    _free: dict = field(default_factory=dict, repr=False)  # size class -> [HostBuffer], idle
    _trim_due: bool = False

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes`` bytes, idle ones first."""
        idle = self._free.get(size_class(nbytes), [])
        # The last given back that fits (pinned buffers of a class all do: O(1)), so a step reuses as few as it can.
        at = next((i for i in range(len(idle) - 1, -1, -1) if idle[i].nbytes >= nbytes), None)
        if at is not None:
            buf = idle.pop(at)
        else:
            data = self.allocator.allocate(nbytes)
            self.host_bytes += data.numel()
            buf = HostBuffer(data)
        buf.epoch = self.epoch
        return buf

    def give(self, buf: HostBuffer) -> None:
        """Return ``buf`` to the idle buffers of its class."""
        self._free.setdefault(size_class(buf.nbytes), []).append(buf)

    def idle_bytes(self) -> int:
        """Bytes of the idle buffers."""
        return sum(b.nbytes for bufs in self._free.values() for b in bufs)

    def classes(self) -> dict[int, int]:
        """Idle buffers per size class (``{class bytes: count}``), for tests and reports."""
        return {c: len(bufs) for c, bufs in sorted(self._free.items()) if bufs}

    def new_shape(self) -> None:
        """A new step shape begins: the buffers it does not take by the next :meth:`trim` are freed then."""
        self.epoch += 1
        self._trim_due = True

    def trim(self) -> int:
        """At an idle point after :meth:`new_shape`: free the idle buffers not taken since; returns the bytes freed."""
        if not self._trim_due:
            return 0
        self._trim_due = False
        freed = drop_stale(self._free, self.epoch)
        if freed:
            self.host_bytes -= freed
            self.allocator.free_cached()
        return freed


__all__ = [
    "HostAllocator", "HostBuffer", "HostPool", "PinnedRounding", "TorchHostAllocator", "host_block_nbytes", "pins",
    "size_class",
]  # fmt: skip
