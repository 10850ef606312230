"""Blocks on torch's cuDNN attention op: the plain call, and a masked block as an additive bias over query-row slices.

``aten._scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
return_debug_mask, scale=)`` returns ``(out [B, H, Sq, D], lse [B, H, Sq, 1] float32, ...)``;
``aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, philox_seed, philox_offset, attn_bias,
cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale=)`` takes the supplied ``out`` / ``lse`` (the final,
merged ones: the exact-contribution identity of :mod:`hf_fpdt.attention.routes`). Both take ``attn_bias`` (an
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
(:func:`hf_fpdt.attention.routes.masked_cudnn`): its schemas must take ``attn_bias`` both ways, and a masked probe
block (:func:`probe_cudnn_bias`) must match ``math``. The op is reached through
:data:`CUDNN_OPS` (read at call time), which a test replaces with a float64 stand-in on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.compat_torch import SDPA_OPS
from .block_keep import BlockKeep, mask_rows
from .block_kernel import DeviceCapability, Kernel, checked_lse, cuda_half_problem, lse_dtype, probe_mismatch
from .math_blocks import math_backward, math_forward, math_scores_bytes
from .precision import no_autocast


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
    return res[0].transpose(1, 2), checked_lse(res[1].squeeze(-1), q, "cudnn")


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


def slice_rows(sq: int, rows: int) -> list[tuple[int, int]]:
    """The ``(first row, height)`` of each query-row slice of a block of ``sq`` rows under a bound of ``rows``: every
    height a power of two (``rows`` rounded down to one; the remainder as descending powers of two), so the shapes the
    op sees, and cuDNN's cache of execution plans (one per shape and thread, never evicted), stay a handful whatever
    the chunk and document lengths: at most ``log2(rows) + 1`` heights."""
    top = 1 << (max(1, rows).bit_length() - 1)
    out, r = [], 0
    while r < sq:
        n = top
        while n > sq - r:
            n >>= 1
        out.append((r, n))
        r += n
    return out


def _padded(sk: int) -> int:
    return max(BIAS_ALIGN, -(-sk // BIAS_ALIGN) * BIAS_ALIGN)


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
    lse = torch.empty(b, h, sq, dtype=lse_dtype(q), device=q.device)
    for r, n in slice_rows(sq, bias_rows_per_slice(q, k.shape[1], scores_bytes)):
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
    dq, dk, dv = q.new_empty(q.shape), None, None
    for r, n in slice_rows(sq, bias_rows_per_slice(q, k.shape[1], scores_bytes)):
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
            dk, dv = (g.to(lse_dtype(q), memory_format=torch.contiguous_format) for g in (dk_s, dv_s))
        else:
            dk += dk_s
            dv += dv_s
        del bias, dq_s, dk_s, dv_s
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def probe_cudnn_bias(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why ``cudnn`` cannot run masked blocks with an additive bias on ``device``, or ``None`` where it can: the
    installed op must take ``attn_bias`` in forward and backward (:func:`bias_problem`), and a masked probe block (GQA
    2:1, causal with a window cut and a padded first key, so row 0 keeps no key; three row slices) must match the
    float32 ``math`` path: out, lse (``-inf`` on the empty row), dq, dk, dv."""
    problem = bias_problem()
    if problem is not None:
        return problem
    device, d = torch.device(device), head_dim or 64
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 48, 2, d, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 48, 1, d, generator=g).to(device, dtype) for _ in range(2))
    keys = torch.ones(1, 48, dtype=torch.bool, device=device)
    keys[0, 0] = False
    keep = BlockKeep(qs=0, ks=0, sq=48, sk=48, causal=True, window=20, keys=keys)
    scale, slice_bytes = d**-0.5, 16 * 48 * torch.finfo(dtype).bits // 8  # 16 rows a slice: three slices
    with no_autocast(device.type):  # the first call may come under the user's autocast
        try:
            out, lse = cudnn_masked_forward(q, k, v, scale, keep, slice_bytes)
            grads = cudnn_masked_backward(dout, q, k, v, out, lse, scale, keep, slice_bytes)
        except Exception as err:  # any failure of the installed op means: masked blocks stay on math
            return f"its masked probe block raised {type(err).__name__}: {str(err)[:160]}"
        f = [t.float() for t in (dout, q, k, v)]
        ref_out, ref_lse = math_forward(*f[1:], False, scale, keep)
        ref_grads = math_backward(*f, ref_out, ref_lse, False, scale, keep)
    return probe_mismatch("masked probe block's ", (out, lse, *grads), (ref_out, ref_lse, *ref_grads))


def cudnn_problem(capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None) -> str | None:
    problem = cuda_half_problem(capability, dtype, head_dim, (9, 0), 128)
    if problem is not None:
        return problem
    if not capability.torch_cudnn_attention:
        return "this torch build has no cuDNN attention ops (aten._scaled_dot_product_cudnn_attention)"
    if capability.cudnn_version is None or capability.cudnn_version < 90000:
        return f"needs cuDNN >= 9 (found {capability.cudnn_version})"
    return None


def _masked_forward(q, k, v, causal, scale, mask, softcap=None, scores_bytes=None):
    return cudnn_masked_forward(q, k, v, scale, mask, scores_bytes)


def _masked_backward(dout, q, k, v, out, lse, causal, scale, mask, softcap=None, scores_bytes=None):
    return cudnn_masked_backward(dout, q, k, v, out, lse, scale, mask, scores_bytes)


CUDNN = Kernel(
    name="cudnn",
    takes=(
        "CUDA >= 9.0, cuDNN >= 9, fp16/bf16, head dim a multiple of 8 up to 128; dense and causal blocks, and masked "
        "blocks (no softcap) as an additive bias over query-row slices once its masked probe passes"
    ),
    problem=cudnn_problem,
    forward=cudnn_forward,
    backward=cudnn_backward,
    probed=True,
    masked_forward=_masked_forward,
    masked_backward=_masked_backward,
    masked_probed=True,
)
