"""A CUDA device made of shapes: what :mod:`hf_fpdt.bench.trace` runs a real training step on, on any CPU.

Inside ``with TraceDevice(log) as dev:`` a tensor made on ``cuda`` is a :class:`TraceTensor`: a wrapper that says
``device.type == "cuda"`` to Python and is a CPU tensor to C++ (so autograd runs on it), over a **meta** tensor
(shape, dtype, strides; no memory), or over a real CPU tensor where the values are small and may be read (token
ids, labels, positions, index tensors: at most :data:`REAL_LIMIT` elements, computed from inputs that are real;
a factory's result on the device at most :data:`FACTORY_LIMIT`).
Each op on device tensors is recorded in the :class:`~hf_fpdt.bench.trace_events.EventLog` on the current stream
(kernels with their FLOPs and bytes; views and ``empty`` are no kernels), each new device storage is an allocation
of the :class:`~hf_fpdt.bench.trace_alloc.DeviceAllocator` on the current stream and its free when its last tensor
goes (a storage passed to ``record_stream`` leaves ``memory_allocated`` at its free, as CUDA's allocator counts it,
and its block is reused once the other streams' work queued before the free is done: here at the next host
synchronisation or :data:`LAUNCH_QUEUE` kernels and copies later, whichever comes first). ``pin_memory=True`` and host
tensors over :data:`REAL_LIMIT` elements are host :class:`TraceTensor` (shape-only, counted by the
:class:`~hf_fpdt.bench.trace_alloc.HostAllocator`). Copies between host and device are :class:`Copy` events;
reading a value (``item``, ``tolist``, ``bool``), a blocking or pageable copy, a data-dependent shape and every
``synchronize`` is a :class:`Sync`. A value read from a shape-only tensor is answered with a stand-in (0, 0.0,
``False``, zeros) and recorded as a :class:`StandIn`.

``torch.cuda``'s runtime calls (availability, capability, properties, memory figures, streams, events, RNG state)
and ``torch.backends.cudnn``'s availability are patched for the context only, as the test suite's virtual device
does; the values a GPU would compute are never computed.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from ..memory import compat_torch
from .trace_alloc import DeviceAllocator, HostAllocator
from .trace_events import Alloc, Copy, EventLog, Kernel, StandIn, Sync, classify, tensor_bytes
from .trace_streams import TraceEvent, TraceStream, accelerator_patches, cuda_patches

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")
REAL_LIMIT = 1 << 22  # elements: a tensor this small, from real inputs, is computed (its values may be read)
FACTORY_LIMIT = 1 << 16  # elements: a device factory's result (arange, full) this small is real
_PACKAGE = "hf_fpdt"
# kernels and copies the host may issue ahead of the device before a launch blocks (CUDA's launch queue; assumed:
# the depth is not documented, about 1024 pending launches is what NVIDIA's developer forums report): a block freed
# after record_stream is reused at the latest this many ops after its free (the trace has no times; see _free)
LAUNCH_QUEUE = 1024
_ORIGINS = ("hf_fpdt/", "transformers/", "peft/")  # where an allocation at the peak is said to come from

_NO_KERNEL = {  # ops that allocate or describe, not compute
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset, aten.record_stream.default, aten._unsafe_view.default,
}  # fmt: skip
_DEVICE_ONLY = {  # CUDA's own kernels: no CPU kernel, so always shape-only
    getattr(aten, name).default for name in (
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    ) if hasattr(aten, name)
}  # fmt: skip
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.unique_dim.default, aten.argwhere.default,
}  # fmt: skip


def _where() -> str:
    """The innermost frames of the package (or the caller's) that led here, for a sync or a stand-in."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < 3:
        name = frame.f_code.co_filename
        if _PACKAGE in name and "/bench/trace" not in name:
            frames.append(f"{name.rsplit(_PACKAGE + '/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames)


def _origin() -> str:
    """The innermost frame of hf_fpdt (not its bench), transformers or peft that made an allocation, or
    ``autograd`` (a built-in op's backward, run by the engine with no Python frame of its own)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        for package in _ORIGINS:
            if package in name and "hf_fpdt/bench/" not in name:  # not the tracer or the bench that called it
                return f"{name.rsplit(package, 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "autograd"


class _Storage:
    """A traced storage: its bytes, where it lives, its allocator block, the streams it was recorded on."""

    __slots__ = ("__weakref__", "address", "block", "dev", "nbytes", "on_device", "pinned", "recorded", "stream")

    def __init__(self, dev: TraceDevice, nbytes: int, on_device: bool, pinned: bool) -> None:
        self.dev, self.nbytes, self.on_device, self.pinned = dev, nbytes, on_device, pinned
        self.stream, self.block, self.recorded = dev.current.sid, None, set()
        self.address = dev.next_address(nbytes)


class _StorageView:
    """A traced tensor's ``untyped_storage()``: its elem's storage (identity, size, holders) at a made-up address."""

    def __init__(self, storage: torch.UntypedStorage, address: int) -> None:
        self._storage, self._address = storage, address

    def data_ptr(self) -> int:
        return self._address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


class TraceTensor(torch.Tensor):
    """A traced tensor (see the module docstring): ``_elem`` meta or small and real, ``_store`` its storage."""

    _elem: torch.Tensor
    _store: _Storage

    @staticmethod
    def __new__(cls, elem: torch.Tensor, store: _Storage) -> TraceTensor:
        r = compat_torch.make_wrapper_subclass(cls, elem, CPU)
        r._elem, r._store = elem, store
        return r

    __torch_function__ = compat_torch.disabled_torch_function()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a traced tensor used outside its TraceDevice context")

    def __tensor_flatten__(self) -> tuple[list[str], _Storage]:
        return ["_elem"], self._store

    @staticmethod
    def __tensor_unflatten__(inner: dict, store: _Storage, outer_size: object, outer_stride: object) -> TraceTensor:
        return TraceTensor(inner["_elem"], store)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA if self._store.on_device else CPU

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return self._store.on_device

    def is_pinned(self, device: object = None) -> bool:
        return self._store.pinned

    def untyped_storage(self) -> _StorageView:
        return _StorageView(self._elem.untyped_storage(), self._store.address)

    def data_ptr(self) -> int:
        """A made-up address, distinct per storage (a meta tensor's is 0): code comparing pointers sees copies."""
        return self._store.address + self.storage_offset() * self.element_size()

    def record_stream(self, stream: object) -> None:
        if stream.sid != self._store.stream:
            self._store.recorded.add(stream.sid)

    def tolist(self) -> list:
        dev = self._store.dev
        if self._store.on_device:
            dev.sync("tolist")
        if self._elem.is_meta:
            dev.stand_in("tolist", "zeros")
            return torch.zeros(self._elem.shape, dtype=self._elem.dtype).tolist()
        return self._elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if self._elem.is_meta:
            raise TypeError("a shape-only traced tensor has no values")
        return self._elem.numpy()

    def __repr__(self, *, tensor_contents: object = None) -> str:
        return f"TraceTensor({tuple(self.shape)}, {self.dtype}, device='{self.device}')"


def _elems(x: Any, meta: bool) -> Any:
    if isinstance(x, TraceTensor):
        x = x._elem
    if meta and isinstance(x, torch.Tensor) and not x.is_meta:
        return x.to(META)
    return x


class _Dispatch(compat_torch.dispatch_mode_base()):
    def __init__(self, dev: TraceDevice) -> None:
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dev.dispatch(func, args, dict(kwargs or {}))


class _Functions(TorchFunctionMode):
    """The moves the dispatcher never sees as one op on a CPU build (``to``, ``cuda``, ``cpu``, ``torch.tensor``)."""

    def __init__(self, dev: TraceDevice) -> None:
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            return self.dev.to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return self.dev.move(args[0], CUDA, None, bool(kwargs.get("non_blocking", False)))
        if func is torch.Tensor.cpu:
            return self.dev.move(args[0], CPU, None, False)
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            kwargs.pop("device")
            requires_grad = bool(kwargs.pop("requires_grad", False))
            host = func(*args, **kwargs)
            out = self.dev.move(host, CUDA, None, False)
            return out.requires_grad_() if requires_grad else out
        return func(*args, **kwargs)


def _is_cuda(device: object) -> bool:
    return device is not None and not isinstance(device, torch.Tensor) and torch.device(device).type == "cuda"


class TraceDevice:
    """The shape-only CUDA device, a context manager (see the module docstring).

    Args:
        log: where the events go.
        total_memory: the device's bytes (what ``get_device_properties`` and the allocator's capacity say).
        capability: ``get_device_capability``; ``cudnn_version``: ``torch.backends.cudnn.version()``.
        name: ``get_device_name``.
    """

    def __init__(
        self, log: EventLog, *, total_memory: int, capability: tuple[int, int] = (9, 0), cudnn_version: int = 91002,
        name: str = "traced CUDA device",
    ) -> None:  # fmt: skip
        self.log, self.total_memory, self.capability = log, total_memory, capability
        self.cudnn_version, self.name = cudnn_version, name
        self.allocator = DeviceAllocator(capacity=total_memory)
        self.host = HostAllocator()
        self.syncs = 0
        self.stand_ins = 0
        self._streams = 0
        self._events = 0
        self._deferred: list = []  # blocks freed after record_stream, held from reuse (see _free), oldest first
        self._ops = 0  # kernels and copies issued so far
        self.Stream = type("Stream", (TraceStream,), {"_dev": self})
        self.Event = type("Event", (TraceEvent,), {"_dev": self})
        self.default = self.Stream()
        self.current = self.default
        self._address = 1 << 56  # made-up addresses of traced storages (far from the host's own)
        self._moving = 0  # inside move(): a _to_copy's device is the caller's
        self._stores: dict = {}  # storage key -> weak reference to its _Storage
        self._exit = contextlib.ExitStack()
        self._open = False
        self._op = "parameter or buffer"  # the op being dispatched (what a new storage is said to hold)
        self._live: dict = {}  # id(block) -> (bytes, op dtype shape, origin) of every device storage alive
        self._snapped = 0  # allocated bytes at the last snapshot of the live storages
        self.peak_live: list = []  # the live storages at the allocated peak, as _live's values

    # ------------------------------------------------------------------ context
    def __enter__(self) -> TraceDevice:
        stack = self._exit
        for name, value in cuda_patches(self).items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=not hasattr(torch.cuda, name)))
        for name, value in accelerator_patches(self).items():
            if hasattr(torch.accelerator, name):
                stack.enter_context(mock.patch.object(torch.accelerator, name, value))
        stack.enter_context(mock.patch.object(torch.backends.cudnn, "is_available", lambda: True))
        stack.enter_context(mock.patch.object(torch.backends.cudnn, "version", lambda: self.cudnn_version))
        stack.enter_context(_Dispatch(self))
        stack.enter_context(_Functions(self))
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._open = False
        self._exit.close()

    def empty_cache(self) -> None:
        self.allocator.release_cached()

    def set_stream(self, stream: TraceStream) -> None:
        self.current = stream

    @contextlib.contextmanager
    def stream_context(self, stream: TraceStream | None):
        if stream is None:
            yield None
            return
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    def new_stream(self) -> int:
        self._streams += 1
        return self._streams - 1

    def next_address(self, nbytes: int) -> int:
        address = self._address
        self._address += 512 * (1 + nbytes // 512)
        return address

    def new_event(self) -> int:
        self._events += 1
        return self._events - 1

    def peak_holders(self, n: int = 12) -> list[tuple[int, int, str, str]]:
        """The device storages alive at the allocated peak, grouped by what made them (op, dtype, shape) and where
        (:func:`_origin`): the ``n`` largest groups as ``(bytes, count, what, where)``."""
        groups: dict = {}
        for size, what, where in self.peak_live:
            total, count = groups.get((what, where), (0, 0))
            groups[(what, where)] = (total + size, count + 1)
        ranked = sorted(((b, c, w, o) for (w, o), (b, c) in groups.items()), key=lambda g: -g[0])
        return ranked[:n]

    # ------------------------------------------------------------------ syncs and stand-ins
    def sync(self, kind: str, stream: int = -1, event: int = -1) -> None:
        """The host waits (``stream`` -1 and ``event`` -1: for every stream)."""
        self.syncs += 1
        if (
            kind.endswith("copy") or kind.startswith("data-dependent") or kind in ("item()", "tolist", "bool()")
        ) and event < 0:
            stream = self.current.sid if stream < 0 else stream
        self.log.add(Sync(kind, stream, event, _where()))
        deferred, self._deferred = self._deferred, []
        for entry in deferred:
            self._release(entry[:3], retired=True)

    def stand_in(self, kind: str, value: str) -> None:
        self.stand_ins += 1
        self.log.add(StandIn(kind, value, _where()))

    # ------------------------------------------------------------------ storages
    def wrap(self, elem: torch.Tensor, on_device: bool, pinned: bool = False) -> TraceTensor:
        """A traced tensor over ``elem``; a new storage is an allocation (device, pinned or pageable host)."""
        key = compat_torch.storage_key(elem)
        ref = self._stores.get(key)
        store = ref() if ref is not None else None
        if store is None:
            nbytes = elem.untyped_storage().nbytes()
            store = _Storage(self, nbytes, on_device, pinned)
            if on_device:
                self._reuse_retired()
                store.block = self.allocator.malloc(nbytes, store.stream)
                self.log.add(Alloc(nbytes, store.block.size, store.stream))
                shape = "x".join(map(str, elem.shape))
                self._live[id(store.block)] = (store.block.size, f"{self._op} {elem.dtype} [{shape}]", _origin())
                allocated = self.allocator.allocated
                if allocated > self._snapped and allocated == self.allocator.peak_allocated:  # a new peak: its holders
                    self._snapped = allocated
                    self.peak_live = list(self._live.values())
            elif pinned:
                store.block = self.host.malloc_pinned(nbytes)
            else:
                store.block = self.host.malloc_pageable(nbytes)
            self._stores[key] = weakref.ref(store)
            weakref.finalize(store, self._free, store.nbytes, store.on_device, store.pinned, store.block, key,
                             store.stream, store.recorded)  # fmt: skip
        return TraceTensor(elem, store)

    def _free(
        self, nbytes: int, on_device: bool, pinned: bool, block: Any, key: int, stream: int, recorded: set
    ) -> None:
        if self._stores.get(key) is not None and self._stores[key]() is None:
            del self._stores[key]
        if not self._open:
            return  # after the context (the model let go later): the step's figures are final
        if on_device:
            if recorded:  # out of memory_allocated now (as CUDA's allocator counts it), reusable later
                self._live.pop(id(block), None)
                self.log.add(Alloc(nbytes, block.size, stream, free=True))
                self.allocator.retire(block)
                self._deferred.append((block, nbytes, stream, self._ops))
                return
            self._release((block, nbytes, stream))
        elif pinned:
            self.host.free_pinned(block)
        else:
            self.host.free_pageable(block)

    def _release(self, entry: tuple, retired: bool = False) -> None:
        block, nbytes, stream = entry
        if not retired:  # the block's own size: the allocator's free merges it with its free neighbours
            self._live.pop(id(block), None)
            self.log.add(Alloc(nbytes, block.size, stream, free=True))
        self.allocator.free(block, retired)

    def _reuse_retired(self) -> None:
        """Return to the pool the retired blocks whose streams have run the work queued before their free: at the
        latest when :data:`LAUNCH_QUEUE` more kernels and copies were issued (the host cannot run further ahead)."""
        while self._deferred and self._deferred[0][3] + LAUNCH_QUEUE <= self._ops:
            self._release(self._deferred.pop(0)[:3], retired=True)

    # ------------------------------------------------------------------ ops
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        self._op = func.__name__
        if func is aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func is aten.is_pinned.default:
            return isinstance(args[0], TraceTensor) and args[0]._store.pinned
        if func is aten._pin_memory.default:
            return self._to_host(args[0], pinned=True)
        if func is aten.copy_.default:
            return self._copy(args[0], args[1], bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        if func is aten._to_copy.default:
            return self._to_copy(args[0], **kwargs)
        leaves = tree_leaves((args, kwargs))
        traced = [x for x in leaves if isinstance(x, TraceTensor)]
        device_kw = kwargs.get("device")
        to_cuda = _is_cuda(device_kw)
        pin = bool(kwargs.pop("pin_memory", False) or False)
        if not traced and not to_cuda:
            host_factory = device_kw is None or torch.device(device_kw).type == "cpu"
            if not pin and host_factory and not any(isinstance(x, torch.Tensor) for x in leaves):
                meta = func(*args, **{**kwargs, "device": META}) if _has_device(func) else None
                if meta is None or _numel(meta) <= REAL_LIMIT:
                    return func(*args, **kwargs)
                return tree_map(lambda t: self.wrap(t, False) if isinstance(t, torch.Tensor) else t, meta)
            if not pin:
                return func(*args, **kwargs)
        on_device = to_cuda or any(t._store.on_device for t in traced)
        if device_kw is not None:
            kwargs["device"] = CPU
        meta = func in _DEVICE_ONLY or any(isinstance(x, torch.Tensor) and _elems(x, False).is_meta for x in leaves)
        if not meta:  # all real: computed only when the result is small
            try:
                probe = func(*tree_map(lambda x: _elems(x, True), args), **tree_map(lambda x: _elems(x, True), kwargs))
                made = not any(isinstance(x, torch.Tensor) for x in leaves)  # a factory: only small ones are real
                meta = _numel(probe) > (FACTORY_LIMIT if made else REAL_LIMIT)
            except (NotImplementedError, RuntimeError):
                meta = False
        if func in _DATA_DEPENDENT:
            if on_device:
                self.sync(f"data-dependent shape ({func.__name__.split('.')[0]})")
            if meta:
                self.stand_in(func.__name__, "an empty result")
                empty = torch.empty((0, max(1, _elems(args[0], True).dim())), dtype=torch.long, device=META)
                return self.wrap(empty, on_device)
        if meta and "device" in kwargs:
            kwargs["device"] = META
        flat, spec = tree_flatten((args, kwargs))
        inner_args, inner_kwargs = tree_unflatten([_elems(x, meta) for x in flat], spec)
        out = func(*inner_args, **inner_kwargs)
        if on_device and func not in _NO_KERNEL and not _is_view(func):
            kind, flops, backend, head_dim = classify(func, args, kwargs)
            nbytes = tensor_bytes(traced) + tensor_bytes(tree_leaves(out))
            self.log.add(Kernel(str(func), self.current.sid, kind, flops, nbytes, backend, head_dim))
            self._ops += 1
        wrapped = tree_map(lambda t: self.wrap(t, on_device, pin) if isinstance(t, torch.Tensor) else t, out)
        return compat_torch.correct_aliasing(func, args, kwargs, wrapped)

    def _scalar(self, t: torch.Tensor) -> Any:
        if isinstance(t, TraceTensor) and t._store.on_device:
            self.sync("item()")
        elem = t._elem if isinstance(t, TraceTensor) else t
        if elem.is_meta:
            value = False if elem.dtype == torch.bool else 0.0 if elem.dtype.is_floating_point else 0
            self.stand_in("item()", repr(value))
            return value
        return elem.item()

    def _to_host(self, t: torch.Tensor, pinned: bool) -> torch.Tensor:
        elem = t._elem if isinstance(t, TraceTensor) else t
        meta = elem.is_meta or elem.numel() > REAL_LIMIT
        host = torch.empty_like(elem, device=META if meta else CPU, memory_format=torch.contiguous_format)
        if not meta:
            host.copy_(elem)
        return self.wrap(host, False, pinned)

    # ------------------------------------------------------------------ copies
    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        d_dev = isinstance(dst, TraceTensor) and dst._store.on_device
        s_dev = isinstance(src, TraceTensor) and src._store.on_device
        d, s = _elems(dst, False), _elems(src, False)
        if not d.is_meta:
            if s.is_meta:
                pass  # a real tensor over-written by shape-only values: kept as it was (documented)
            else:
                d.copy_(s)
        nbytes = dst.numel() * dst.element_size()
        self._ops += d_dev or s_dev
        if d_dev and s_dev:
            self.log.add(Kernel("aten.copy_", self.current.sid, "memory", 0.0, 2 * nbytes))
        elif d_dev or s_dev:
            host = src if d_dev else dst
            pinned = isinstance(host, TraceTensor) and host._store.pinned
            blocking = not (pinned and non_blocking)
            direction = "H2D" if d_dev else "D2H"
            self.log.add(Copy(direction, self.current.sid, nbytes, pinned, blocking))
            if blocking:  # cudaMemcpy (or a pageable buffer staged by the host): the host waits for the stream
                self.sync(f"{'blocking' if pinned else 'pageable'} {direction} copy")
        return dst

    def _to_copy(self, t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self._op = "_to_copy"
        device = kwargs.pop("device", None)
        if not self._moving and isinstance(t, TraceTensor):
            device = None  # from C++ (an autograd formula's options()): the wrapper's C++ device is the CPU
        non_blocking = bool(kwargs.pop("non_blocking", False))
        dtype = kwargs.pop("dtype", None) or t.dtype
        pin = bool(kwargs.pop("pin_memory", False))
        memory_format = kwargs.pop("memory_format", None)
        src_dev = isinstance(t, TraceTensor) and t._store.on_device
        target_dev = src_dev if device is None else torch.device(device).type == "cuda"
        elem = _elems(t, False)
        if target_dev == src_dev:
            out = aten._to_copy.default(elem, dtype=dtype, memory_format=memory_format)
            if src_dev:
                self.log.add(Kernel("aten._to_copy", self.current.sid, "memory", 0.0,
                                    elem.numel() * (elem.element_size() + out.element_size())))  # fmt: skip
                return self.wrap(out, True)
            if isinstance(t, TraceTensor) or out.numel() > REAL_LIMIT or pin:
                return self.wrap(out, False, pin)
            return out
        fmt = torch.preserve_format if memory_format is None else memory_format
        big = elem.is_meta or elem.numel() > REAL_LIMIT
        empty = torch.empty_like(elem, dtype=dtype, memory_format=fmt, device=META if big else CPU)
        dst = self.wrap(empty, target_dev, pinned=not target_dev and (pin or non_blocking))
        return self._copy(dst, t, non_blocking)

    def to(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("copy", None)
        if args and isinstance(args[0], torch.Tensor):
            other, rest = args[0], args[1:]
            return self.move(t, other.device, other.dtype, bool(rest[0] if rest else kwargs.get("non_blocking", 0)))
        if len(args) > 3 and not isinstance(args[0], torch.dtype):
            args = args[:3]
        elif len(args) > 2 and isinstance(args[0], torch.dtype):
            args = args[:2]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        return self.move(t, device, dtype, bool(non_blocking), memory_format)

    def move(self, t: torch.Tensor, device: object, dtype: torch.dtype | None, non_blocking: bool,
             memory_format: object = None) -> torch.Tensor:  # fmt: skip
        target = t.device if device is None else torch.device(device)
        on_device = isinstance(t, TraceTensor) and t._store.on_device
        same_place = (target.type == "cuda") == on_device
        if same_place and (dtype is None or dtype == t.dtype) and memory_format in (None, torch.preserve_format):
            return t
        kwargs = {"dtype": dtype or t.dtype, "non_blocking": non_blocking}
        if memory_format is not None:
            kwargs["memory_format"] = memory_format
        if not same_place:
            kwargs["device"] = target
        self._moving += 1
        try:
            return aten._to_copy.default(t, **kwargs)
        finally:
            self._moving -= 1


def _has_device(func) -> bool:
    return any(a.name == "device" for a in func._schema.arguments)


def _numel(out: Any) -> int:
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
