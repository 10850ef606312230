"""What a traced step records, in the order the host issued it: kernels with their FLOPs and bytes, copies with
their bytes and stream, collectives with their bytes and group, event records and waits, host synchronisations,
device allocations and frees, and the values the trace had to stand in for (see :mod:`hf_fpdt.bench.trace`).

The FLOPs of a kernel are counted as the H100 kernel rates of ``gpu/README.md`` were measured: a matrix product
``2 * m * k * n``; an attention forward ``4 * B * H * Sq * Sk * D`` (half of it when causal over a square block)
and its backward 2.5 times that (five products against two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

aten = torch.ops.aten

GEMM, ATTENTION, MEMORY = "gemm", "attention", "memory"
PROGRESS_EVERY = 50000  # kernels between two progress lines of a long trace


@dataclass(slots=True)
class Kernel:
    """A kernel on ``stream``: ``kind`` (gemm, attention or memory-bound), FLOPs, bytes read and written."""

    name: str
    stream: int
    kind: str
    flops: float
    nbytes: int
    backend: str = ""  # an attention kernel's: cudnn, flash, cpu_flash (timed at that backend's rate)
    head_dim: int = 0


@dataclass(slots=True)
class Copy:
    """A copy between host and device (``H2D`` / ``D2H``) on ``stream``; ``pinned``: the host side is pinned;
    ``blocking``: the host waits for it (a pageable or a non-``non_blocking`` copy)."""

    direction: str
    stream: int
    nbytes: int
    pinned: bool
    blocking: bool


@dataclass(slots=True)
class Collective:
    """A collective over ``group_size`` ranks issued from ``stream``: ``op``, the bytes this rank sends;
    ``uid`` names it for its :class:`CollectiveWait` (``async_op=True``) or is waited at once (``blocking``)."""

    op: str
    stream: int
    nbytes: int
    group_size: int
    uid: int
    asynchronous: bool


@dataclass(slots=True)
class CollectiveWait:
    """``work.wait()`` of collective ``uid`` on ``stream`` (the stream waits for it; the host does not)."""

    uid: int
    stream: int


@dataclass(slots=True)
class Record:
    """``event.record(stream)``."""

    event: int
    stream: int


@dataclass(slots=True)
class Wait:
    """``stream.wait_event(event)`` (``event`` -1 with ``other``: ``stream.wait_stream(other)``)."""

    event: int
    stream: int
    other: int = -1


@dataclass(slots=True)
class Sync:
    """A host synchronisation: the host waits for ``stream`` (-1: every stream) or ``event``; ``kind`` says why."""

    kind: str
    stream: int = -1
    event: int = -1
    where: str = ""


@dataclass(slots=True)
class Alloc:
    """A device allocation (``nbytes`` asked, ``block`` handed out) or, with ``free``, its release."""

    nbytes: int
    block: int
    stream: int
    free: bool = False


@dataclass(slots=True)
class StandIn:
    """A value read from a shape-only tensor, answered by the trace (``value``) instead of computed."""

    kind: str
    value: str
    where: str


@dataclass
class EventLog:
    """The events of one traced step, in issue order."""

    events: list = field(default_factory=list)
    kernels: int = 0
    flops: float = 0.0
    on_kernels: Callable[[int], None] | None = None  # called every PROGRESS_EVERY kernels (a progress line)

    def add(self, event: object) -> None:
        self.events.append(event)
        if isinstance(event, Kernel):
            self.kernels += 1
            self.flops += event.flops
            if self.on_kernels is not None and self.kernels % PROGRESS_EVERY == 0:
                self.on_kernels(self.kernels)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def _shape(t: object) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


ATTENTION_OPS = {  # op -> (backend, backward?)
    "_scaled_dot_product_cudnn_attention": ("cudnn", False),
    "_scaled_dot_product_cudnn_attention_backward": ("cudnn", True),
    "_scaled_dot_product_flash_attention": ("flash", False),
    "_scaled_dot_product_flash_attention_backward": ("flash", True),
    # F.scaled_dot_product_attention on the traced device (a CPU tensor to C++) takes torch's CPU flash op: HF sdpa's
    # attention, timed at the rate of torch's default SDPA kernel on the GPU
    "_scaled_dot_product_flash_attention_for_cpu": ("sdpa", False),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("sdpa", True),
    "_scaled_dot_product_efficient_attention": ("flash", False),
    "_scaled_dot_product_efficient_attention_backward": ("flash", True),
}


def classify(func: object, args: tuple, kwargs: dict) -> tuple[str, float, str, int]:
    """(kind, FLOPs, attention backend, head dim) of one op on device tensors (see the module docstring)."""
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        sa, sb = _shape(a), _shape(b)
        batch = sa[0] if name in ("bmm", "baddbmm") else 1
        return GEMM, 2.0 * batch * sa[-2] * sa[-1] * sb[-1], "", 0
    if name in ATTENTION_OPS:
        backend, backward = ATTENTION_OPS[name]
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        b, h, sq, d = _shape(q)
        sk = _shape(k)[2]
        names = [a.name for a in func._schema.arguments]
        pos = names.index("is_causal")
        causal = bool(args[pos]) if len(args) > pos else bool(kwargs.get("is_causal", False))
        share = (sq * (sq + 1) / 2) / (sq * sk) if causal and sq == sk else 1.0
        flops = 4.0 * b * h * sq * sk * d * share * (2.5 if backward else 1.0)
        return ATTENTION, flops, backend, d
    return MEMORY, 0.0, "", 0


def tensor_bytes(values: object) -> int:
    """Bytes of the tensors in ``values`` (a flat list): numel x element size, as a kernel reads or writes them."""
    total = 0
    for t in values:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def fmt_where(frames: list[str]) -> str:
    return " < ".join(frames)


__all__ = [
    "ATTENTION",
    "GEMM",
    "MEMORY",
    "Alloc",
    "Collective",
    "CollectiveWait",
    "Copy",
    "EventLog",
    "Kernel",
    "Record",
    "StandIn",
    "Sync",
    "Wait",
    "classify",
    "tensor_bytes",
]
