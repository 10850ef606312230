"""Blocks on torch's cuDNN attention op: the plain call, and a masked block as an additive bias over query-row slices.

``aten._scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
return_debug_mask, scale=)`` returns ``(out [B, H, Sq, D], lse [B, H, Sq, 1] float32, ...)``;
``aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, philox_seed, philox_offset, attn_bias,
cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale=)`` takes the supplied ``out`` / ``lse`` (the final,
merged ones: the exact-contribution identity of :mod:`hf_fpdt.attention.kernels`). Both take ``attn_bias`` (an
additive ``[B | 1, H | 1, Sq, Sk]`` bias in the query's dtype, broadcast by the op) in torch >= 2.5 (2.9, 2.13 and
2.14 checked: :func:`bias_problem` reads the installed schemas).

A masked block (a :class:`~hf_fpdt.attention.block_keep.BlockKeep` or a bool mask, no softcap) runs a slice of query
rows at a time: the slice's bool keep (:func:`~hf_fpdt.attention.block_keep.mask_rows`) becomes a bias ``[B | 1, 1,
n, Sk]`` (0 kept, ``-inf`` dropped; its rows padded to 16 elements, the alignment cuDNN asks of a bias' row stride)
of at most ``scores_bytes``, so no block's whole ``[Sq, Sk]`` bias exists. Rows are independent, so the slices'
outputs side by side are the block's. A row with no key in the block gets ``out = 0``, ``lse = -inf`` and zero
gradients as on ``math``, without trusting the kernel on an all ``-inf`` row: its bias row is 0 (a finite softmax,
then overwritten); in backward its ``dout`` is 0 and its ``lse`` ``+inf``, so ``P = exp(s - lse) = 0`` and the row
adds nothing to ``dk, dv`` (its ``dq`` rows are 0). ``dk, dv`` accumulate over the slices in float32 (float64 for
float64 inputs).

Whether the installed op runs masked blocks right is decided once per runtime
(:func:`hf_fpdt.attention.kernels.masked_cudnn`): its schemas must take ``attn_bias`` both ways, and a masked probe
block (:func:`hf_fpdt.attention.kernels.probe_cudnn_bias`) must match ``math``. The op is reached through
:data:`CUDNN_OPS` (read at call time), which a test replaces with a float64 stand-in on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.compat_torch import SDPA_OPS
from .block_keep import BlockKeep, mask_rows
from .math_blocks import math_scores_bytes


@dataclass(frozen=True)
class CudnnOps:
    """The forward and backward ops (``None`` where this torch has none)."""

    forward: object | None
    backward: object | None


CUDNN_OPS = CudnnOps(SDPA_OPS.cudnn, SDPA_OPS.cudnn_backward)
BIAS_ALIGN = 16  # elements a bias row is padded to (a 16-byte aligned row stride in any dtype)


def bias_problem(ops: CudnnOps | None = None) -> str | None:
    """Why the installed cuDNN ops cannot take an additive bias in forward and backward, or ``None``."""
    ops = ops or CUDNN_OPS
    for what, op in (("forward", ops.forward), ("backward", ops.backward)):
        if op is None:
            return f"this torch has no cuDNN attention {what} op"
        schema = getattr(getattr(op, "default", op), "_schema", None)
        names = [a.name for a in getattr(schema, "arguments", ())]
        if "attn_bias" not in names:
            return f"torch {torch.__version__}'s cuDNN attention {what} op takes no attn_bias"
    return None


def cudnn_forward(q, k, v, causal, scale):
    # [B, S, H, D] views transposed to [B, H, S, D]; cuDNN takes the strides as they are (no copy) and
    # allocates its output in the query's layout. lse comes back as [B, H, Sq, 1] float32.
    res = CUDNN_OPS.forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale
    )
    return res[0].transpose(1, 2), res[1].squeeze(-1)


def cudnn_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    # The supplied final (out, lse) replace the block's own: the exact-contribution identity of the
    # kernels' module doc. No dropout, so the philox seed/offset are placeholders; GQA is native.
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = CUDNN_OPS.backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.unsqueeze(-1).contiguous(),  # [B, H, Sq, 1], as the forward returned it
        empty,
        empty,
        bias,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def bias_rows_per_slice(q: torch.Tensor, sk: int, scores_bytes: int | None) -> int:
    """Query rows per slice: the slice's bias ``[B, 1, rows, Sk padded]`` in ``q``'s dtype fits ``scores_bytes``
    (default :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes`), at least one row."""
    bound = math_scores_bytes(q) if scores_bytes is None else scores_bytes
    return max(1, bound // (q.shape[0] * _padded(sk) * q.element_size()))


def _padded(sk: int) -> int:
    return max(BIAS_ALIGN, -(-sk // BIAS_ALIGN) * BIAS_ALIGN)


def _acc(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's and the ``dk, dv`` sums' dtype: float32 (float64 for float64 inputs, as on ``math``)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _slice_bias(keep: torch.Tensor, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """bool keep ``[n, Sk]`` / ``[B | 1, n, Sk]`` -> (bias ``[B, 1, n, Sk]`` (a view: rows padded, batch expanded),
    empty ``[B | 1, n]``: rows that keep no key, whose bias row is 0)."""
    m = keep if keep.dim() == 3 else keep.unsqueeze(0)
    empty = ~m.any(-1)
    rows, sk = m.shape[-2], m.shape[-1]
    bias = torch.zeros(m.shape[0], 1, rows, _padded(sk), dtype=dtype, device=m.device)[..., :sk]
    bias.masked_fill_((~m & ~empty[..., None]).unsqueeze(1), float("-inf"))
    return bias.expand(batch, 1, rows, sk), empty


def cudnn_masked_forward(q, k, v, scale, mask: torch.Tensor | BlockKeep, scores_bytes: int | None = None):
    """``(out [B, Sq, H, D], lse [B, H, Sq])`` of a masked block, a bias slice of query rows at a time."""
    b, sq, h, _ = q.shape
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    out = q.new_empty(q.shape)
    lse = torch.empty(b, h, sq, dtype=_acc(q), device=q.device)
    rows = bias_rows_per_slice(q, k.shape[1], scores_bytes)
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        bias, empty = _slice_bias(mask_rows(mask, r, n, q.device), b, q.dtype)
        res = CUDNN_OPS.forward(q[:, r : r + n].transpose(1, 2), kt, vt, bias, True, 0.0, False, False, scale=scale)
        o, rows_lse = res[0].transpose(1, 2), res[1].squeeze(-1)
        if rows_lse.dtype != lse.dtype or tuple(rows_lse.shape) != (b, h, n):
            raise RuntimeError(
                f"cudnn: log-sum-exp {rows_lse.dtype} {tuple(rows_lse.shape)}, expected {lse.dtype} {(b, h, n)}"
            )
        out[:, r : r + n] = o.masked_fill(empty[:, :, None, None], 0)
        lse[:, :, r : r + n] = rows_lse.masked_fill(empty[:, None, :], float("-inf"))
        del bias, res, o, rows_lse
    return out, lse


def cudnn_masked_backward(dout, q, k, v, out, lse, scale, mask: torch.Tensor | BlockKeep, scores_bytes=None):
    """Exact ``(dq, dk, dv)`` of a masked block given the rows' final ``out`` / ``lse``, over the forward's slices."""
    b, sq = q.shape[:2]
    rows = bias_rows_per_slice(q, k.shape[1], scores_bytes)
    dq, dk, dv = q.new_empty(q.shape), None, None
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        bias, empty = _slice_bias(mask_rows(mask, r, n, q.device), b, q.dtype)
        do_s, lse_s = dout[:, r : r + n], lse[:, :, r : r + n]
        # P = 0 on rows that keep nothing: dout 0, lse +inf (module doc); no host sync to find them
        do_s = do_s.masked_fill(empty[:, :, None, None], 0)
        lse_s = lse_s.masked_fill(empty[:, None, :], float("inf"))
        dq_s, dk_s, dv_s = cudnn_backward(
            do_s, q[:, r : r + n], k, v, out[:, r : r + n], lse_s, False, scale, bias=bias
        )
        dq[:, r : r + n] = dq_s.masked_fill(empty[:, :, None, None], 0)
        if dk is None:
            dk, dv = (g.to(_acc(q), memory_format=torch.contiguous_format) for g in (dk_s, dv_s))
        else:
            dk += dk_s
            dv += dv_s
        del bias, dq_s, dk_s, dv_s
    return dq, dk.to(k.dtype), dv.to(v.dtype)
