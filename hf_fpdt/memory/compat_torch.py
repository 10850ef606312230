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

__all__ = ["SDPA_NAMES", "SDPA_OPS", "SdpaOps", "storage_use_count"]
