"""torch's private names hf_fpdt uses, in one place, each with what happens where it is missing (the distributed
timeouts' are :mod:`hf_fpdt.distributed.timeouts`: a public call replaces them from torch 2.14).

``torch._C._storage_Use_Count``: how many holders a storage has (every tensor and view over it, a detached copy, a
tensor autograd saved). The staging ring (:mod:`hf_fpdt.memory.staging`) overwrites a device buffer only when it
is the buffer's sole holder; no public call answers that (a weak reference to the tensor handed out does not:
a view taken under ``inference_mode`` or a ``detach()`` outlives it). Where the name is missing,
:func:`storage_use_count` returns ``None`` and the host store fetches into fresh buffers as before the ring
(``record_stream``; unbounded when the host runs ahead, never wrong). ``tests/unit/test_offload.py`` checks it in
the installed torch.

``torch.ops.aten._scaled_dot_product_*``: the fused attention kernels behind ``F.scaled_dot_product_attention``
that return the log-sum-exp and take a supplied final ``(out, lse)`` in backward, which the block kernels need
(:mod:`hf_fpdt.attention.kernels`, :mod:`hf_fpdt.attention.cudnn_blocks`, generation's masked blocks): the CPU flash
kernel, CUDA's flash kernel and cuDNN's, each forward and backward (:data:`SDPA_OPS`; ``None`` where this torch has
none: that backend is then not chosen). The block kernels pass their arguments by position:
``tests/unit/test_compat_torch.py`` checks each op's positional parameter names in the installed torch against the
ones the calls fill (the same on torch 2.9.0, 2.13.0 and 2.14.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def storage_use_count(t: torch.Tensor) -> int | None:
    """The holders of ``t``'s storage (``None``: this torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


@dataclass(frozen=True)
class SdpaOps:
    """torch's private attention ops the block kernels call (``None`` where this torch lacks one)."""

    cpu_flash: object | None
    cpu_flash_backward: object | None
    flash: object | None
    flash_backward: object | None
    cudnn: object | None
    cudnn_backward: object | None


SDPA_NAMES = {  # SdpaOps field -> the aten op
    "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu",
    "cpu_flash_backward": "_scaled_dot_product_flash_attention_for_cpu_backward",
    "flash": "_scaled_dot_product_flash_attention",
    "flash_backward": "_scaled_dot_product_flash_attention_backward",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "cudnn_backward": "_scaled_dot_product_cudnn_attention_backward",
}
SDPA_OPS = SdpaOps(**{field: getattr(torch.ops.aten, name, None) for field, name in SDPA_NAMES.items()})


# ----------------------------------------------------------------------------- the traced step's device
# hf_fpdt.bench.trace runs a training step on a device that exists only as shapes (tensors that say "cuda" to Python
# over meta tensors). It needs torch's wrapper-subclass and dispatch-mode machinery and a fake process group; all of
# it is private in torch. tests/unit/test_compat_torch.py checks each name in the installed torch.


def make_wrapper_subclass(cls: type, elem: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A ``cls`` tensor with ``elem``'s size, strides, dtype and layout that reports ``device`` to C++ and holds no
    storage of its own (``torch.Tensor._make_wrapper_subclass``)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
        layout=elem.layout, device=device, requires_grad=False,
    )  # fmt: skip


def disabled_torch_function() -> object:
    """The ``__torch_function__`` that opts a tensor subclass out of torch-function handling."""
    return torch._C._disabled_torch_function_impl


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: the base of a mode that sees every aten op (``torch.utils._python_dispatch``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def correct_aliasing(func: object, args: tuple, kwargs: dict, out: object) -> object:
    """``return_and_correct_aliasing``: a wrapper subclass's in-place and view results made to alias as the op's
    schema says (an in-place op returns its argument)."""
    from torch.utils._python_dispatch import return_and_correct_aliasing

    return return_and_correct_aliasing(func, args, kwargs, out)


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its ``StorageImpl``; views share it)."""
    return t.untyped_storage()._cdata


def fake_store() -> object:
    """A store for ``init_process_group("fake", ...)``: a process group of any size inside one process, whose
    collectives do nothing (``torch.testing._internal.distributed.fake_pg``, which also registers the backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


__all__ = [
    "SDPA_NAMES",
    "SDPA_OPS",
    "SdpaOps",
    "correct_aliasing",
    "disabled_torch_function",
    "dispatch_mode_base",
    "fake_store",
    "make_wrapper_subclass",
    "storage_key",
    "storage_use_count",
]
