"""The streams, events and runtime calls of the traced CUDA device (:mod:`hf_fpdt.bench.trace_device`): what
``torch.cuda`` and ``torch.accelerator`` answer inside its context. Streams and events order nothing here: they are
recorded (:class:`~hf_fpdt.bench.trace_events.Record`, :class:`~hf_fpdt.bench.trace_events.Wait`) for the timeline.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch

from .trace_events import Record, Wait

TraceDevice = Any  # hf_fpdt.bench.trace_device.TraceDevice (not imported: that module imports this one)

CUDA = torch.device("cuda", 0)


class TraceStream:
    """``torch.cuda.Stream`` inside the context."""

    _dev: TraceDevice

    def __init__(self, device: object = None, priority: int = 0, **_: object) -> None:
        self.sid = self._dev.new_stream()
        self.priority, self.device = priority, CUDA

    @property
    def cuda_stream(self) -> int:
        return self.sid

    def wait_event(self, event: TraceEvent) -> None:
        if event.uid >= 0:
            self._dev.log.add(Wait(event.uid, self.sid))

    def wait_stream(self, stream: TraceStream) -> None:
        if stream.sid != self.sid:
            self._dev.log.add(Wait(-1, self.sid, stream.sid))

    def record_event(self, event: TraceEvent | None = None) -> TraceEvent:
        event = event if event is not None else self._dev.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        self._dev.sync("Stream.synchronize", stream=self.sid)

    def __enter__(self) -> TraceStream:
        self._previous, self._dev.current = self._dev.current, self
        return self

    def __exit__(self, *exc: object) -> None:
        self._dev.current = self._previous

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TraceStream) and other.sid == self.sid

    def __hash__(self) -> int:
        return hash(self.sid)


class TraceEvent:
    """``torch.cuda.Event`` inside the context."""

    _dev: TraceDevice

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.uid = -1

    def record(self, stream: TraceStream | None = None) -> None:
        stream = stream if stream is not None else self._dev.current
        self.uid = self._dev.new_event()
        self._dev.log.add(Record(self.uid, stream.sid))

    def wait(self, stream: TraceStream | None = None) -> None:
        (stream if stream is not None else self._dev.current).wait_event(self)

    def query(self) -> bool:
        return True  # the trace does not time: an event asked about is taken as done (no host wait)

    def synchronize(self) -> None:
        if self.uid >= 0:
            self._dev.sync("Event.synchronize", event=self.uid)

    def elapsed_time(self, end: TraceEvent) -> float:
        return 0.0


def cuda_patches(dev: TraceDevice) -> dict:
    """``torch.cuda``'s names as the traced device answers them."""
    return {
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": lambda: None,
        "device_count": lambda: 1, "current_device": lambda: 0, "set_device": lambda device: None,
        "device": lambda device=None: contextlib.nullcontext(),
        "get_device_capability": lambda device=None: tuple(dev.capability),
        "get_device_name": lambda device=None: dev.name,
        "get_device_properties": lambda device=None: _properties(dev),
        "is_bf16_supported": lambda including_emulation=True: True,
        "mem_get_info": lambda device=None: (dev.total_memory - dev.allocator.reserved, dev.total_memory),
        "memory_allocated": lambda device=None: dev.allocator.allocated,
        "max_memory_allocated": lambda device=None: dev.allocator.peak_allocated,
        "memory_reserved": lambda device=None: dev.allocator.reserved,
        "max_memory_reserved": lambda device=None: dev.allocator.peak_reserved,
        "memory_stats": lambda device=None: _stats(dev), "reset_peak_memory_stats": lambda device=None: None,
        "reset_max_memory_allocated": lambda device=None: None, "empty_cache": dev.empty_cache,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": None, "is_current_stream_capturing": lambda: False,
        "Stream": dev.Stream, "Event": dev.Event, "current_stream": lambda device=None: dev.current,
        "default_stream": lambda device=None: dev.default, "set_stream": dev.set_stream,
        "stream": dev.stream_context, "synchronize": lambda device=None: dev.sync("torch.cuda.synchronize"),
    }  # fmt: skip


def accelerator_patches(dev: TraceDevice) -> dict:
    """``torch.accelerator``'s names as the traced device answers them."""
    return {
        "is_available": lambda: True, "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: 1, "current_device_index": lambda: 0,
        "current_stream": lambda device=None: dev.current, "set_stream": dev.set_stream,
        "synchronize": lambda device=None: dev.sync("torch.accelerator.synchronize"),
    }  # fmt: skip


def _properties(dev: TraceDevice) -> SimpleNamespace:
    major, minor = dev.capability
    return SimpleNamespace(
        name=dev.name, major=major, minor=minor, total_memory=dev.total_memory, multi_processor_count=132,
        L2_cache_size=50 << 20, is_integrated=False, uuid="traced",
    )  # fmt: skip


def _stats(dev: TraceDevice) -> dict:
    a = dev.allocator
    return {
        "allocated_bytes.all.current": a.allocated, "allocated_bytes.all.peak": a.peak_allocated,
        "reserved_bytes.all.current": a.reserved, "reserved_bytes.all.peak": a.peak_reserved,
        "num_alloc_retries": 0, "num_ooms": a.failures,
    }  # fmt: skip
