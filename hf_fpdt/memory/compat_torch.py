"""torch's private names the memory tiers use, in one place, each with what happens where it is missing.

``torch._C._storage_Use_Count``: how many holders a storage has (every tensor and view over it, a detached copy, a
tensor autograd saved). The staging ring (:mod:`hf_fpdt.memory.staging`) overwrites a device buffer only when it
is the buffer's sole holder; no public call answers that (a weak reference to the tensor handed out does not:
a view taken under ``inference_mode`` or a ``detach()`` outlives it). Where the name is missing,
:func:`storage_use_count` returns ``None`` and the host store fetches into fresh buffers as before the ring
(``record_stream``; unbounded when the host runs ahead, never wrong). ``tests/unit/test_offload.py`` checks it in
the installed torch.
"""

from __future__ import annotations

import torch


def storage_use_count(t: torch.Tensor) -> int | None:
    """The holders of ``t``'s storage (``None``: this torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


__all__ = ["storage_use_count"]
