"""The tests' one set of stand-ins for the kernels a CPU machine does not have, and the one dense masked reference.

- :func:`dense_attention`: float64 attention of ``q [B, Sq, H, D]`` over ``k, v [B, Sk, Hkv, D]`` (GQA by fewer key /
  value heads) under a keep mask or a :class:`~hf_fpdt.attention.block_mask.MaskSpec`, a softcap, a top-left causal
  mask: ``(out, lse, dq, dk, dv)`` by autograd; rows that keep no key give ``out = 0``, ``lse = -inf`` and zero
  gradients. :func:`reference_attention` is its differentiable output alone. Every test judges against these.
- :func:`dense_backward`: the kernels' backward identity from a *supplied* ``out`` / ``lse`` (``P = exp(S - lse)``,
  ``dS = P (dP - rowsum(dO * O))``), which the stand-ins below compute their backward with.
- reference implementations of torch's CUDA-only ops with the real ops' argument order, output shapes, strides,
  dtypes and LSE layouts: :func:`cudnn_attention` / :func:`cudnn_attention_backward`
  (``aten._scaled_dot_product_cudnn_attention(_backward)``: lse ``[B, H, Sq, 1]`` float32) and
  :func:`flash_attention` / :func:`flash_attention_backward` (``aten._scaled_dot_product_flash_attention(_backward)``:
  lse ``[B, H, Sq]`` float32); :data:`ATEN_REFERENCES` maps the ops to them (the virtual CUDA device answers the ops
  with them: ``VirtualCuda(kernels=True)``), :func:`aten_references_on_cpu` registers them as the ops' CPU kernels.
- :class:`CudnnStandIn`: ``cudnn_blocks.CUDNN_OPS`` replaced by those references, recording each call and bias (a
  ``wrong`` kernel, one ``raises``, one whose schema has no ``attn_bias``).
- :func:`install_flash`: a flash-attn build as fake modules in ``sys.modules`` (monkeypatched), one per released
  signature style (:data:`FLASH_VERSIONS`), computing flash-attn's documented semantics (bottom-right aligned causal
  and window masks, an empty row's ``lse = +inf``) in float64 and recording its calls.

Compute is float64; outputs go back in the inputs' dtype, the LSE in float32 (float64 for float64 inputs, so CPU tests
can bound errors at 1e-10).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

LOG2E = 1.4426950408889634


# ---- the dense masked reference -------------------------------------------------------------------------------------


class Dense(NamedTuple):
    """float64 ``out [B, Sq, H, D]``, ``lse [B, H, Sq]`` and the gradients (``None`` without ``dout``)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None


def spec_keep(spec, batch: int, s: int) -> torch.Tensor:
    """The ``[B, S, S]`` keep mask of a whole causal sequence under a ``MaskSpec`` (window, documents, chunks, sparse
    pattern, key mask, dense mask), by the definitions (query t sees key u iff ``u <= t``, ``t - W < u`` ...)."""
    t, u = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = (u <= t).expand(batch, s, s).clone()
    if spec.window is not None:
        keep &= u > t - spec.window
    for ids in (spec.docs, getattr(spec, "chunks", None)):
        if ids is not None:
            keep &= ids[:, :, None] == ids[:, None, :]
    if spec.sparse is not None:
        keep &= spec.sparse.keep(0, s, 0, s, torch.device("cpu"))
    if spec.key_mask is not None:
        keep &= spec.key_mask[:, None, :]
    if spec.dense_mask is not None:
        dense = spec.dense_mask[:, 0]
        keep &= dense if dense.dtype == torch.bool else dense == 0
    return keep


def _keep4(keep, batch: int, sq: int, sk: int, causal: bool) -> torch.Tensor | None:
    """A keep mask as ``[B | 1, H | 1, Sq, Sk]`` bool (``MaskSpec`` / ``[Sq, Sk]`` / ``[B, Sq, Sk]`` / 4D), the causal
    (top-left) triangle joined in; ``None``: all."""
    if keep is not None and not isinstance(keep, torch.Tensor):
        keep = spec_keep(keep, batch, sq)
    if keep is not None:
        keep = keep[None, None] if keep.dim() == 2 else keep[:, None] if keep.dim() == 3 else keep
    if causal:
        tri = torch.ones(sq, sk, dtype=torch.bool).tril()
        keep = tri if keep is None else keep & tri
    return keep


def scores(q, k, scale: float, softcap=None, keep=None, causal: bool = False, bias=None):
    """float64 scores ``[B, H, Sq, Sk]`` of ``q [B, Sq, H, D]``, ``k [B, Sk, Hkv, D]`` (softcapped, plus ``bias``,
    dropped ones ``-inf``) and the softcap's ``tanh`` (``None`` without one)."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * scale
    t = torch.tanh(s / softcap) if softcap else None
    s = softcap * t if softcap else s
    if bias is not None:
        s = s + bias.double()
    keep = _keep4(keep, q.shape[0], q.shape[1], k.shape[1], causal)
    return (s if keep is None else s.masked_fill(~keep, float("-inf"))), t


def _fold(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, S, H, D]`` gradients of repeated key / value heads summed back to ``hkv`` heads."""
    b, s, h, d = x.shape
    return x.reshape(b, s, hkv, h // hkv, d).sum(3)


def _attend(q, k, v, keep, scale, softcap, causal):
    """Differentiable float64 ``(out, lse)``; a row with no key: out 0, lse -inf, no NaN in its gradients."""
    s, _ = scores(q, k, scale, softcap, keep, causal)
    any_key = ~torch.isneginf(s).all(-1, keepdim=True)
    s = torch.where(any_key, s, 0.0)
    p = s.softmax(-1) * any_key
    lse = s.logsumexp(-1).masked_fill(~any_key[..., 0], float("-inf"))
    g = q.shape[2] // k.shape[2]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(g, 2)), lse


def dense_attention(q, k, v, keep=None, *, scale: float, causal: bool = False, softcap=None, dout=None) -> Dense:
    """The one dense masked float64 reference (module doc): ``keep`` a ``MaskSpec`` (a whole causal sequence), a bool
    ``[Sq, Sk]`` / ``[B, Sq, Sk]`` / ``[B | 1, H | 1, Sq, Sk]`` mask, or ``None``; ``causal``: top-left."""
    q64, k64, v64 = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    if softcap is None and keep is not None and not isinstance(keep, torch.Tensor):
        softcap = keep.softcap
    out, lse = _attend(q64, k64, v64, keep, scale, softcap, causal)
    if dout is None:
        return Dense(out.detach(), lse.detach(), None, None, None)
    out.backward(dout.double())
    return Dense(out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad)


def reference_attention(q, k, v, scale: float, causal: bool = True, keep=None, softcap=None) -> torch.Tensor:
    """:func:`dense_attention`'s output alone (``keep``, ``softcap`` as there), differentiable (the caller's leaves
    get the gradients); a row keeping no key gives 0."""
    return _attend(q, k, v, keep, scale, softcap, causal)[0]


def dense_backward(dout, q, k, v, out, lse, scale, keep=None, causal=False, softcap=None, bias=None):
    """float64 ``(dq, dk, dv)`` of a block from the supplied final ``out [B, Sq, H, D]`` and ``lse [B, H, Sq]``."""
    s, t = scores(q, k, scale, softcap, keep, causal, bias)
    p = (s - lse.double()[..., None]).exp()
    g = q.shape[2] // k.shape[2]
    do = dout.double()
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v.double().repeat_interleave(g, 2)) - delta) * scale
    ds = ds * (1 - t * t) if softcap else ds
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.double().repeat_interleave(g, 2))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double())
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    return dq, _fold(dk, k.shape[2]), _fold(dv, k.shape[2])


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---- torch's CUDA-only attention ops: reference implementations ------------------------------------------------------


def _bhsd(t):
    return t.transpose(1, 2)


def _like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in a fresh tensor with ``t``'s dtype and strides (``empty_like``, as the ops allocate)."""
    return torch.empty_like(t).copy_(values)


def _strided(query: torch.Tensor, shape: tuple) -> torch.Tensor:
    """torch's ``alloc_with_matching_layout``: ``shape`` with the query's dimension order."""
    if tuple(query.shape) == tuple(shape):
        return torch.empty_like(query)
    order = sorted(range(4), key=lambda i: query.stride()[i], reverse=True)
    strides, step = [0] * 4, 1
    for i in reversed(order):
        strides[i], step = step, step * shape[i]
    return torch.empty_strided(shape, strides, dtype=query.dtype)


def _forward_heads_first(q, k, v, is_causal, scale, bias=None):
    """Heads-first ``q [B, H, Sq, D]`` -> float64 ``(out [B, H, Sq, Dv], lse [B, H, Sq])``; an all ``-inf`` row: NaN
    (as a kernel may give)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s, _ = scores(_bhsd(q), _bhsd(k), scale, causal=is_causal, bias=bias)
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp()
    g = q.shape[1] // k.shape[1]
    return p @ v.double().repeat_interleave(g, 1), lse


def _check_dropout(op: str, dropout_p: float) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"{op}: dropout is not modelled by the reference (dropout_p={dropout_p})")


def cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                    return_debug_mask=False, *, scale=None):  # fmt: skip
    """``aten._scaled_dot_product_cudnn_attention``: ``(out [B, H, Sq, Dv] in the query's layout, lse [B, H, Sq, 1]
    float32, None, None, Sq, Sk, seed, offset, None)``; GQA by fewer key / value heads; ``attn_bias`` broadcast."""
    _check_dropout("cudnn attention", dropout_p)
    assert compute_log_sumexp and not return_debug_mask
    out, lse = _forward_heads_first(query, key, value, is_causal, scale, attn_bias)
    b, h, sq, _ = query.shape
    res = _strided(query, (b, h, sq, value.shape[-1])).copy_(out)
    lse = lse.to(lse_dtype(query)).unsqueeze(-1).contiguous()
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    return res, lse, None, None, sq, key.shape[2], seed, seed.clone(), None


def cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                             cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):  # fmt: skip
    """``aten._scaled_dot_product_cudnn_attention_backward``: ``(dq, dk, dv)`` like the inputs, from the supplied
    ``out`` / ``logsumexp [B, H, Sq, 1]``."""
    _check_dropout("cudnn attention backward", dropout_p)
    assert logsumexp.shape == (*query.shape[:3], 1) and logsumexp.dtype == lse_dtype(query), logsumexp.shape
    assert (max_q, max_k) == (query.shape[2], key.shape[2]) and philox_seed.dtype == torch.int64
    assert grad_out.shape == out.shape == query.shape
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = dense_backward(*(_bhsd(t) for t in (grad_out, query, key, value, out)), logsumexp.squeeze(-1), scale,
                           causal=is_causal, bias=attn_bias)  # fmt: skip
    return tuple(_like(t, _bhsd(g)) for t, g in zip((query, key, value), grads))


def flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten._scaled_dot_product_flash_attention``: ``(out like the query, lse [B, H, Sq] float32, None, None, Sq, Sk,
    rng seed uint64 [2], offset uint64 [], empty debug mask)``."""
    _check_dropout("flash attention", dropout_p)
    assert not return_debug_mask
    out, lse = _forward_heads_first(query, key, value, is_causal, scale)
    b, h, sq, _ = query.shape
    seed = torch.zeros(2, dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    lse = lse.to(lse_dtype(query)).contiguous()
    return _like(query, out), lse, None, None, sq, key.shape[2], seed, offset, debug


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):  # fmt: skip
    """``aten._scaled_dot_product_flash_attention_backward``: ``(dq, dk, dv)`` like the inputs, from the supplied
    ``out`` / ``logsumexp [B, H, Sq]``."""
    _check_dropout("flash attention backward", dropout_p)
    assert logsumexp.shape == query.shape[:3] and logsumexp.dtype == lse_dtype(query), logsumexp.shape
    assert (max_q, max_k) == (query.shape[2], key.shape[2])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = dense_backward(*(_bhsd(t) for t in (grad_out, query, key, value, out)), logsumexp, scale,
                           causal=is_causal)  # fmt: skip
    return tuple(_like(t, _bhsd(g)) for t, g in zip((query, key, value), grads))


ATEN_REFERENCES: dict = {
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: cudnn_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default: cudnn_attention_backward,
    torch.ops.aten._scaled_dot_product_flash_attention.default: flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_attention_backward,
}


@contextlib.contextmanager
def aten_references_on_cpu(record: Callable[[str], None] | None = None) -> Iterator[None]:
    """Inside: the references above are the CPU kernels of the four aten ops (``record(op name)`` per call)."""
    lib = torch.library.Library("aten", "IMPL")

    def recorded(name, fn):
        def run(*args, **kwargs):
            if record is not None:
                record(name)
            return fn(*args, **kwargs)

        return run

    try:
        for op, fn in ATEN_REFERENCES.items():
            name = op._schema.name.split("::")[1]
            lib.impl(name, recorded(name, fn), "CPU")
        yield
    finally:
        lib._destroy()


# ---- cudnn_blocks.CUDNN_OPS stand-in ---------------------------------------------------------------------------------


class CudnnStandIn:
    """``cudnn_blocks.CUDNN_OPS`` on the reference ops, recording each call (``"fwd"`` / ``"bwd"``) and bias.

    ``wrong``: a broken kernel (out * 1.5: a probe must catch it); ``raises``: the forward raises it; ``attn_bias``
    False: the forward's schema takes no ``attn_bias`` (as before torch 2.5; here the CPU flash op's, which names its
    mask ``attn_mask``). Otherwise the installed torch's schemas (they take ``attn_bias``, as torch 2.9+ has it)."""

    def __init__(self, wrong: bool = False, raises: Exception | None = None, attn_bias: bool = True) -> None:
        from hf_fpdt.attention.cudnn_blocks import CudnnOps

        self.biases: list[torch.Tensor | None] = []
        self.calls: list[str] = []
        self.wrong, self.raises = wrong, raises
        fwd_schema = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
        if not attn_bias:
            fwd_schema = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._schema
        bwd_schema = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema
        self.ops = CudnnOps(self._Op(self.forward, fwd_schema), self._Op(self.backward, bwd_schema))

    class _Op:
        def __init__(self, fn, schema) -> None:
            self.fn, self._schema = fn, schema

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    def forward(self, q, k, v, attn_bias, *args, **kwargs):
        if self.raises is not None:
            raise self.raises
        self.calls.append("fwd")
        self.biases.append(attn_bias)
        res = cudnn_attention(q, k, v, attn_bias, *args, **kwargs)
        return (res[0] * 1.5, *res[1:]) if self.wrong else res

    def backward(self, *args, **kwargs):
        self.calls.append("bwd")
        self.biases.append(args[8])
        return cudnn_attention_backward(*args, **kwargs)


# ---- flash-attn builds -----------------------------------------------------------------------------------------------


class Call(NamedTuple):
    """One call of a stand-in build: ``op`` "fwd" / "bwd"; ``varlen``; ``window`` ``(left, right)`` (``None``: a build
    without one); ``sq`` / ``sk`` the lengths (per sequence, a tuple, for a varlen call); ``backend``."""

    op: str
    varlen: bool
    causal: bool
    window: tuple | None
    sq: int | tuple
    sk: int | tuple
    backend: str


def flash_keep(n: int, m: int, causal: bool, left: int, right: int, device: torch.device | None = None) -> torch.Tensor:
    """flash-attn's mask of one ``n x m`` sequence (its docstring): row i keeps key j iff ``i + m - n - left <= j <=
    i + m - n + right`` (bottom-right aligned; a negative bound: none; ``causal``: ``right = 0``)."""
    if causal:
        right = 0
    i, j = torch.arange(n, device=device)[:, None], torch.arange(m, device=device)[None, :]
    keep = torch.ones(n, m, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i + m - n - left
    if right >= 0:
        keep &= j <= i + m - n + right
    return keep


def flash_forward(q, k, v, causal, scale, softcap=0.0, left=-1, right=-1, base=1.0):
    """flash-attn's dense forward in float64: ``(out in q's dtype, lse)``; a row with no key: ``out = 0``, ``lse =
    +inf`` as FA2 gives it (a dispatch that hands it such a row merges it wrongly and fails); ``base``: the lse's
    factor (``LOG2E``: a build returning it in base 2)."""
    s, _ = scores(q, k, scale, softcap, flash_keep(q.shape[1], k.shape[1], causal, left, right, q.device))
    lse = s.logsumexp(-1)
    p = torch.nan_to_num((s - lse[..., None]).exp())
    g = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(g, 2))
    lse = lse.masked_fill(torch.isneginf(lse), float("inf")) * base
    return out.to(q.dtype), lse.to(lse_dtype(q))


def flash_backward(dout, q, k, v, out, lse, causal, scale, softcap, left, right, dq, dk, dv):
    """flash-attn's dense backward from the supplied ``out, lse``, written into ``dq, dk, dv``."""
    keep = flash_keep(q.shape[1], k.shape[1], causal, left, right, q.device)
    for buf, g in zip((dq, dk, dv), dense_backward(dout, q, k, v, out, lse, scale, keep, softcap=softcap)):
        buf.copy_(g)


def _lengths(cu: torch.Tensor) -> list[int]:
    c = cu.tolist()
    return [b - a for a, b in zip(c, c[1:])]


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap, left, right, padded=False):
    """A varlen call (each sequence its own attention): ``(out [total_q, H, D], lse)``, ``lse [H, total_q]``, or
    ``[n, H, max_q]`` with ``padded`` (FA2 < 2.6)."""
    lq, lk = _lengths(cu_q), _lengths(cu_k)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and max_q == max(lq) and max_k == max(lk)
    assert q.shape[0] == sum(lq) and k.shape[0] == sum(lk)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out = q.new_zeros(q.shape)
    lse = torch.zeros(len(lq), q.shape[1], max_q, dtype=lse_dtype(q), device=q.device)
    flat = []
    for n, (a, b, c, d) in enumerate(zip(cq, cq[1:], ck, ck[1:])):
        o, row = flash_forward(q[None, a:b], k[None, c:d], v[None, c:d], causal, scale, softcap, left, right)
        out[a:b] = o[0]
        lse[n, :, : b - a] = row[0]
        flat.append(row[0])
    return out, (lse if padded else torch.cat(flat, 1))


def varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale, softcap, left, right,
                    padded=False):  # fmt: skip
    lq = _lengths(cu_q)
    assert lse.shape == ((len(lq), q.shape[1], max(lq)) if padded else (q.shape[1], q.shape[0])), lse.shape
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for n, (a, b, c, d) in enumerate(zip(cq, cq[1:], ck, ck[1:])):
        rows = lse[n, :, : b - a] if padded else lse[:, a:b]
        keep = flash_keep(b - a, d - c, causal, left, right, q.device)
        t = (dout, q, k, v, out)
        g = dense_backward(*(x[None, a:b] if i != 2 and i != 3 else x[None, c:d] for i, x in enumerate(t)), rows[None],
                           scale, keep, softcap=softcap)  # fmt: skip
        dq[a:b], dk[c:d], dv[c:d] = (x[0] for x in g)


FLASH_VERSIONS = ("2.2", "2.5", "2.6", "2.7", "2.7-op", "fa3", "fa3-2025", "fa3-beta", "fa3-base2")
"""The stand-in builds: FA2 2.2 (no window, no softcap), 2.5 (``window_size`` everywhere, no softcap, a padded varlen
lse ``[n, H, max_seqlen_q]``), 2.6 (softcap, ``window_size`` in the backward too), 2.7+ (``window_size_left/right`` in
the backwards, varlen lse ``[H, total_q]``), 2.7-op (the backward a ``torch.library.custom_op``, the func keyword-only
after ``dropout_p``; no varlen); FA3 as of late 2025 (positional-only, dense and varlen by ``cu_seqlens``), mid-2025
(17 positional parameters, dense only), the 2024 beta (returns ``(out, q, k, v, out_padded, lse, S_dmask)``, no
softcap) and a mid-2025 build whose lse is in base 2 (wrong: its probe must fail)."""

_CUSTOM_OP: list = []  # the 2.7-op backward, registered once per process (a custom op cannot be registered twice)


def _fa2_custom_op():
    if not _CUSTOM_OP:

        @torch.library.custom_op("hf_fpdt_test::fa2_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
        def fa2_backward(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            softmax_lse: torch.Tensor,
            dq: torch.Tensor,
            dk: torch.Tensor,
            dv: torch.Tensor,
            dropout_p: float,
            softmax_scale: float,
            causal: bool,
            window_size_left: int,
            window_size_right: int,
            softcap: float,
            alibi_slopes: torch.Tensor | None,
            deterministic: bool,
            rng_state: torch.Tensor | None = None,
        ) -> None:
            hook = _CUSTOM_OP[1]
            hook(dout, q, k, v, causal, (window_size_left, window_size_right), q.shape[1], k.shape[1])
            w = (window_size_left, window_size_right)
            flash_backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale, softcap, *w, dq, dk, dv)

        _CUSTOM_OP[:] = [fa2_backward, None]
    return _CUSTOM_OP[0]


def install_flash(monkeypatch, version: str, *, varlen: bool = True, calls: list | None = None,
                  record: Callable[[Call], object] | None = None) -> tuple[str, list]:  # fmt: skip
    """Put a stand-in build of ``version`` (:data:`FLASH_VERSIONS`) into ``sys.modules``: its backend name and the list
    its calls go to (``calls``, or a new one), each as ``record(call)`` (default the :class:`Call`; ``None`` from
    ``record``: not kept). ``varlen`` False: FA2 without ``flash_attn_varlen_func``."""
    seen: list = [] if calls is None else calls
    backend = "flash_attn3" if version.startswith("fa3") else "flash_attn"

    def note(op, causal, window, sq, sk, is_varlen=False):
        call = Call(op, is_varlen, causal, window, sq, sk, backend)
        item = call if record is None else record(call)
        if item is not None:
            seen.append(item)

    if backend == "flash_attn3":
        monkeypatch.setitem(sys.modules, "flash_attn_interface", _fa3(version, note))
        return backend, seen
    fa2, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    func, backward, vfunc, vbackward = _fa2(version, note)
    fa2.flash_attn_func, interface._flash_attn_backward = func, backward
    if varlen and vfunc is not None:
        fa2.flash_attn_varlen_func, interface._flash_attn_varlen_backward = vfunc, vbackward
    fa2.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    return backend, seen


def _dense_call(note, q, k, v, causal, scale, softcap, window, base=1.0):
    note("fwd", causal, window, q.shape[1], k.shape[1])
    return flash_forward(q, k, v, causal, scale, softcap, *(window or (-1, -1)), base=base)


def _dense_grads(note, dout, q, k, v, out, lse, causal, scale, softcap, window, dq, dk, dv):
    note("bwd", causal, window, q.shape[1], k.shape[1])
    flash_backward(dout, q, k, v, out, lse, causal, scale, softcap, *(window or (-1, -1)), dq, dk, dv)


def _varlen_call(note, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window, padded=False):
    note("fwd", causal, window, tuple(_lengths(cu_q)), tuple(_lengths(cu_k)), True)
    return varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap, *window, padded=padded)


def _varlen_grads(note, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale, softcap, window, padded=False):
    note("bwd", causal, window, tuple(_lengths(cu_q)), tuple(_lengths(cu_k)), True)
    varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale, softcap, *window, padded=padded)


def _fa2(version: str, note):  # noqa: C901 - one signature set per release
    """``(flash_attn_func, _flash_attn_backward, flash_attn_varlen_func, _flash_attn_varlen_backward)`` of a release."""
    vfunc = vbackward = None
    if version == "2.2":

        def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
            return (*_dense_call(note, q, k, v, causal, softmax_scale, 0.0, None), None)

        def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, rng_state=None):
            _dense_grads(note, dout, q, k, v, out, softmax_lse, causal, softmax_scale, 0.0, None, dq, dk, dv)

    elif version == "2.5":

        def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                 deterministic=False, return_attn_probs=False):  # fmt: skip
            return (*_dense_call(note, q, k, v, causal, softmax_scale, 0.0, tuple(window_size)), None)

        def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                     alibi_slopes, deterministic, rng_state=None):  # fmt: skip
            w = tuple(window_size)
            _dense_grads(note, dout, q, k, v, out, softmax_lse, causal, softmax_scale, 0.0, w, dq, dk, dv)

        def vfunc(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                  softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, block_table=None):  # fmt: skip
            args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, 0.0)
            return (*_varlen_call(note, q, k, v, *args, tuple(window_size), padded=True), None)

        def vbackward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      rng_state=None):  # fmt: skip
            args = (cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, 0.0, tuple(window_size))
            _varlen_grads(note, dout, q, k, v, out, softmax_lse, dq, dk, dv, *args, padded=True)

    elif version in ("2.6", "2.7"):

        def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
            assert dropout_p == 0.0 and return_attn_probs
            return (*_dense_call(note, q, k, v, causal, softmax_scale, softcap, tuple(window_size)), None)

        def vfunc(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, block_table=None):  # fmt: skip
            assert return_attn_probs
            args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, softcap)
            return (*_varlen_call(note, q, k, v, *args, tuple(window_size)), None)

        if version == "2.6":

            def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                         softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
                w = tuple(window_size)
                _dense_grads(note, dout, q, k, v, out, softmax_lse, causal, softmax_scale, softcap, w, dq, dk, dv)

            def vbackward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, rng_state=None):  # fmt: skip
                args = (cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, softcap, tuple(window_size))
                _varlen_grads(note, dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)

        else:

            def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None):  # fmt: skip
                w = (window_size_left, window_size_right)
                _dense_grads(note, dout, q, k, v, out, softmax_lse, causal, softmax_scale, softcap, w, dq, dk, dv)

            def vbackward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                          softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False):  # fmt: skip
                w = (window_size_left, window_size_right)
                args = (cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, softcap, w)
                _varlen_grads(note, dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)

    elif version == "2.7-op":
        backward = _fa2_custom_op()
        _CUSTOM_OP[1] = lambda dout, q, k, v, causal, w, sq, sk: note("bwd", causal, w, sq, sk)

        def func(q, k, v, dropout_p=0.0, *, softmax_scale=None, causal=False, softcap=0.0, **rest):
            assert rest == {"return_attn_probs": True} or not rest
            return (*_dense_call(note, q, k, v, causal, softmax_scale, softcap, (-1, -1)), None)

    else:
        raise ValueError(f"no stand-in flash-attn {version!r}; choose from {FLASH_VERSIONS}")
    return func, backward, vfunc, vbackward


def _fa3(version: str, note) -> types.ModuleType:
    """A stand-in ``flash_attn_interface`` of one FA3 generation (the entry points' signatures as released)."""
    mod = types.ModuleType("flash_attn_interface")
    if version == "fa3":

        def fwd(q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
                max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size_left,
                window_size_right, attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None,
                num_splits=1, pack_gqa=None, sm_margin=0, /):  # fmt: skip
            assert k_new is None and page_table is None
            w = (window_size_left, window_size_right)
            if cu_seqlens_q is None:
                assert cu_seqlens_k is None and max_seqlen_q is None
                return (*_dense_call(note, q, k, v, causal, softmax_scale, softcap, w), None, None)
            args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, softcap, w)
            return (*_varlen_call(note, q, k, v, *args), None, None)

        def bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right, softcap=0.0,
                deterministic=False, sm_margin=0, /):  # fmt: skip
            assert dq is not None
            w = (window_size_left, window_size_right)
            if cu_seqlens_q is None:
                _dense_grads(note, dout, q, k, v, out, softmax_lse, is_causal, softmax_scale, softcap, w, dq, dk, dv)
                return None
            args = (cu_seqlens_q, cu_seqlens_k, is_causal, softmax_scale, softcap, w)
            _varlen_grads(note, dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)
            return None

    elif version == "fa3-beta":  # 2024 beta: positional, (out, q, k, v, out_padded, softmax_lse, S_dmask), no softcap

        def fwd(q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None, descale_v=None, /):
            assert window_size == (-1, -1)
            out, lse = _dense_call(note, q, k, v, causal, softmax_scale, 0.0, (-1, -1))
            return out, q, k, v, out, lse, None

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size, deterministic, /):
            _dense_grads(note, dout, q, k, v, out, softmax_lse, causal, softmax_scale, 0.0, (-1, -1), dq, dk, dv)
            return dq, dk, dv, None

    elif version in ("fa3-2025", "fa3-base2"):  # mid-2025 torch-op style: positional only, is_causal in backward
        base = LOG2E if version == "fa3-base2" else 1.0

        def fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_size_left, window_size_right, softcap, num_splits=1, /):  # fmt: skip
            assert k_new is None and cu_seqlens_q is None and cu_seqlens_k is None  # dense only
            w = (window_size_left, window_size_right)
            return (*_dense_call(note, q, k, v, causal, softmax_scale, softcap, w, base), None, None)

        def bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                deterministic, sm_margin=0, /):  # fmt: skip
            assert cu_seqlens_q is None and cu_seqlens_k is None and not deterministic
            w = (window_size_left, window_size_right)
            _dense_grads(note, dout, q, k, v, out, softmax_lse, is_causal, softmax_scale, softcap, w, dq, dk, dv)

    else:
        raise ValueError(f"no stand-in FA3 {version!r}; choose from {FLASH_VERSIONS}")
    mod._flash_attn_forward, mod._flash_attn_backward = fwd, bwd
    return mod
