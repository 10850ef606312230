"""Block attention kernels: one (query chunk, key/value chunk) block at a time.

Every kernel works on the sequence-major layout the chunk pipeline uses::

    q    [B, Sq, Hq, D]      k, v [B, Sk, Hkv, D]      (Hq a multiple of Hkv: MHA, GQA, MQA)
    out  [B, Sq, Hq, D]      lse  [B, Hq, Sq]  (float32; float64 for float64 inputs)

``block_forward`` returns the block's normalised output and its log-sum-exp. ``block_backward`` takes
the *final* output and log-sum-exp of the query rows (merged over all key/value blocks they attend
to): with those, ``P = exp(q k^T * scale - lse)`` is the true softmax restricted to the block and
``rowsum(dout * out)`` the true correction term, so the returned ``dq, dk, dv`` are exact
contributions of this block (the same identity ring attention relies on).

``causal=True`` means the top-left aligned causal mask, used only for the diagonal block where the
query and key chunks cover the same tokens. ``mask`` (bool ``[Sq, Sk]`` or ``[B, Sq, Sk]``, True =
attend; replaces ``causal``) is the pattern of a block only partly inside a sliding window or a
document (:mod:`hf_fpdt.block_mask`): the ``cpu_flash`` backend takes it as an additive mask, the others
run such blocks on ``math``. Query rows with no key in the block get ``out = 0``, ``lse = -inf`` (they
merge as nothing). ``softcap`` applies ``cap * tanh(s / cap)`` to the scaled scores (Gemma 2) before
the mask; no fused kernel here has it, so softcapped blocks always run on ``math`` (exact backward
through the tanh).

Backends, chosen by device and dtype unless named:

* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (a
  blockwise kernel; handles GQA itself).
* ``flash_attn``: the ``flash-attn`` package on CUDA for fp16/bf16, when installed.
* ``torch_flash``: torch's own CUDA flash kernels for fp16/bf16.
* ``math``: explicit matmuls in float32 (float64 for float64 inputs) on any device; the float64
  reference of the tests and the fallback for float32 on CUDA (its memory is O(Sq * Sk) per head).
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("cpu_flash", "flash_attn", "torch_flash", "math")


def select_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest exact backend for tensors on ``device`` of ``dtype``."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attn"
        return "torch_flash"
    return "math"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q [B, Sq, H, D] and k, v [B, Sk, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, S, Hkv, D] -> [B, S, Hkv * groups, D]; head h of the result is kv head h // groups (HF's
    # repeat_kv order). Only ever called on one chunk, so the copy is O(chunk).
    if groups == 1:
        return t
    b, s, h, d = t.shape
    return t.unsqueeze(3).expand(b, s, h, groups, d).reshape(b, s, h * groups, d)


def _fold_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.view(b, s, h // groups, groups, d).sum(3)


def _keep(s: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The bool attend-pattern broadcastable to scores ``s [B, H, Sq, Sk]``, or None (all kept)."""
    if mask is not None:
        return mask if mask.dim() == 2 else mask.unsqueeze(1)
    if causal:
        return torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return None


def _math_scores(qh, kh, causal, scale, mask, softcap):
    """Scaled (softcapped) masked scores, and ``tanh`` of the softcap for its backward."""
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    keep = _keep(s, causal, mask)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s, t


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # rows with no key in the block: exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _math_forward(q, k, v, causal, scale, mask=None, softcap=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).to(acc)
    kh = _expand_kv(k, groups).transpose(1, 2).to(acc)
    vh = _expand_kv(v, groups).transpose(1, 2).to(acc)
    s, _ = _math_scores(qh, kh, causal, scale, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), vh)
    return out.transpose(1, 2).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).to(acc)
    kh = _expand_kv(k, groups).transpose(1, 2).to(acc)
    vh = _expand_kv(v, groups).transpose(1, 2).to(acc)
    doh = dout.transpose(1, 2).to(acc)
    oh = out.transpose(1, 2).to(acc)
    s, t = _math_scores(qh, kh, causal, scale, mask, softcap)
    p = torch.exp(s - _finite(lse.to(acc)).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    if t is not None:
        ds = ds * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
    dq = torch.matmul(ds, kh)
    dk = torch.matmul(ds.transpose(-1, -2), qh)
    dk = _fold_kv_grad(dk.transpose(1, 2), groups)
    dv = _fold_kv_grad(dv.transpose(1, 2), groups)
    return dq.transpose(1, 2), dk, dv


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """bool ``[Sq, Sk]`` / ``[B, Sq, Sk]`` -> additive ``[1 | B, 1, Sq, Sk]`` in ``dtype`` (the op's form)."""
    if mask is None:
        return None
    m = mask if mask.dim() == 3 else mask.unsqueeze(0)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf")).unsqueeze(1)


def _cpu_flash_forward(q, k, v, causal, scale, mask=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        causal and mask is None,
        attn_mask=_additive(mask, q.dtype),
        scale=scale,
    )
    if mask is not None:  # the op reports lse 0 for a row with no key; it must merge as nothing
        empty = ~(mask if mask.dim() == 3 else mask.unsqueeze(0)).any(-1)  # [1 | B, Sq]
        lse = lse.masked_fill(empty.unsqueeze(1), float("-inf"))
    return out.transpose(1, 2), lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.contiguous(),
        0.0,
        causal and mask is None,
        attn_mask=_additive(mask, q.dtype),
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _torch_flash_forward(q, k, v, causal, scale):
    groups = q.shape[2] // k.shape[2]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2),
        _expand_kv(k, groups).transpose(1, 2),
        _expand_kv(v, groups).transpose(1, 2),
        0.0,
        causal,
        False,
        scale=scale,
    )
    return res[0].transpose(1, 2), res[1]


def _torch_flash_backward(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[2] // k.shape[2]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        ke.transpose(1, 2),
        ve.transpose(1, 2),
        out.transpose(1, 2),
        lse.contiguous(),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        empty,
        empty,
        scale=scale,
    )
    return dq.transpose(1, 2), _fold_kv_grad(dk.transpose(1, 2), groups), _fold_kv_grad(dv.transpose(1, 2), groups)


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, 0.0, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse.contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return dq, dk, dv


_FORWARD = {
    "cpu_flash": _cpu_flash_forward,
    "flash_attn": _flash_attn_forward,
    "torch_flash": _torch_flash_forward,
    "math": _math_forward,
}
_BACKWARD = {
    "cpu_flash": _cpu_flash_backward,
    "flash_attn": _flash_attn_backward,
    "torch_flash": _torch_flash_backward,
    "math": _math_backward,
}


def _masked_name(name: str, mask: torch.Tensor | None, softcap: float | None) -> str:
    """The backend that runs a block with ``mask`` / ``softcap`` (``name`` where it can, else ``math``)."""
    if softcap is not None or (mask is not None and name != "cpu_flash"):
        return "math"
    return name


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str | None = None,
    *,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out [B, Sq, Hq, D], lse [B, Hq, Sq])`` (``mask``, ``softcap``: module doc)."""
    _check(q, k, v)
    name = backend or select_backend(q.device, q.dtype)
    if name not in _FORWARD:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    if mask is None and softcap is None:
        return _FORWARD[name](q, k, v, causal, scale)
    if _masked_name(name, mask, softcap) == "math":
        return _math_forward(q, k, v, causal, scale, mask, softcap)
    return _cpu_flash_forward(q, k, v, causal, scale, mask)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str | None = None,
    *,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact ``(dq, dk, dv)`` of one block given the query rows' *final* ``out`` and ``lse``."""
    _check(q, k, v)
    name = backend or select_backend(q.device, q.dtype)
    if name not in _BACKWARD:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    if mask is None and softcap is None:
        return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)
    if _masked_name(name, mask, softcap) == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale, mask, softcap)
    return _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask)


def merge_block(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's ``(out, lse)`` into the running ``(out, lse)`` of the same query rows.

    ``out`` [B, Sq, H, D] and ``lse`` [B, H, Sq] are kept in float32 (float64 stays float64). The
    sigmoid/logsigmoid form never exponentiates a large positive gap::

        out <- out - sigmoid(lse_b - lse) * (out - out_b)
        lse <- lse - logsigmoid(lse - lse_b)
    """
    acc = torch.float64 if block_out.dtype == torch.float64 else torch.float32
    block_lse = block_lse.to(acc)
    if out is None:
        return block_out.to(acc), block_lse
    weight = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    out = out - weight * (out - block_out.to(acc))
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse
