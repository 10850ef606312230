"""The ``cpu_flash`` block kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (a
blockwise kernel that handles GQA itself), for the CPU.

A masked block (a bool keep or a :class:`~hf_fpdt.attention.block_keep.BlockKeep`; no softcap, which the op has not)
runs a slice of query rows at a time with the slice's additive mask (at most ``scores_bytes`` of mask each: the op
forms no scores of its own beyond its internal tiles); rows are independent, so the slices' ``out`` and ``lse`` side
by side are the block's, and no mask of the whole block is formed.
"""

from __future__ import annotations

import torch

from ..memory.compat_torch import SDPA_OPS
from .block_keep import mask_rows
from .block_kernel import DeviceCapability, Kernel, lse_dtype
from .math_blocks import math_scores_bytes


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[n, Sk]`` / ``[B, n, Sk]`` -> additive ``[1 | B, 1, n, Sk]`` in ``dtype`` (the op's form)."""
    m = mask if mask.dim() == 3 else mask.unsqueeze(0)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf")).unsqueeze(1)


def _mask_rows_per_slice(q: torch.Tensor, sk: int, scores_bytes: int | None) -> int:
    """Query rows per slice of a masked ``cpu_flash`` block: the slice's additive mask ``[B, 1, rows, Sk]`` in ``q``'s
    dtype fits ``scores_bytes`` (default :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes`, the ``math``
    kernel's bound; the op forms no scores of its own beyond its internal tiles), at least one row."""
    bound = math_scores_bytes(q) if scores_bytes is None else scores_bytes
    return max(1, bound // (q.shape[0] * max(sk, 1) * q.element_size()))


def cpu_flash_forward(q, k, v, causal, scale, mask=None, softcap=None, scores_bytes=None):
    """torch's CPU flash op; with a ``mask`` (bool or a :class:`~hf_fpdt.attention.block_keep.BlockKeep`) over
    query-row slices whose additive mask fits ``scores_bytes``: rows are independent, so the slices' ``out`` and
    ``lse`` side by side are the block's, and no mask of the whole block is formed."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        out, lse = SDPA_OPS.cpu_flash(q.transpose(1, 2), kt, vt, 0.0, causal, scale=scale)[:2]
        return out.transpose(1, 2), lse
    b, sq, h, _ = q.shape
    out, lse = q.new_empty(q.shape), None
    rows = _mask_rows_per_slice(q, k.shape[1], scores_bytes)
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        keep = mask_rows(mask, r, n, q.device)
        o, rows_lse = SDPA_OPS.cpu_flash(
            q[:, r : r + n].transpose(1, 2), kt, vt, 0.0, False, attn_mask=additive(keep, q.dtype), scale=scale
        )[:2]
        if lse is None:
            lse = torch.empty(b, h, sq, dtype=rows_lse.dtype, device=q.device)
        out[:, r : r + n] = o.transpose(1, 2)
        # the op reports lse 0 for a row with no key; it must merge as nothing
        empty = ~(keep if keep.dim() == 3 else keep.unsqueeze(0)).any(-1)  # [1 | B, n]
        lse[:, :, r : r + n] = rows_lse.masked_fill(empty.unsqueeze(1), float("-inf"))
        del keep, o, rows_lse
    return out, lse


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None, scores_bytes=None):
    """The CPU flash op's backward; with a ``mask`` over the query-row slices of :func:`cpu_flash_forward`: each
    slice's ``dq`` rows are exact, its ``dk, dv`` a sum over its rows (accumulated in float32, float64 for float64
    inputs, then in the inputs' dtype as the op returns them)."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)

    def grads(r: int, n: int) -> tuple[torch.Tensor, ...]:  # rows [r, r + n): dq rows, their dk and dv terms
        keep = None if mask is None else mask_rows(mask, r, n, q.device)
        res = SDPA_OPS.cpu_flash_backward(
            dout[:, r : r + n].transpose(1, 2),
            q[:, r : r + n].transpose(1, 2),
            kt,
            vt,
            out[:, r : r + n].transpose(1, 2),
            lse[:, :, r : r + n].contiguous(),
            0.0,
            causal and mask is None,
            attn_mask=None if keep is None else additive(keep, q.dtype),
            scale=scale,
        )
        return tuple(g.transpose(1, 2) for g in res)

    sq = q.shape[1]
    rows = sq if mask is None else _mask_rows_per_slice(q, k.shape[1], scores_bytes)
    if rows >= sq:  # one slice: the op's own gradients
        return grads(0, sq)
    acc = lse_dtype(q)
    dq, dk, dv = q.new_empty(q.shape), None, None
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        dq_s, dk_s, dv_s = grads(r, n)
        dq[:, r : r + n] = dq_s
        if dk is None:
            dk, dv = (g.to(acc, memory_format=torch.contiguous_format) for g in (dk_s, dv_s))
        else:
            dk += dk_s
            dv += dv_s
        del dq_s, dk_s, dv_s
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def cpu_problem(capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None) -> str | None:
    return None if capability.device_type == "cpu" else f"needs a CPU device (found {capability.device_type})"


CPU_FLASH = Kernel(
    name="cpu_flash",
    takes="CPU; any dtype and head dim; masked blocks (no softcap) over query-row slices of an additive mask",
    problem=cpu_problem,
    forward=cpu_flash_forward,
    backward=cpu_flash_backward,
    masked_forward=cpu_flash_forward,
    masked_backward=cpu_flash_backward,
)
