"""The ``math`` block kernel: one (query chunk, key/value chunk) block in explicit matmuls, float32 (float64 for
float64 inputs), on any device, over query-row slices so that no block ever forms its whole ``[Sq, Sk]`` scores.

The float64 reference of the tests, and the path of every masked or softcapped block no fused kernel takes
(:mod:`hf_fpdt.attention.routes` sends them here). Layouts as there: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``,
``out [B, Sq, Hq, D]``, ``lse [B, Hq, Sq]``. Each slice holds at most ``scores_bytes`` of fp32 scores (default
:func:`math_scores_bytes`), in forward and backward; GQA is folded into the rows (the query heads of one key/value
head stacked), so K/V are never repeated per head and the GQA gradient sum is the matmul's. A block's mask is built
slice by slice too where it comes as a :class:`~hf_fpdt.attention.block_keep.BlockKeep` (the chunk pipeline's cut
blocks): a slice holds its own rows' mask alone, never the block's ``[Sq, Sk]``.
"""

from __future__ import annotations

import torch

from .block_keep import mask_rows
from .block_kernel import Kernel, any_device

MATH_SCORES_MIN = 1 << 24  # bytes of one slice of a math block's fp32 scores: at least (slices big enough to run fast)
MATH_SCORES_MAX = 1 << 28  # and at most


def math_scores_bytes(q: torch.Tensor) -> int:
    """The default bound on one query-row slice of a ``math`` block's fp32 scores, for a block with queries ``q``
    ``[B, Sq, Hq, D]``: a quarter of those queries' size in fp32, so the three slices the backward holds at once
    (scores, their softcap's ``tanh``, ``ds``) stay under it and grow with the chunk's other tensors
    (O(chunk * heads * head dim), never O(chunk^2)); within ``[MATH_SCORES_MIN, MATH_SCORES_MAX]``."""
    return min(MATH_SCORES_MAX, max(MATH_SCORES_MIN, q.numel()))


def _slice_rows(q: torch.Tensor, sk: int, acc: torch.dtype, scores_bytes: int | None) -> int:
    """Query rows per slice: the scores ``[B, Hq, rows, Sk]`` in ``acc`` fit ``scores_bytes`` (at least one row)."""
    b, _, h, _ = q.shape
    bound = math_scores_bytes(q) if scores_bytes is None else scores_bytes
    return max(1, bound // (b * h * max(sk, 1) * torch.finfo(acc).bits // 8))


def _grouped(t: torch.Tensor, groups: int, acc: torch.dtype) -> torch.Tensor:
    """``[B, n, Hq, D]`` rows -> ``[B, Hkv, groups * n, D]`` in ``acc``: the query heads of one key/value head
    stacked as rows (head h is kv head h // groups, HF's repeat_kv order), so one matmul against the unrepeated
    ``[B, Hkv, Sk, D]`` keys serves them all and a matmul's sum over rows folds the GQA gradients."""
    b, n, h, d = t.shape
    return t.transpose(1, 2).to(acc).reshape(b, h // groups, groups * n, d)


def _slice_keep(causal: bool, mask, r: int, n: int, sk: int, device) -> torch.Tensor | None:
    """The bool attend-pattern of query rows ``[r, r + n)``, broadcastable to scores ``[B, Hq, n, Sk]``: the rows of
    ``mask`` (a :class:`~hf_fpdt.attention.block_keep.BlockKeep` builds only those), or the causal triangle's."""
    if mask is not None:
        m = mask_rows(mask, r, n, device)
        return m if m.dim() == 2 else m.unsqueeze(1)
    if causal:  # top-left aligned: query row t sees keys u <= t
        return torch.arange(r, r + n, device=device)[:, None] >= torch.arange(sk, device=device)[None, :]
    return None


def _slice_scores(qg, kt, scale, softcap, keep, shape, grad=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, softcapped, masked scores ``shape = [B, Hq, n, Sk]`` of one slice (in place after the matmul), and
    with ``grad`` the softcap's ``tanh`` for the backward (else None)."""
    s = torch.matmul(qg, kt).view(shape).mul_(scale)
    t = None
    if softcap is not None and grad:
        t = s.div_(softcap).tanh_()
        s = t * softcap
    elif softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if keep is not None:
        s.masked_fill_(~keep, float("-inf"))
    return s, t


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # rows with no key in the block: exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def math_forward(q, k, v, causal, scale, mask=None, softcap=None, scores_bytes=None):
    """The block in explicit matmuls, ``scores_bytes`` of fp32 scores at a time (query-row slices).

    Per slice of n rows: ``qg [B, Hkv, g*n, D] @ k^T [B, Hkv, D, Sk]`` -> scores ``[B, Hq, n, Sk]`` (then the
    probabilities in place) -> ``@ v [B, Hkv, Sk, D]``. K/V are converted once, never repeated per query head.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, h, d = q.shape
    sk, groups = k.shape[1], q.shape[2] // k.shape[2]
    kt = k.transpose(1, 2).to(acc).transpose(-1, -2)  # [B, Hkv, D, Sk]
    vh = v.transpose(1, 2).to(acc)  # [B, Hkv, Sk, D]
    out = q.new_empty(q.shape)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    rows = _slice_rows(q, sk, acc, scores_bytes)
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        keep = _slice_keep(causal, mask, r, n, sk, q.device)
        s, _ = _slice_scores(_grouped(q[:, r : r + n], groups, acc), kt, scale, softcap, keep, (b, h, n, sk))
        rows_lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(_finite(rows_lse).unsqueeze(-1)).exp_()
        o = torch.matmul(p.view(b, -1, groups * n, sk), vh)  # [B, Hkv, g*n, D]
        out[:, r : r + n] = o.view(b, h, n, d).transpose(1, 2)
        lse[:, :, r : r + n] = rows_lse
        del s, p, o, keep
    return out, lse


def math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None, scores_bytes=None):
    """:func:`math_forward`'s backward, slice by slice: per slice the scores are formed again, ``p``, ``dp`` and
    ``ds`` in place of each other (two slice-sized tensors, three with a softcap); ``dk``, ``dv`` accumulate
    ``[B, Hkv, Sk, D]`` in fp32, the GQA fold done by the matmul's sum over the stacked rows."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, h, d = q.shape
    sk, groups = k.shape[1], q.shape[2] // k.shape[2]
    kh = k.transpose(1, 2).to(acc)  # [B, Hkv, Sk, D]
    vh = v.transpose(1, 2).to(acc)
    kt, vt = kh.transpose(-1, -2), vh.transpose(-1, -2)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kh.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vh.shape, dtype=acc, device=q.device)
    lse = _finite(lse.to(acc))
    rows = _slice_rows(q, sk, acc, scores_bytes)
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        qg = _grouped(q[:, r : r + n], groups, acc)  # [B, Hkv, g*n, D]
        dog = _grouped(dout[:, r : r + n], groups, acc)
        keep = _slice_keep(causal, mask, r, n, sk, q.device)
        s, t = _slice_scores(qg, kt, scale, softcap, keep, (b, h, n, sk), grad=True)
        p = s.sub_(lse[:, :, r : r + n].unsqueeze(-1)).exp_().view(b, -1, groups * n, sk)
        dv.add_(torch.matmul(p.transpose(-1, -2), dog))
        delta = (dog * _grouped(out[:, r : r + n], groups, acc)).sum(-1, keepdim=True)  # [B, Hkv, g*n, 1]
        ds = torch.matmul(dog, vt).sub_(delta).mul_(p).mul_(scale)  # dp -> ds in place
        del p, s
        if t is not None:
            ds.mul_(t.mul_(t).neg_().add_(1).view(ds.shape))  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        dq[:, r : r + n] = torch.matmul(ds, kh).view(b, h, n, d).transpose(1, 2)
        dk.add_(torch.matmul(ds.transpose(-1, -2), qg))
        del ds, t, qg, dog, keep
    return dq, dk.transpose(1, 2), dv.transpose(1, 2)


MATH = Kernel(
    name="math",
    takes="any device and dtype; every block: masks, windows, documents, softcaps, over query-row slices",
    problem=any_device,
    forward=math_forward,
    backward=math_backward,
    masked_forward=math_forward,
    masked_backward=math_backward,
    softcap=True,
)
