"""Mixed precision: the dtypes ``sdpa`` computes in under ``torch.autocast``, given to every fpdt path.

``torch.nn.functional.scaled_dot_product_attention`` is on autocast's lower-precision list on CPU and
CUDA alike: under ``torch.autocast(device, dtype=bf16 | fp16)`` it casts ``q, k, v`` (floating tensors
other than float64) to the autocast dtype and returns its output in that dtype. Mixed inputs are the
common case, not an edge: HF's RoPE multiplies the projection's autocast output by float32 tables, so
``q, k`` arrive in float32 and ``v`` in bf16. fpdt casts the same way at its entries (the registered
attention function, each chunk of the chunked projection) and runs its block kernels and merges with
autocast off: the kernels' float32 accumulation (``math``, merge, ``dq`` sums) stays float32 instead of
being cast down matmul by matmul, as sdpa's fused kernels accumulate in float32 too.

Nothing here hard-codes a device or dtype: both come from the tensors and autocast's current state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype sdpa computes in under the autocast now enabled for ``device_type``; None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def sdpa_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast as autocast casts sdpa's inputs (floating, not float64, to the autocast dtype).

    Outside autocast they come back unchanged. The cast is differentiable: gradients reach the inputs
    in their own dtype, as through sdpa.
    """
    dtype = autocast_dtype(tensors[0].device.type)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


@contextlib.contextmanager
def no_autocast(device_type: str) -> Iterator[None]:
    """Run the body with autocast off for ``device_type`` (a no-op where it is off already)."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def sdpa_precision(fn: Callable) -> Callable:
    """Wrap an HF attention function ``fn(module, query, key, value, ...)`` with sdpa's autocast semantics:
    ``query, key, value`` cast as :func:`sdpa_inputs`, the body run with autocast off (its output is then
    in the compute dtype, as sdpa's)."""

    @functools.wraps(fn)
    def wrapper(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        device_type = query.device.type
        if not torch.is_autocast_enabled(device_type):
            return fn(module, query, key, value, *args, **kwargs)
        query, key, value = sdpa_inputs(query, key, value)
        with torch.autocast(device_type, enabled=False):
            return fn(module, query, key, value, *args, **kwargs)

    return wrapper
