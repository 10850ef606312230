"""The allocators a traced step's memory goes through, modelled from their rules (nothing is allocated).

:class:`DeviceAllocator` is CUDA's caching allocator (``c10/cuda/CUDACachingAllocator.cpp``): every request rounded
up to a multiple of 512 bytes; requests up to 1 MiB come from the small pool's 2 MiB segments, larger ones from
the large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB above;
a cached free block is reused best-fit within its stream's pool and split (small pool: a remainder of 512 bytes or
more; large pool: more than 1 MiB), neighbours merge when freed; a block goes back to the pool of the stream it was
allocated on. When a new segment would pass the device's capacity, the fully free segments are released (as the
allocator does before it reports an out-of-memory) and the request retried; a request that still does not fit is
counted in :attr:`DeviceAllocator.failures` (the trace goes on as if it had fitted, so one run says by how much).

:class:`HostAllocator` is the caching host allocator behind ``pin_memory=True``: each block rounded up to a power of
two, freed blocks kept for the next request of their size class, never returned.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KIB, MIB = 1 << 10, 1 << 20
MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_REQUEST = 1 * MIB  # up to this: the small pool
SMALL_SEGMENT = 2 * MIB
MID_SEGMENT = 20 * MIB  # a large request under 10 MiB gets a segment this big
MID_LIMIT = 10 * MIB
SEGMENT_ROUND = 2 * MIB


def round_request(nbytes: int) -> int:
    """The block size CUDA's caching allocator hands out for ``nbytes``."""
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def segment_bytes(size: int) -> int:
    """The segment (``cudaMalloc``) a rounded request of ``size`` bytes opens when no cached block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MID_LIMIT:
        return MID_SEGMENT
    return SEGMENT_ROUND * -(-size // SEGMENT_ROUND)


@dataclass(eq=False)
class Block:
    """A block of a segment: its bytes, offset, whether it is free, its neighbours in the segment."""

    size: int
    offset: int
    segment: Segment
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass(eq=False)
class Segment:
    size: int
    stream: int
    small: bool
    uid: int
    used: int = 0  # bytes of blocks in use


@dataclass
class DeviceAllocator:
    """CUDA's caching allocator, modelled (see the module docstring); ``capacity``: the device's bytes."""

    capacity: int | None = None
    allocated: int = 0  # bytes of blocks in use (what memory_allocated reports)
    reserved: int = 0  # bytes of segments (what memory_reserved and nvidia-smi see, less the context)
    peak_allocated: int = 0
    peak_reserved: int = 0
    failures: int = 0  # requests that did not fit even after the free segments were released
    short_by: int = 0  # the most bytes one of them lacked
    segments: int = 0
    _pools: dict = field(default_factory=dict)  # (stream, small) -> sorted [(size, uid, block)]
    _uid: int = 0

    def malloc(self, nbytes: int, stream: int) -> Block:
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._pools.setdefault((stream, small), [])
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = self._new_segment(size, stream, small)
        block.free = False
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = Block(rest, block.offset + size, block.segment, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.segment.used += block.size
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def retire(self, block: Block) -> None:
        """``block`` freed by its tensor while streams passed to ``record_stream`` may still use it: CUDA's
        allocator counts it out of ``memory_allocated`` at once and keeps it from reuse until their work is done
        (``free(block, retired=True)`` then returns it to the pool)."""
        self.allocated -= block.size

    def free(self, block: Block, retired: bool = False) -> None:
        block.free = True
        block.segment.used -= block.size
        if not retired:
            self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._insert(block)

    def release_cached(self) -> int:
        """Release every fully free segment (``empty_cache``); the bytes released."""
        released = 0
        for key, pool in self._pools.items():
            keep = []
            for entry in pool:
                b = entry[2]
                if b.prev is None and b.next is None and b.size == b.segment.size:
                    released += b.size
                    self.segments -= 1
                else:
                    keep.append(entry)
            self._pools[key] = keep
        self.reserved -= released
        return released

    def _new_segment(self, size: int, stream: int, small: bool) -> Block:
        seg_size = segment_bytes(size)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            self.release_cached()
            over = self.reserved + seg_size - self.capacity
            if over > 0:
                self.failures += 1
                self.short_by = max(self.short_by, over)
        self._uid += 1
        segment = Segment(seg_size, stream, small, self._uid)
        self.reserved += seg_size
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(seg_size, 0, segment)

    def _insert(self, block: Block) -> None:
        self._uid += 1
        bisect.insort(
            self._pools.setdefault((block.segment.stream, block.segment.small), []), (block.size, id(block), block)
        )

    def _remove(self, block: Block) -> None:
        pool = self._pools[(block.segment.stream, block.segment.small)]
        i = bisect.bisect_left(pool, (block.size, id(block)))
        while pool[i][2] is not block:
            i += 1
        pool.pop(i)


def pinned_block_bytes(nbytes: int) -> int:
    """The pinned host block the caching host allocator hands out for ``nbytes``: the next power of two."""
    return 1 << max(0, (nbytes - 1).bit_length())


@dataclass
class HostAllocator:
    """Pinned host memory (the caching host allocator, modelled) and pageable host tensors of the trace."""

    pinned_reserved: int = 0  # bytes of pinned blocks ever made (cached, never returned)
    pinned_in_use: int = 0
    pageable: int = 0  # bytes of live pageable host tensors the trace made shape-only
    peak_pageable: int = 0
    peak_pinned_in_use: int = 0
    _free: dict = field(default_factory=dict)  # block size -> count of cached free blocks

    @property
    def peak(self) -> int:
        """The host's peak of traced memory: every pinned block made, plus the pageable tensors' peak."""
        return self.pinned_reserved + self.peak_pageable

    def malloc_pinned(self, nbytes: int) -> int:
        size = pinned_block_bytes(nbytes)
        if self._free.get(size, 0):
            self._free[size] -= 1
        else:
            self.pinned_reserved += size
        self.pinned_in_use += size
        self.peak_pinned_in_use = max(self.peak_pinned_in_use, self.pinned_in_use)
        return size

    def free_pinned(self, size: int) -> None:
        self.pinned_in_use -= size
        self._free[size] = self._free.get(size, 0) + 1

    def malloc_pageable(self, nbytes: int) -> int:
        self.pageable += nbytes
        self.peak_pageable = max(self.peak_pageable, self.pageable)
        return nbytes

    def free_pageable(self, nbytes: int) -> None:
        self.pageable -= nbytes
