"""A virtual CUDA device for the test suite: the package's CUDA code paths (copy streams, events, pinned buffers,
``record_stream``, the CUDA memory statistics) run on a machine without a GPU, under a checker of CUDA's ordering rules.

Inside ``with VirtualCuda() as vdev:`` (the ``virtual_cuda`` fixture of ``tests/conftest.py``):

* **values**: a tensor made "on cuda" (``torch.empty/zeros/ones/full/randn/arange/tensor(..., device="cuda")``,
  ``.to("cuda")``, ``.cuda()``, ``.to(t.device)``) is a :class:`VirtualTensor`: a ``torch.Tensor`` wrapper subclass
  (``_make_wrapper_subclass``) over a real CPU tensor, so every number is computed on the CPU. It says
  ``device.type == "cuda"`` and ``is_cuda`` to Python; to C++ it is a CPU tensor (no CUDA device guard, stream or
  driver is ever touched, so the autograd engine runs on it too, on both torch's CUDA and CPU builds). Views share
  the CPU storage (``x[1:3].add_(1)`` changes ``x``); ``untyped_storage()`` and ``data_ptr()`` are the CPU
  tensor's. ``torch.empty(..., pin_memory=True)`` and ``.pin_memory()`` give plain CPU tensors that
  ``.is_pinned()`` (the device keeps a weak registry of pinned storages). An op mixing a virtual tensor with a
  plain CPU tensor of one or more dimensions fails as CUDA does (``Expected all tensors to be on the same device``),
  except the copies between them and CPU indices; tensors torch's C++ code builds inside a composite op (sdpa's
  masks) are not plain CPU tensors in that sense.
* **the CUDA runtime API**: ``torch.cuda.is_available`` (True), ``device_count`` (1), ``get_device_capability``
  (settable, default (9, 0)), ``get_device_properties``, ``get_device_name``, ``mem_get_info``, ``memory_allocated``,
  ``max_memory_allocated``, ``memory_reserved``, ``memory_stats``, ``reset_peak_memory_stats``, ``Stream``,
  ``Event``, ``current_stream``, ``default_stream``, ``stream``, ``set_stream``, ``synchronize``, ``_sleep`` and the
  ``torch.accelerator`` ones are patched (``unittest.mock.patch``) for the context only, and restored after (the
  ``is_*_available`` caches of transformers and accelerate are cleared on entry and exit).
* **streams and a happens-before checker** (the rules of ``torch.cuda._sanitizer``, CSAN): every op on a virtual
  tensor is queued on the current stream with the storages it reads and writes (schema: ``Tensor(a!)`` arguments
  and fresh outputs are writes, other tensor arguments reads, views neither; ``copy_`` writes ``dst``, reads
  ``src``). Each stream keeps a vector clock: ``record_event`` snapshots it, ``wait_event``/``wait_stream`` join it,
  a host synchronisation joins the host's. A stream's access to a storage last written (or, for a write, read) by
  another stream that it is not ordered after is a race. Copies with ``non_blocking=True`` between pinned memory and
  the device are queued on the stream with the host buffer: an op of the host on that buffer before the copy is
  ordered with the host (``Event.synchronize``, ``Event.query()`` True, ``Stream.synchronize``,
  ``torch.cuda.synchronize``) is a race too. A device storage freed (its last tensor gone) after another stream
  than the one it was allocated on used it, with neither that stream ordered before the allocating stream, the host
  synchronised with it, nor ``record_stream`` covering it, is "freed while in use". Each :class:`Race` keeps both
  accesses with their stacks; the context raises :class:`VirtualCudaError` at exit when any was found (``check``),
  and ``vdev.races`` lists them.
* **device progress**: kernels are computed when queued, but *complete* only as the model says: with
  ``host_lead=None`` (the default) only when the host synchronises with them (the host infinitely far ahead); with
  ``host_lead=n`` once ``n`` later kernels were queued (the host ``n`` kernels ahead). ``Event.query`` answers from
  it, and so does the allocator: the memory of a tensor freed after ``record_stream(s)`` stays counted in
  ``memory_allocated`` (the bytes the allocator cannot hand out) until ``s``'s work queued by the free completes.
* **host syncs**: ``vdev.syncs`` lists every host synchronisation (:class:`Sync`: kind and a short stack):
  ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()``, ``.cpu()`` and blocking copies, copies from or to
  pageable memory, ``torch.tensor(..., device="cuda")``, data-dependent shapes (``nonzero``, ``unique``, boolean
  indexing, ``masked_select``...), ``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize``.

Enough for a training step: ``nn.Module.to("cuda")``, HF models patched by hf_fpdt with offload and checkpointing,
backward, AdamW (foreach and fused) run on it (``tests/unit/test_virtual_offload.py``). What it does not model: kernel
durations (``elapsed_time`` counts queued kernels, 1 us each; ``host_lead`` is in kernels); the caching allocator's
blocks and rounding (``memory_reserved`` is ``memory_allocated``); CUDA-only kernels (torch's efficient attention
op, flash-attn, CUDA graphs, and by default torch's flash and cuDNN attention ops: "Could not run ... with arguments
from the 'CPU' backend", so hf_fpdt's backend probe falls back to ``math``; ``VirtualCuda(kernels=True)`` answers
those two op pairs with ``tests/standins.py``'s references and reports cuDNN 9, so ``cudnn`` and ``torch_flash``
run); ``torch.autocast("cuda")`` is the host's autocast beside CUDA's flags (virtual tensors carry the CPU's
dispatch keys: the CPU's op lists decide what is cast, close to CUDA's but not equal); CUDA's RNG
(``torch.Generator("cuda")`` and ``torch.cuda.get_rng_state`` are the CPU's);
several devices or threads (the current stream is the context's); ``resize_`` through an ``out=`` (an error).
Races are found per storage: two streams writing disjoint slices of one storage count as one. Tensors torch's C++
builds from a virtual tensor's options inside a composite op (sdpa's masks) are CPU tensors the same-device check lets
through. ``torch.save`` of a virtual tensor saves its CPU numbers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import sysconfig
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
HOST = "host"  # the host, as the accessor of a pinned buffer
GIB = 1 << 30
SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_STDLIB = sysconfig.get_paths()["stdlib"]
_SKIPPED = (_TORCH_DIR, str(Path(__file__).resolve()), "/_pytest/", "/pytest/", "/pluggy/")

# Ops whose output shape depends on the values: on CUDA the host waits for the device to learn it.
_DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero",
    aten.argwhere.default: "argwhere",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.equal.default: "equal",
}
_CPU_ARGS_ALLOWED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def tree_leaves(x: Any) -> list:
    """The leaves of an op's arguments or results: tuples, lists and dicts of tensors and scalars (all aten passes;
    faster than ``torch.utils._pytree``'s, which this runs on every op)."""
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in tree_leaves(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in tree_leaves(item)]
    return [x]


def tree_map(fn: Callable, x: Any) -> Any:
    """``fn`` over the leaves of :func:`tree_leaves`, the containers rebuilt (tuples as tuples, lists as lists)."""
    if isinstance(x, tuple):
        return tuple(tree_map(fn, item) for item in x)
    if isinstance(x, list):
        return [tree_map(fn, item) for item in x]
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


@functools.cache
def _shown(filename: str) -> bool:
    """A frame of ``filename`` is shown in a stack: not torch, this module, the standard library or pytest."""
    stdlib = filename.startswith(_STDLIB) and "-packages" not in filename
    return not filename.startswith("<") and not stdlib and not any(s in filename for s in _SKIPPED)


def _stack(limit: int = 8) -> tuple[str, ...]:
    """The caller's frames outside torch, this module, the standard library and pytest: ``path:line in function``."""
    out: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(out) < limit:
        code = frame.f_code
        if _shown(code.co_filename):
            out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return tuple(out)


def _clear_availability_caches() -> None:
    """transformers and accelerate cache their ``is_*_available`` answers: one asked inside the context (CUDA
    available) must not outlive it."""
    for name in ("transformers.utils.import_utils", "accelerate.utils.imports"):
        module = sys.modules.get(name)
        for attr in dir(module) if module is not None else ():
            clear = getattr(getattr(module, attr), "cache_clear", None) if attr.startswith("is_") else None
            if clear is not None:
                clear()


def _key(t: torch.Tensor) -> int:
    """A storage's identity (its ``StorageImpl``): views share it."""
    return t.untyped_storage()._cdata


def _join(into: dict, other: dict) -> None:
    for stream, seq in other.items():
        if into.get(stream, 0) < seq:
            into[stream] = seq


@dataclass(frozen=True)
class Access:
    """One use of a storage: by a stream (its id) or the host, the stream's sequence number, the op, its stack."""

    stream: int | str
    seq: int
    op: str
    write: bool
    stack: tuple[str, ...]

    def describe(self) -> str:
        who = "the host" if self.stream == HOST else f"stream {self.stream}"
        head = f"{'write' if self.write else 'read'} by {who} ({self.op}, kernel {self.seq})"
        return "\n".join([head, *(f"      {line}" for line in self.stack)])


@dataclass(frozen=True)
class Race:
    """Two accesses of one storage without a happens-before ordering (or a free while another stream used it)."""

    kind: str  # "read after write", "write after read", "write after write", "freed while in use"
    storage: str
    first: Access
    second: Access

    def __str__(self) -> str:
        return f"{self.kind} on {self.storage}:\n  first: {self.first.describe()}\n  then:  {self.second.describe()}"


@dataclass(frozen=True)
class Sync:
    """One host synchronisation: what caused it and where."""

    kind: str
    stack: tuple[str, ...]


class VirtualCudaError(AssertionError):
    """Races found on the virtual device (raised when its context exits)."""


@dataclass(eq=False)
class _Uses:
    """The accesses of one storage since its last write (CSAN's per-tensor state)."""

    label: str
    write: Access | None = None
    reads: dict = field(default_factory=dict)  # stream -> last read since the write
    last: dict = field(default_factory=dict)  # stream -> its last access (the free check)


@dataclass(eq=False)
class _Storage:
    """A device storage: its bytes, the stream it was allocated on, the streams passed to ``record_stream``."""

    key: int
    nbytes: int
    stream: int
    uses: _Uses
    recorded: set = field(default_factory=set)


class _Holder:
    """Held by every virtual tensor over one storage; its finalizer is the storage's free."""

    __slots__ = ("__weakref__", "storage", "vdev")

    def __init__(self, storage: _Storage, vdev: VirtualCuda) -> None:
        self.storage, self.vdev = storage, vdev


class VirtualTensor(torch.Tensor):
    """A tensor on the virtual CUDA device: a wrapper over the CPU tensor ``_elem`` that holds its numbers."""

    _elem: torch.Tensor
    _holder: _Holder

    @staticmethod
    def __new__(cls, elem: torch.Tensor, holder: _Holder) -> VirtualTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=CPU, requires_grad=False,
        )  # fmt: skip
        r._elem, r._holder = elem, holder
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a virtual CUDA tensor used outside its VirtualCuda context")

    # A traceable wrapper subclass: ``nn.Module.to("cuda")`` swaps the virtual tensors into its parameters
    # (``torch.utils.swap_tensors``) instead of setting ``.data``, which a wrapper cannot carry.
    def __tensor_flatten__(self) -> tuple[list[str], _Holder]:
        return ["_elem"], self._holder

    @staticmethod
    def __tensor_unflatten__(inner: dict, holder: _Holder, outer_size: object, outer_stride: object) -> VirtualTensor:
        return VirtualTensor(inner["_elem"], holder)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:
        return CUDA.index

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._elem.untyped_storage()

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def is_pinned(self, device: object = None) -> bool:
        return False

    def record_stream(self, stream: VirtualStream) -> None:
        self._holder.vdev._record_stream(self, stream)

    def tolist(self) -> list:
        vdev = self._holder.vdev
        vdev._launch_reads("tolist", [self])
        vdev._sync("tolist")
        return self._elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
            "first."
        )

    def _scalar(self, kind: str, convert: Callable) -> Any:
        with self._holder.vdev._sync_kind(kind):
            return convert(self)

    def item(self) -> Any:
        return self._scalar("item()", torch.Tensor.item)

    def __bool__(self) -> bool:
        return self._scalar("bool()", torch.Tensor.__bool__)

    def __int__(self) -> int:
        return self._scalar("int()", torch.Tensor.__int__)

    def __float__(self) -> float:
        return self._scalar("float()", torch.Tensor.__float__)

    def __index__(self) -> int:
        return self._scalar("index", torch.Tensor.__index__)

    def __repr__(self, *, tensor_contents: object = None) -> str:
        return f"VirtualTensor({self._elem!r}, device='cuda:0')"

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        out = self.detach().clone().requires_grad_(self.requires_grad)  # a copy on the device
        if getattr(self, "_is_param", False):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: int) -> Any:
        self._holder.vdev._launch_reads("pickle", [self])
        self._holder.vdev._sync("pickle (torch.save)")
        return self._elem.clone().__reduce_ex__(protocol)  # saved as its CPU numbers: a load gives a CPU tensor


class VirtualStream:
    """A stream of the virtual device (``torch.cuda.Stream`` inside the context)."""

    _vdev: VirtualCuda  # set on the per-context subclass

    def __init__(self, device: object = None, priority: int = 0, **_: object) -> None:
        self.stream_id = self._vdev._new_stream()
        self.priority = priority
        self.device = CUDA

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def wait_event(self, event: VirtualEvent) -> None:
        if event.clock is not None:
            _join(self._vdev._clocks[self.stream_id], event.clock)

    def wait_stream(self, stream: VirtualStream) -> None:
        _join(self._vdev._clocks[self.stream_id], self._vdev._clocks[stream.stream_id])

    def record_event(self, event: VirtualEvent | None = None) -> VirtualEvent:
        event = event if event is not None else self._vdev.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return self._vdev._query(self._vdev._clocks[self.stream_id])

    def synchronize(self) -> None:
        self._vdev._sync("Stream.synchronize", self._vdev._clocks[self.stream_id])

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> VirtualStream:
        self._previous = self._vdev._current
        self._vdev._current = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._vdev._current = self._previous

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VirtualStream) and other.stream_id == self.stream_id and other._vdev is self._vdev

    def __hash__(self) -> int:
        return hash((id(self._vdev), self.stream_id))

    def __repr__(self) -> str:
        return f"<virtual torch.cuda.Stream {self.stream_id} on cuda:0>"


class VirtualEvent:
    """An event of the virtual device (``torch.cuda.Event`` inside the context): a snapshot of a stream's clock."""

    _vdev: VirtualCuda

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.clock: dict | None = None
        self.at = 0  # kernels queued (all streams) when recorded: elapsed_time's clock

    def record(self, stream: VirtualStream | None = None) -> None:
        stream = stream if stream is not None else self._vdev._current
        self.clock = dict(self._vdev._clocks[stream.stream_id])
        self.at = self._vdev.launches

    def wait(self, stream: VirtualStream | None = None) -> None:
        (stream if stream is not None else self._vdev._current).wait_event(self)

    def query(self) -> bool:
        return self.clock is None or self._vdev._query(self.clock)

    def synchronize(self) -> None:
        if self.clock is not None:
            self._vdev._sync("Event.synchronize", self.clock)

    def elapsed_time(self, end: VirtualEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.clock is None or end.clock is None or not (self._vdev._done_by(self.clock) and end.query()):
            raise RuntimeError("CUDA error: device not ready (elapsed_time of an event that has not completed)")
        return (end.at - self.at) * 1e-3

    def __repr__(self) -> str:
        return f"<virtual torch.cuda.Event {self.clock}>"


class _GeneratorMeta(type(torch._C.Generator)):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch._C.Generator)


class VirtualGenerator(torch._C.Generator, metaclass=_GeneratorMeta):
    """``torch.Generator`` inside the context: a CPU generator when asked for one on ``cuda``."""

    def __new__(cls, device: object = "cpu") -> torch._C.Generator:
        if torch.device(device).type == "cuda":
            return super().__new__(cls, "cpu")
        return torch._C.Generator(device)

    def __init__(self, device: object = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA


class _Dispatch(TorchDispatchMode):
    def __init__(self, vdev: VirtualCuda) -> None:
        super().__init__()
        self.vdev = vdev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.vdev._dispatch(func, args, dict(kwargs or {}))


_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.tril_indices,
    torch.triu_indices, torch.scalar_tensor,
}  # fmt: skip


class _Functions(TorchFunctionMode):
    """The calls the dispatcher never sees as one op: moves (``to``, ``cuda``, ``cpu``), ``torch.tensor``."""

    def __init__(self, vdev: VirtualCuda) -> None:
        super().__init__()
        self.vdev = vdev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        vdev = self.vdev
        if func is torch.Tensor.to:
            return vdev._to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return vdev._move(args[0], CUDA, None, bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else 0)))
        if func is torch.Tensor.cpu:
            return vdev._move(args[0], CPU, None, False)
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            return vdev._tensor(func, args, kwargs)
        if func is torch.Tensor.new_tensor and isinstance(args[0], VirtualTensor) and kwargs.get("device") is None:
            kwargs.setdefault("dtype", args[0].dtype)
            return vdev._tensor(torch.tensor, args[1:], {**kwargs, "device": CUDA})
        if func in _FACTORIES:  # a factory the caller asked for: a CPU result is a host tensor (see _dispatch)
            with vdev._explicit():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _autocast_enter(real: Callable) -> Callable:
    """``torch.autocast("cuda")`` entered with the host's autocast beside it: virtual tensors carry the CPU's dispatch
    keys, so the CPU's autocast casts their ops (its op lists, close to CUDA's: matmuls and linear layers in the low
    dtype) while code asking ``torch.is_autocast_enabled("cuda")`` sees CUDA's."""

    def enter(ac: torch.autocast) -> torch.autocast:
        out = real(ac)
        if ac.device == "cuda":
            host = torch.autocast("cpu", dtype=ac.fast_dtype, enabled=ac._enabled, cache_enabled=ac._cache_enabled)
            ac.__dict__["_virtual_host"] = host
            real(host)
        return out

    return enter


def _autocast_exit(real: Callable) -> Callable:
    def exit_(ac: torch.autocast, *exc: object) -> object:
        host = ac.__dict__.pop("_virtual_host", None)
        if host is not None:
            real(host, *exc)
        return real(ac, *exc)

    return exit_


def _unwrap(x: Any) -> Any:
    return x._elem if isinstance(x, VirtualTensor) else x


def _is_cuda(device: object) -> bool:
    return device is not None and not isinstance(device, torch.Tensor) and torch.device(device).type == "cuda"


class VirtualCuda:
    """The virtual CUDA device, a context manager (see the module docstring).

    Args:
        capability: what ``torch.cuda.get_device_capability`` answers (settable later too).
        total_memory: the device's bytes (``get_device_properties``, ``mem_get_info``).
        host_lead: kernels the device trails the host by (``None``: work completes only at host synchronisations).
        check: raise :class:`VirtualCudaError` at exit when races were found.
        kernels: answer torch's CUDA-only attention ops (``aten._scaled_dot_product_cudnn_attention(_backward)``,
            ``aten._scaled_dot_product_flash_attention(_backward)``) on virtual tensors with the references of
            ``tests/standins.py`` (the real ops' argument order, output shapes, strides, dtypes and LSE layouts,
            computed in float64, returned in the inputs' dtype), and report cuDNN ``cudnn_version``
            (``torch.backends.cudnn.is_available`` / ``version``), so the ``cudnn`` and ``torch_flash`` routes
            resolve, probe and run on the device. Off: those ops fail as on any CPU, and the routes fall back.
        cudnn_version: what ``torch.backends.cudnn.version()`` answers with ``kernels``.
    """

    def __init__(
        self, *, capability: tuple[int, int] = (9, 0), total_memory: int = 80 * GIB, host_lead: int | None = None,
        check: bool = True, kernels: bool = False, cudnn_version: int = 91002,
    ) -> None:  # fmt: skip
        self.capability = capability
        self.kernels = kernels
        self.cudnn_version = cudnn_version
        self._references: dict = {}
        if kernels:
            from standins import ATEN_REFERENCES  # tests/ is on sys.path, as for this module

            self._references = dict(ATEN_REFERENCES)
        self.total_memory = total_memory
        self.host_lead = host_lead
        self.check = check
        self.races: list[Race] = []
        self.syncs: list[Sync] = []
        self.launches = 0  # kernels queued, all streams
        self.allocations = 0  # device storages made
        self._streams = 0
        self._clocks: dict[int, dict] = {}
        self._host: dict = {}  # per stream: its kernels the host knows have completed
        self._done: dict = {}  # per stream: its kernels completed on the device
        self._queued: deque = deque()  # (clock) of kernels not yet completed, oldest first (host_lead)
        self._holders: dict[int, weakref.ref] = {}  # device storage key -> its holder
        self._finalizers: dict[int, weakref.finalize] = {}
        self._hosted: dict[int, tuple[StorageWeakRef, _Uses]] = {}  # pinned storages a stream used
        self._pinned: dict[int, StorageWeakRef] = {}
        self._neutral: dict[int, StorageWeakRef] = {}  # CPU tensors torch made inside a composite op
        self._explicit_depth = 0
        self._kind: str | None = None
        self._live = 0  # bytes of live device storages
        self._pending: list = []  # (bytes, {stream: seq}): freed after record_stream, not yet reusable
        self._peak = 0
        self._labels = 0
        self._open = False
        self.Stream = type("Stream", (VirtualStream,), {"_vdev": self})
        self.Event = type("Event", (VirtualEvent,), {"_vdev": self})
        self._default = self.Stream()
        self._current = self._default
        self._exit = contextlib.ExitStack()

    # ----------------------------------------------------------------- context
    def __enter__(self) -> VirtualCuda:
        stack = self._exit
        cuda = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "device": lambda device=None: contextlib.nullcontext(),
            "get_device_capability": lambda device=None: tuple(self.capability),
            "get_device_name": lambda device=None: "Virtual CUDA device (CPU)",
            "get_device_properties": lambda device=None: self._properties(),
            "is_bf16_supported": lambda including_emulation=True: True,
            "mem_get_info": lambda device=None: (self.total_memory - self.memory_allocated(), self.total_memory),
            "memory_allocated": lambda device=None: self.memory_allocated(),
            "max_memory_allocated": lambda device=None: self.max_memory_allocated(),
            "memory_reserved": lambda device=None: self.memory_allocated(),
            "max_memory_reserved": lambda device=None: self.max_memory_allocated(),
            "memory_stats": lambda device=None: self._stats(),
            "reset_peak_memory_stats": lambda device=None: self.reset_peak_memory_stats(),
            "reset_max_memory_allocated": lambda device=None: self.reset_peak_memory_stats(),
            "empty_cache": lambda: None,
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "get_rng_state": lambda device="cuda": torch.get_rng_state(),  # the device's numbers come from the CPU's
            "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
            "is_current_stream_capturing": lambda: False,
            "Stream": self.Stream,
            "Event": self.Event,
            "current_stream": lambda device=None: self._current,
            "default_stream": lambda device=None: self._default,
            "set_stream": self._set_stream,
            "stream": self._stream_context,
            "synchronize": lambda device=None: self.synchronize("torch.cuda.synchronize"),
            "_sleep": lambda cycles: self._launch_reads("_sleep", []),
        }
        for name, value in cuda.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=not hasattr(torch.cuda, name)))
        accelerator = {
            "is_available": lambda: True,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "device_count": lambda: 1,
            "current_device_index": lambda: 0,
            "current_stream": lambda device=None: self._current,
            "set_stream": self._set_stream,
            "synchronize": lambda device=None: self.synchronize("torch.accelerator.synchronize"),
            "empty_host_cache": lambda: None,
        }
        for name, value in accelerator.items():
            if hasattr(torch.accelerator, name):
                stack.enter_context(mock.patch.object(torch.accelerator, name, value))
        if self.kernels:
            stack.enter_context(mock.patch.object(torch.backends.cudnn, "is_available", lambda: True))
            stack.enter_context(mock.patch.object(torch.backends.cudnn, "version", lambda: self.cudnn_version))
        stack.enter_context(mock.patch.object(torch, "Generator", VirtualGenerator))
        autocast = torch.amp.autocast_mode.autocast
        stack.enter_context(mock.patch.object(autocast, "__enter__", _autocast_enter(autocast.__enter__)))
        stack.enter_context(mock.patch.object(autocast, "__exit__", _autocast_exit(autocast.__exit__)))
        stack.enter_context(_Dispatch(self))
        stack.enter_context(_Functions(self))
        stack.callback(_clear_availability_caches)
        _clear_availability_caches()
        self._open = True
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._open = False
        self._exit.close()
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()
        if self.check and self.races and exc_type is None:
            raise VirtualCudaError(self.report())

    def report(self, limit: int = 5) -> str:
        """The races found (the first ``limit``), with both accesses' stacks."""
        head = f"{len(self.races)} race(s) on the virtual CUDA device"
        return "\n\n".join([head, *(str(r) for r in self.races[:limit])])

    # ----------------------------------------------------------------- public figures
    @property
    def sync_count(self) -> int:
        return len(self.syncs)

    def memory_allocated(self) -> int:
        """Bytes the allocator cannot hand out: live device storages, and freed ones a recorded stream still uses."""
        self._reclaim()
        return self._live + sum(nbytes for nbytes, _ in self._pending)

    def max_memory_allocated(self) -> int:
        return max(self._peak, self.memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        self._peak = self.memory_allocated()

    def synchronize(self, kind: str = "torch.cuda.synchronize") -> None:
        """The host waits for every stream."""
        clock: dict = {}
        for c in self._clocks.values():
            _join(clock, c)
        self._sync(kind, clock)

    @property
    def current_stream(self) -> VirtualStream:
        return self._current

    def _properties(self) -> SimpleNamespace:
        major, minor = self.capability
        return SimpleNamespace(
            name="Virtual CUDA device (CPU)", major=major, minor=minor, total_memory=self.total_memory,
            multi_processor_count=132, L2_cache_size=50 << 20, is_integrated=False, uuid="virtual",
        )  # fmt: skip

    def _stats(self) -> dict:
        now = self.memory_allocated()
        return {
            "allocated_bytes.all.current": now, "allocated_bytes.all.peak": self.max_memory_allocated(),
            "reserved_bytes.all.current": now, "reserved_bytes.all.peak": self.max_memory_allocated(),
            "num_alloc_retries": 0, "num_ooms": 0, "allocation.all.allocated": self.allocations,
        }  # fmt: skip

    # ----------------------------------------------------------------- streams and clocks
    def _new_stream(self) -> int:
        sid = self._streams
        self._streams += 1
        self._clocks[sid] = {sid: 0}
        return sid

    def _set_stream(self, stream: VirtualStream) -> None:
        self._current = stream

    @contextlib.contextmanager
    def _stream_context(self, stream: VirtualStream | None) -> Iterator[VirtualStream | None]:
        if stream is None:
            yield None
            return
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def _done_by(self, clock: dict) -> bool:
        return all(self._done.get(s, 0) >= seq for s, seq in clock.items())

    def _query(self, clock: dict) -> bool:
        """Whether the work of ``clock`` has completed; if so the host knows it (``query()`` answered True)."""
        if not self._done_by(clock):
            return False
        _join(self._host, clock)
        return True

    def _sync(self, kind: str, clock: dict | None = None) -> None:
        """A host synchronisation: the host waits for ``clock`` (the current stream's by default)."""
        clock = self._clocks[self._current.stream_id] if clock is None else clock
        self.syncs.append(Sync(kind, _stack()))
        _join(self._done, clock)
        _join(self._host, clock)

    @contextlib.contextmanager
    def _sync_kind(self, kind: str) -> Iterator[None]:
        previous, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = previous

    @contextlib.contextmanager
    def _explicit(self) -> Iterator[None]:
        self._explicit_depth += 1
        try:
            yield
        finally:
            self._explicit_depth -= 1

    def _tick(self) -> tuple[int, int]:
        """Queue a kernel on the current stream: (stream, its sequence number)."""
        sid = self._current.stream_id
        clock = self._clocks[sid]
        clock[sid] += 1
        self.launches += 1
        if self.host_lead is not None:
            self._queued.append(dict(clock))
            while len(self._queued) > self.host_lead:
                _join(self._done, self._queued.popleft())
        return sid, clock[sid]

    # ----------------------------------------------------------------- accesses and races
    def _ordered(self, prior: Access, by: int | str) -> bool:
        if prior.stream == by or prior.stream == HOST:  # a stream runs in order; the host's past precedes all work
            return True
        known = self._host if by == HOST else self._clocks[by]
        return known.get(prior.stream, 0) >= prior.seq

    def _access(self, uses: _Uses, access: Access) -> None:
        """Check ``access`` against the storage's earlier ones (CSAN's rules), then record it."""
        by = access.stream
        if uses.write is not None and not self._ordered(uses.write, by):
            kind = "write after write" if access.write else "read after write"
            self._race(kind, uses.label, uses.write, access)
        if access.write:
            for prior in uses.reads.values():
                if not self._ordered(prior, by):
                    self._race("write after read", uses.label, prior, access)
            uses.write = access
            uses.reads = {}
        else:
            uses.reads[by] = access
        uses.last[by] = access

    def _race(self, kind: str, storage: str, first: Access, second: Access) -> None:
        self.races.append(Race(kind, storage, first, second))

    def _label(self, what: str, nbytes: int) -> str:
        self._labels += 1
        return f"{what} storage #{self._labels} ({nbytes} bytes)"

    def _host_uses(self, t: torch.Tensor, create: bool) -> _Uses | None:
        """The accesses of a CPU tensor's storage that streams used (pinned buffers of async copies)."""
        key = _key(t)
        entry = self._hosted.get(key)
        if entry is not None and entry[0].expired():
            del self._hosted[key]
            entry = None
        if entry is None:
            if not create:
                return None
            storage = t.untyped_storage()
            entry = (StorageWeakRef(storage), _Uses(self._label("pinned host", storage.nbytes())))
            self._hosted[key] = entry
        return entry[1]

    # ----------------------------------------------------------------- device storages
    def _holder_for(self, elem: torch.Tensor) -> tuple[_Holder, bool]:
        """The holder of ``elem``'s storage, made (an allocation on the current stream) when new."""
        key = _key(elem)
        ref = self._holders.get(key)
        holder = ref() if ref is not None else None
        if holder is not None:
            return holder, False
        nbytes = elem.untyped_storage().nbytes()
        storage = _Storage(key, nbytes, self._current.stream_id, _Uses(self._label("device", nbytes)))
        holder = _Holder(storage, self)
        self._holders[key] = weakref.ref(holder)
        self._finalizers[key] = weakref.finalize(holder, self._free, storage)
        self.allocations += 1
        self._live += nbytes
        self._peak = max(self._peak, self.memory_allocated())
        return holder, True

    def _wrap(self, elem: torch.Tensor) -> tuple[VirtualTensor, bool]:
        holder, fresh = self._holder_for(elem)
        return VirtualTensor(elem, holder), fresh

    def _free(self, storage: _Storage) -> None:
        if not self._open:
            return
        self._holders.pop(storage.key, None)
        self._finalizers.pop(storage.key, None)
        self._live -= storage.nbytes
        alloc = storage.stream
        for other, use in storage.uses.last.items():
            if other in (alloc, HOST) or other in storage.recorded:
                continue
            if self._clocks[alloc].get(other, 0) < use.seq and self._host.get(other, 0) < use.seq:
                free = Access(alloc, self._clocks[alloc][alloc], "free (its last tensor dropped)", True, _stack())
                self._race("freed while in use", storage.uses.label, use, free)
        if storage.recorded:
            self._pending.append((storage.nbytes, {s: self._clocks[s][s] for s in storage.recorded}))

    def _reclaim(self) -> None:
        self._pending = [(n, c) for n, c in self._pending if not self._done_by(c)]

    def _record_stream(self, t: VirtualTensor, stream: VirtualStream) -> None:
        storage = t._holder.storage
        if stream.stream_id != storage.stream:
            storage.recorded.add(stream.stream_id)

    # ----------------------------------------------------------------- ops
    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self._pin(args[0])
        if func is aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return self._copy(args[0], args[1], bool(non_blocking))
        if func is aten._to_copy.default:
            return self._to_copy(args[0], **kwargs)
        leaves = tree_leaves((args, kwargs))
        virtual = any(isinstance(x, VirtualTensor) for x in leaves)
        to_cuda = _is_cuda(kwargs.get("device"))
        pin = bool(kwargs.get("pin_memory"))
        if pin:
            kwargs["pin_memory"] = False
        if not virtual and not to_cuda:
            self._host_op(func, args, kwargs)
            out = func(*args, **kwargs)
            if pin:
                self._mark_pinned(out)
            elif not self._explicit_depth and not any(isinstance(x, torch.Tensor) for x in leaves):
                self._mark_neutral(out)  # made inside a composite op from some tensor's options
            return out
        self._same_device(func, leaves)
        if to_cuda:
            kwargs["device"] = CPU
        kind = _DATA_DEPENDENT.get(func)
        if kind is None and func in (aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                kind = "boolean mask index"
        run = self._references.get(func, func)  # a CUDA-only kernel: its reference on the CPU numbers (kernels=True)
        out = run(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is aten._local_scalar_dense.default:
            self._launch(func, args, kwargs, ())
            self._sync(self._kind or "item()")
            return out
        wrapped = self._launch(func, args, kwargs, out)
        if kind is not None:
            self._sync(f"data-dependent shape ({kind})")
        result = return_and_correct_aliasing(func, args, kwargs, wrapped)
        for t in tree_leaves(result):
            if isinstance(t, VirtualTensor) and t.shape != t._elem.shape:
                raise NotImplementedError(
                    f"{func} resized a virtual tensor ({tuple(t.shape)} -> {tuple(t._elem.shape)}, an out= of another "
                    "shape): not modelled; pass an out= of the result's shape"
                )
        return result

    def _same_device(self, func, leaves: list) -> None:
        if func in _CPU_ARGS_ALLOWED:
            return
        for x in leaves:
            if isinstance(x, torch.Tensor) and not isinstance(x, VirtualTensor) and x.dim() > 0:
                if not self._is_neutral(x):
                    raise RuntimeError(f"{SAME_DEVICE} (when checking arguments for {func})")

    def _launch(self, func, args: tuple, kwargs: dict, out: Any) -> Any:
        """Queue ``func`` on the current stream: wrap its CPU outputs, check and record its accesses."""
        sid, seq = self._tick()
        stack = _stack()
        name = str(func)
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            info = arg.alias_info
            if info is not None and not info.is_write:
                continue  # a view: metadata only
            write = info is not None and info.is_write
            for t in tree_leaves(value):
                if isinstance(t, VirtualTensor):
                    self._access(t._holder.storage.uses, Access(sid, seq, name, write, stack))

        def wrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, VirtualTensor):
                return x
            v, fresh = self._wrap(x)
            if fresh or not any(r.alias_info is not None for r in schema.returns):
                self._access(v._holder.storage.uses, Access(sid, seq, name, True, stack))
            return v

        return tree_map(wrap, out)

    def _launch_reads(self, op: str, tensors: list) -> None:
        sid, seq = self._tick()
        stack = _stack()
        for t in tensors:
            self._access(t._holder.storage.uses, Access(sid, seq, op, False, stack))

    def _host_op(self, func, args: tuple, kwargs: dict) -> None:
        """An op of the host on CPU tensors: checked against the streams' use of pinned buffers."""
        if not self._hosted:
            return
        schema = func._schema
        stack = None
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            info = arg.alias_info
            if info is not None and not info.is_write:
                continue
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    uses = self._host_uses(t, create=False)
                    if uses is not None:
                        stack = stack or _stack()
                        write = info is not None and info.is_write
                        self._access(uses, Access(HOST, 0, str(func), write, stack))

    # ----------------------------------------------------------------- pinned memory
    def _mark_pinned(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._pinned[_key(t)] = StorageWeakRef(t.untyped_storage())

    def _is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, VirtualTensor):
            return False
        ref = self._pinned.get(_key(t))
        return ref is not None and not ref.expired()

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, VirtualTensor):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        out.copy_(t)
        self._host_op(aten.clone.default, (t,), {})
        self._mark_pinned(out)
        return out

    def _mark_neutral(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._neutral[_key(t)] = StorageWeakRef(t.untyped_storage())

    def _is_neutral(self, t: torch.Tensor) -> bool:
        ref = self._neutral.get(_key(t))
        return ref is not None and not ref.expired()

    # ----------------------------------------------------------------- copies
    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """``dst.copy_(src)`` between any of device, pinned and pageable memory (see the module docstring)."""
        on_device = isinstance(dst, VirtualTensor), isinstance(src, VirtualTensor)
        if not any(on_device):
            self._host_op(aten.copy_.default, (dst, src), {})
            return dst.copy_(src, non_blocking=non_blocking)
        d, s = (x._elem if isinstance(x, VirtualTensor) else x for x in (dst, src))
        d.copy_(s)
        sid, seq = self._tick()
        stack = _stack()
        op = "copy_" + ("" if all(on_device) else " (H2D)" if on_device[0] else " (D2H)")
        if on_device[1]:
            self._access(src._holder.storage.uses, Access(sid, seq, op, False, stack))
        if on_device[0]:
            self._access(dst._holder.storage.uses, Access(sid, seq, op, True, stack))
        if all(on_device):
            return dst
        host = src if on_device[0] else dst
        pinned = self._is_pinned(host)
        # the stream reads (H2D) or writes (D2H) the host buffer; a pinned one is tracked: the host must wait for
        # an asynchronous copy before using it
        uses = self._host_uses(host, create=pinned)
        if uses is not None:
            self._access(uses, Access(sid, seq, op, on_device[1], stack))
        if not (pinned and non_blocking):
            which = "H2D" if on_device[0] else "D2H"
            self._sync(self._kind or f"{'blocking' if pinned else 'pageable'} {which} copy")
        return dst

    def _to_copy(self, t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        device = kwargs.pop("device", None)
        non_blocking = bool(kwargs.pop("non_blocking", False))
        dtype = kwargs.pop("dtype", None) or t.dtype
        memory_format = kwargs.pop("memory_format", None)
        pin = bool(kwargs.pop("pin_memory", False))
        target = t.device if device is None else torch.device(device)
        src_virtual = isinstance(t, VirtualTensor)
        if src_virtual and target.type != "cuda" and not self._explicit_depth:
            # not a move the program asked for (those come through _move): C++ naming the device it sees for a
            # virtual tensor, the host; autograd's backward of a dtype cast does (ToCopyBackward: grad.to(options))
            target = CUDA
        if target.type == "cuda" and src_virtual:  # a dtype change on the device: one kernel
            out = aten._to_copy.default(t._elem, dtype=dtype, memory_format=memory_format)
            return self._launch(aten._to_copy.default, (t,), {}, out)
        if target.type != "cuda" and not src_virtual:
            self._host_op(aten._to_copy.default, (t,), {})
            out = aten._to_copy.default(t, dtype=dtype, memory_format=memory_format)
            if pin:
                self._mark_pinned(out)
            return out
        elem = t._elem if src_virtual else t
        fmt = torch.preserve_format if memory_format is None else memory_format
        host = torch.empty_like(elem, dtype=dtype, memory_format=fmt)
        if target.type == "cuda":
            dst, _ = self._wrap(host)
            return self._copy(dst, t, non_blocking)
        if pin or non_blocking:  # torch pins the destination of a non-blocking copy to the host
            self._mark_pinned(host)
        return self._copy(host, t, non_blocking)

    # ----------------------------------------------------------------- function-level calls
    def _to(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = bool(kwargs.pop("copy", False))
        if args and isinstance(args[0], torch.Tensor):
            other, rest = args[0], args[1:]
            device, dtype = other.device, other.dtype
            non_blocking = bool(rest[0] if rest else kwargs.get("non_blocking", False))
            copy = copy or bool(rest[1] if len(rest) > 1 else False)
            memory_format = None
        else:
            if len(args) > 3 and not isinstance(args[0], torch.dtype):  # to(device, dtype, non_blocking, copy)
                copy, args = copy or bool(args[3]), args[:3]
            elif len(args) > 2 and isinstance(args[0], torch.dtype):  # to(dtype, non_blocking, copy)
                copy, args = copy or bool(args[2]), args[:2]
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        return self._move(t, device, dtype, bool(non_blocking), copy, memory_format)

    def _move(
        self, t: torch.Tensor, device: object, dtype: torch.dtype | None, non_blocking: bool, copy: bool = False,
        memory_format: torch.memory_format | None = None,
    ) -> torch.Tensor:  # fmt: skip
        target = t.device if device is None else torch.device(device)
        same_place = (target.type == "cuda") == isinstance(t, VirtualTensor)
        same_format = memory_format in (None, torch.preserve_format)
        if same_place and not copy and (dtype is None or dtype == t.dtype) and same_format:
            return t
        kwargs = {"dtype": dtype or t.dtype, "non_blocking": non_blocking}
        if memory_format is not None:
            kwargs["memory_format"] = memory_format
        if not same_place:
            kwargs["device"] = target
        with self._explicit():
            return aten._to_copy.default(t, **kwargs)

    def _tensor(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        requires_grad = bool(kwargs.pop("requires_grad", False))
        kwargs.pop("device")
        if func is torch.as_tensor and args and isinstance(args[0], torch.Tensor):
            return self._move(args[0], CUDA, kwargs.get("dtype"), False)
        with self._explicit():
            host = func(*args, **kwargs)
        with self._sync_kind("torch.tensor(..., device=cuda)"):
            out = aten._to_copy.default(host, device=CUDA)
        return out.requires_grad_() if requires_grad else out
