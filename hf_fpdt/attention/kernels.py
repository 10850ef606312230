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
document (:mod:`hf_fpdt.attention.block_mask`): the ``cpu_flash`` backend takes it as an additive mask, the others
run such blocks on ``math``. Query rows with no key in the block get ``out = 0``, ``lse = -inf`` (they
merge as nothing). ``softcap`` applies ``cap * tanh(s / cap)`` to the scaled scores (Gemma 2) before
the mask; no fused kernel here has it, so softcapped blocks always run on ``math`` (exact backward
through the tanh).

Backends, chosen by capability (:func:`select_backend`, first that can run, in this order) unless
named (``FPDTConfig.backend`` / ``FPDT_BACKEND``, checked by :func:`resolve_backend`):

* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward`` (which takes the
  supplied final out/lse); CUDA compute capability >= 9.0 (Hopper and newer), cuDNN >= 9, fp16/bf16,
  head dim a multiple of 8 up to 128. About 1.7x torch's flash kernel on an H100; GQA native.
* ``flash_attn3``: FlashAttention-3 (``flash_attn_interface``, the ``hopper/`` build) when installed;
  compute capability 9.x, fp16/bf16.
* ``flash_attn``: the ``flash-attn`` (FA2) package when installed; compute capability >= 8.0, fp16/bf16.
* ``torch_flash``: torch's own CUDA flash kernels; compute capability >= 8.0, fp16/bf16 (K/V heads
  expanded per block for GQA).
* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (a
  blockwise kernel; handles GQA itself).
* ``math``: explicit matmuls in float32 (float64 for float64 inputs) on any device; the float64
  reference of the tests and the fallback for float32/float64 on CUDA (its memory is O(Sq * Sk) per head).

Capabilities come from :func:`probe_device` (a :class:`DeviceCapability`); the selection functions
take one as an argument, so the choice is testable without the hardware.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..config import BACKENDS
from .precision import no_autocast

_PREFERENCE = {  # device type -> backends in order of preference (first that can run wins)
    "cuda": ("cudnn", "flash_attn3", "flash_attn", "torch_flash", "math"),
    "cpu": ("cpu_flash", "math"),
}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DeviceCapability:
    """What backend selection needs to know about a device.

    ``compute_capability``: CUDA (major, minor), ``None`` elsewhere; ``cudnn_version``: e.g. 90100,
    ``None`` without cuDNN; ``torch_cudnn_attention``: torch has the cuDNN attention ops;
    ``flash_attn`` / ``flash_attn3``: the FA2 / FA3 packages are importable.
    """

    device_type: str
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None
    torch_cudnn_attention: bool = False
    flash_attn: bool = False
    flash_attn3: bool = False


def probe_device(device: torch.device) -> DeviceCapability:
    """The :class:`DeviceCapability` of ``device`` (no kernel runs; a few driver queries on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceCapability(device.type)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return DeviceCapability(
        "cuda",
        compute_capability=tuple(torch.cuda.get_device_capability(device)),
        cudnn_version=cudnn,
        torch_cudnn_attention=hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"),
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
        flash_attn3=importlib.util.find_spec("flash_attn_interface") is not None,
    )


def backend_problem(
    name: str, capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why backend ``name`` cannot run blocks of ``dtype`` / ``head_dim`` on that device; ``None`` if it can."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; choose from {BACKENDS}"
    if name == "math":
        return None
    if name == "cpu_flash":
        return None if capability.device_type == "cpu" else f"needs a CPU device (found {capability.device_type})"
    if capability.device_type != "cuda":
        return f"needs a CUDA device (found {capability.device_type})"
    cc = capability.compute_capability or (0, 0)
    need_cc = {"cudnn": (9, 0), "flash_attn3": (9, 0), "flash_attn": (8, 0), "torch_flash": (8, 0)}[name]
    if cc < need_cc or (name == "flash_attn3" and cc[0] != 9):
        want = "9.x (Hopper)" if name == "flash_attn3" else f">= {need_cc[0]}.{need_cc[1]}"
        return f"needs CUDA compute capability {want} (found {cc[0]}.{cc[1]})"
    if dtype not in _HALF:
        return f"needs float16 or bfloat16 tensors (found {dtype}); the math backend runs float32/float64"
    max_dim = 128 if name == "cudnn" else 256
    if head_dim is not None and (head_dim % 8 != 0 or head_dim > max_dim):
        return f"needs a head dim that is a multiple of 8 and at most {max_dim} (found {head_dim})"
    if name == "cudnn":
        if not capability.torch_cudnn_attention:
            return "this torch build has no cuDNN attention ops (aten._scaled_dot_product_cudnn_attention)"
        if capability.cudnn_version is None or capability.cudnn_version < 90000:
            return f"needs cuDNN >= 9 (found {capability.cudnn_version})"
    if name == "flash_attn" and not capability.flash_attn:
        return "the flash-attn package is not installed (pip install 'hf_fpdt[flash]')"
    if name == "flash_attn3" and not capability.flash_attn3:
        return "FlashAttention-3 (flash_attn_interface, flash-attention's hopper/ build) is not installed"
    return None


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
) -> str:
    """The fastest exact backend for blocks of ``dtype`` (and ``head_dim``) on ``device``."""
    capability = capability or probe_device(device)
    for name in _PREFERENCE.get(capability.device_type, ("math",)):
        if backend_problem(name, capability, dtype, head_dim) is None:
            return name
    return "math"


def resolve_backend(
    requested: str | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
) -> str:
    """``requested`` (a name, or ``None`` / ``"auto"`` to select) checked against the device.

    Raises ``ValueError`` naming why a requested backend cannot run and which ones can.
    """
    capability = capability or probe_device(device)
    if requested in (None, "auto"):
        return select_backend(device, dtype, head_dim, capability)
    problem = backend_problem(requested, capability, dtype, head_dim)
    if problem is not None:
        usable = [n for n in BACKENDS if backend_problem(n, capability, dtype, head_dim) is None]
        raise ValueError(
            f"attention backend {requested!r} cannot run {dtype} blocks (head dim {head_dim}) on "
            f"{torch.device(device)}: {problem}. Set FPDTConfig.backend / FPDT_BACKEND to 'auto' or one of "
            f"{', '.join(usable)}"
        )
    return requested


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q [B, Sq, H, D] and k, v [B, Sk, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"q, k, v of a block must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype}); under torch.autocast "
            "cast them as sdpa does (hf_fpdt.attention.precision.sdpa_inputs)"
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


def _cudnn_forward(q, k, v, causal, scale):
    # [B, S, H, D] views transposed to [B, H, S, D]; cuDNN takes the strides as they are (no copy) and
    # allocates its output in the query's layout. lse comes back as [B, H, Sq, 1] float32.
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale
    )
    return res[0].transpose(1, 2), res[1].squeeze(-1)


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # The supplied final (out, lse) replace the block's own: the exact-contribution identity of the
    # module docstring. No dropout, so the philox seed/offset are placeholders; GQA is native.
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.unsqueeze(-1).contiguous(),  # [B, H, Sq, 1], as the forward returned it
        empty,
        empty,
        None,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_attn3_forward(q, k, v, causal, scale):
    from flash_attn_interface import _flash_attn_forward

    res = _flash_attn_forward(q, k, v, softmax_scale=scale, causal=causal)
    return res[0], res[1]


def _flash_attn3_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn_interface import _flash_attn_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # Positional: the first 17 parameters (no varlen, gradients written into dq/dk/dv) have kept their
    # order across FA3 releases while the names after them changed (causal / is_causal, window sizes).
    _flash_attn_backward(
        dout.contiguous(), q, k, v, out, lse.contiguous(), None, None, None, None, None, None, dq, dk, dv, scale, causal
    )
    return dq, dk, dv


_FORWARD = {
    "cudnn": _cudnn_forward,
    "flash_attn3": _flash_attn3_forward,
    "cpu_flash": _cpu_flash_forward,
    "flash_attn": _flash_attn_forward,
    "torch_flash": _torch_flash_forward,
    "math": _math_forward,
}
_BACKWARD = {
    "cudnn": _cudnn_backward,
    "flash_attn3": _flash_attn3_backward,
    "cpu_flash": _cpu_flash_backward,
    "flash_attn": _flash_attn_backward,
    "torch_flash": _torch_flash_backward,
    "math": _math_backward,
}


def _block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None) -> str:
    """Check a block's shapes and name its backend (``backend``, or the device's choice)."""
    _check(q, k, v)
    name = backend or select_backend(q.device, q.dtype, q.shape[-1])
    if name not in _FORWARD:  # _FORWARD and _BACKWARD name the same backends
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return name


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
    name = _block_backend(q, k, v, backend)
    with no_autocast(q.device.type):  # float32 accumulation stays float32 (hf_fpdt.attention.precision)
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
    name = _block_backend(q, k, v, backend)
    with no_autocast(q.device.type):
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


def merge_rows(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_block`, where a row that has seen no key yet (``lse = -inf``) takes the block as it is.

    For calls whose rows may see no key in a block (padding masks, a cache's padded keys, a rank's share
    of the keys): :func:`merge_block`'s ``sigmoid(lse_b - lse)`` is NaN for ``-inf - -inf``.
    """
    if out is None:
        return merge_block(None, None, block_out, block_lse)
    new_out, new_lse = merge_block(out, lse, block_out, block_lse)
    empty = torch.isneginf(lse)  # [B, H, sq]
    block_out, block_lse = merge_block(None, None, block_out, block_lse)
    return (
        torch.where(empty.transpose(1, 2).unsqueeze(-1), block_out, new_out),
        torch.where(empty, block_lse, new_lse),
    )
