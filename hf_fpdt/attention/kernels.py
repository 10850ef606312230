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
document (:mod:`hf_fpdt.attention.block_mask`), or a :class:`~hf_fpdt.attention.block_keep.BlockKeep` that builds
it a slice of query rows at a time (the chunk pipeline's form: no kernel path forms a whole block's mask): the
``cpu_flash`` backend takes it as an additive mask over query-row slices (at most ``scores_bytes`` of mask each);
on a flash-attn build (the backend, or with ``cudnn`` / ``torch_flash`` as the backend the build the runtime chose
for masked blocks: ``flash_build``, :meth:`~hf_fpdt.attention.runtime.FPDTRuntime.masked_flash`) a block cut by its
window alone runs as the rectangle of rows and keys that see anything with its bottom-right aligned ``window_size``
(:meth:`~hf_fpdt.attention.block_keep.BlockKeep.window_only`; FA2 >= 2.3, FA3), and a block cut by document
boundaries (with or without a window) as one varlen batch of its (batch row, document) segments
(:meth:`~hf_fpdt.attention.block_keep.BlockKeep.documents`; FA2's and FA3's varlen entry points), forward and
backward; with ``cudnn`` as the backend, every other masked block without a softcap runs on cuDNN with an additive
bias built a slice of query rows at a time (at most ``scores_bytes`` each; ``cudnn_bias``, where the runtime's masked
probe passed: :mod:`hf_fpdt.attention.cudnn_blocks`); every other masked block runs on ``math`` (the flash-attn
routes: :mod:`hf_fpdt.attention.flash_blocks`).
Query rows with no key in the block get ``out = 0``, ``lse = -inf`` (they merge as nothing). ``softcap`` applies
``cap * tanh(s / cap)`` to the scaled scores (Gemma 2) before the mask; a softcapped block runs on a flash-attn build
that takes one (FA2 >= 2.6, FA3) where its mask (none, a window's, documents') does too, every other softcapped block
on ``math`` (exact backward through the tanh).

``math`` (:mod:`hf_fpdt.attention.math_blocks`) never forms a block's whole ``[Sq, Sk]`` scores: it runs over
query-row slices of at most ``scores_bytes`` of fp32 scores (default: a quarter of the block's queries in fp32,
16-256 MiB), in forward and backward, with GQA folded into the rows (the query heads of one key/value head
stacked, so K/V are never repeated per head and the GQA gradient sum is the matmul's). So a masked or softcapped
block costs O(chunk) memory on every backend and device.

Backends, chosen by capability (:func:`select_backend`, first that can run, in this order) unless
named (``FPDTConfig.backend`` / ``FPDT_BACKEND``, checked by :func:`resolve_backend`):

* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward`` (which takes the
  supplied final out/lse); CUDA compute capability >= 9.0 (Hopper and newer), cuDNN >= 9, fp16/bf16,
  head dim a multiple of 8 up to 128. About 1.7x torch's flash kernel on an H100; GQA native. Masked blocks (no
  softcap) that no flash-attn build beside it takes run on it with an additive ``attn_bias`` over query-row slices
  where the installed op takes one in forward and backward (torch >= 2.5) and a masked probe block
  (:func:`probe_cudnn_bias`: a window cut, a padded key, an empty row, against ``math``) runs right, decided once per
  runtime (:func:`masked_cudnn`, :meth:`~hf_fpdt.attention.runtime.FPDTRuntime.masked_cudnn`), else on ``math``.
* ``flash_attn3``: FlashAttention-3 (``flash_attn_interface``, the ``hopper/`` build) when installed;
  compute capability 9.x, fp16/bf16.
* ``flash_attn``: the ``flash-attn`` (FA2) package when installed; compute capability >= 8.0, fp16/bf16.
* ``torch_flash``: torch's own CUDA flash kernels; compute capability >= 8.0, fp16/bf16 (K/V heads
  expanded per block for GQA).
* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (a
  blockwise kernel; handles GQA itself).
* ``math``: explicit matmuls in float32 (float64 for float64 inputs) on any device, over query-row slices
  (above); the float64 reference of the tests and the fallback for float32/float64 and masked blocks on CUDA.

Capabilities come from :func:`probe_device` (a :class:`DeviceCapability`); the selection functions
take one as an argument, so the choice is testable without the hardware. On the real device a fused CUDA
backend is chosen only once a tiny probe block (:func:`probe_backend`: forward and backward against ``math``)
runs right, else the next one, with one line on the ``hf_fpdt`` logger naming the choice and why. flash-attn's
entry points are called as the installed build declares them (:mod:`hf_fpdt.attention.flash_builds`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import BACKENDS
from ..distributed.all_to_all import repeat_heads, sum_repeated_heads
from ..memory.compat_torch import SDPA_OPS
from .block_keep import BlockKeep, DocSegments, WindowBand, mask_rows
from .cudnn_blocks import bias_problem, cudnn_backward, cudnn_forward, cudnn_masked_backward, cudnn_masked_forward
from .flash_blocks import (
    FLASH,
    SECOND,
    band_backward,
    band_forward,
    documents_backward,
    documents_forward,
    flash,
    flash_attn3_backward,
    flash_attn3_forward,
    flash_attn_backward,
    flash_attn_forward,
    masked_route,
)
from .flash_builds import FlashCalls, flash_calls
from .math_blocks import math_backward, math_forward, math_scores_bytes
from .precision import no_autocast

_PREFERENCE = {  # device type -> backends in order of preference (first that can run wins)
    "cuda": ("cudnn", "flash_attn3", "flash_attn", "torch_flash", "math"),
    "cpu": ("cpu_flash", "math"),
}
_HALF = (torch.float16, torch.bfloat16)
_log = logging.getLogger("hf_fpdt")


@dataclass(frozen=True)
class DeviceCapability:
    """What backend selection needs to know about a device.

    ``compute_capability``: CUDA (major, minor), ``None`` elsewhere; ``cudnn_version``: e.g. 90100,
    ``None`` without cuDNN; ``torch_cudnn_attention``: torch has the cuDNN attention ops;
    ``flash_attn`` / ``flash_attn3``: the FA2 / FA3 packages import and hf_fpdt can fill their entry points'
    parameters (:func:`hf_fpdt.attention.flash_builds.flash_calls`).
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
        torch_cudnn_attention=SDPA_OPS.cudnn_backward is not None,
        flash_attn=isinstance(flash_calls("flash_attn"), FlashCalls),  # imports, and its parameters are known
        flash_attn3=isinstance(flash_calls("flash_attn3"), FlashCalls),
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
        return "the flash-attn package is not installed or does not import (pip install 'hf_fpdt[flash]')"
    if name == "flash_attn3" and not capability.flash_attn3:
        return (
            "FlashAttention-3 (flash_attn_interface, flash-attention's hopper/ build) is not installed or does not "
            "import"
        )
    return None


_PROBED = ("cudnn", "flash_attn3", "flash_attn", "torch_flash")  # chosen only after a probe block runs right
PROBE_TOLERANCE = 0.05  # relative error of a half-precision probe block against the fp32 math path


def probe_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why backend ``name`` fails a tiny block on ``device`` (forward and backward, GQA 2:1, causal, against the
    float32 ``math`` path), or ``None`` where it computes it right: a build that imports but raises (a flash-attn
    wheel built for another torch), or returns another LSE (layout, dtype, base) fails here, not at the first real
    block."""
    device, d = torch.device(device), head_dim or 64
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 48, 2, d, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 48, 1, d, generator=g).to(device, dtype) for _ in range(2))
    scale = d**-0.5
    try:
        out, lse = block_forward(q, k, v, True, scale, name)
        grads = block_backward(dout, q, k, v, out, lse, True, scale, name)
    except Exception as err:  # any failure of an installed kernel means: not this one
        return f"its probe block raised {type(err).__name__}: {str(err)[:160]}"
    ref_out, ref_lse = block_forward(*(t.float() for t in (q, k, v)), True, scale, "math")
    ref_grads = block_backward(*(t.float() for t in (dout, q, k, v)), ref_out, ref_lse, True, scale, "math")
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(ref_lse.shape):
        return f"its log-sum-exp is {lse.dtype} {tuple(lse.shape)}, expected float32 {tuple(ref_lse.shape)}"
    lse_err = float((lse - ref_lse).abs().max())
    if lse_err > PROBE_TOLERANCE:
        base2 = float((lse - ref_lse * 1.4426950408889634).abs().max()) < PROBE_TOLERANCE
        return f"its log-sum-exp is off by {lse_err:.3g}" + (" (base 2, not e)" if base2 else "")
    for what, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))
        if not err <= PROBE_TOLERANCE:  # NaN included
            return f"its probe block's {what} is off by {err:.3g} (relative)"
    return None


def _prober(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> Callable[[str], str | None]:
    return lambda name: probe_backend(name, device, dtype, head_dim)


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Callable[[str], str | None] | None = None,
) -> str:
    """The fastest exact backend for blocks of ``dtype`` (and ``head_dim``) on ``device``: the first in order of
    preference that can run (:func:`backend_problem`) and, for the fused CUDA kernels, passes ``probe`` (default:
    :func:`probe_backend` on ``device`` when ``capability`` is probed here; none for a given ``capability``, which
    may describe another device). One line on the ``hf_fpdt`` logger names a fused kernel chosen, or any choice after
    a failed probe, and what was passed over (INFO; WARNING after a failed probe)."""
    if capability is None:
        capability = probe_device(device)
        probe = probe or _prober(device, dtype, head_dim)
    passed_over = []
    for name in _PREFERENCE.get(capability.device_type, ("math",)):
        problem = backend_problem(name, capability, dtype, head_dim)
        if problem is None and probe is not None and name in _PROBED:
            problem = probe(name)
            if problem is not None:
                problem = f"probe failed: {problem}"
        if problem is None:
            failed = any("probe failed" in p for p in passed_over)
            if name not in _PROBED and not failed:
                return name  # CPU's op, or math with nothing probed: no choice worth a line
            _log.log(
                logging.WARNING if failed else logging.INFO,
                "attention backend %r for %s blocks (head dim %s) on %s%s",
                name,
                dtype,
                head_dim,
                torch.device(device),
                f"; passed over: {'; '.join(passed_over)}" if passed_over else "",
            )
            return name
        passed_over.append(f"{name} ({problem})")
    return "math"


def resolve_backend(
    requested: str | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Callable[[str], str | None] | None = None,
) -> str:
    """``requested`` (a name, or ``None`` / ``"auto"`` to select) checked against the device (and, for a fused
    CUDA kernel, its probe block: see :func:`select_backend` for ``capability`` and ``probe``).

    Raises ``ValueError`` naming why a requested backend cannot run and which ones can.
    """
    if capability is None:
        capability = probe_device(device)
        probe = probe or _prober(device, dtype, head_dim)
    if requested in (None, "auto"):
        return select_backend(device, dtype, head_dim, capability, probe)
    problem = backend_problem(requested, capability, dtype, head_dim)
    if problem is None and probe is not None and requested in _PROBED:
        problem = probe(requested)
        problem = None if problem is None else f"probe failed: {problem}"
    if problem is not None:
        usable = [n for n in BACKENDS if backend_problem(n, capability, dtype, head_dim) is None]
        raise ValueError(
            f"attention backend {requested!r} cannot run {dtype} blocks (head dim {head_dim}) on "
            f"{torch.device(device)}: {problem}. Set FPDTConfig.backend / FPDT_BACKEND to 'auto' or one of "
            f"{', '.join(usable)}"
        )
    return requested


def masked_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Callable[[str], str | None] | None = None,
) -> str | None:
    """The flash-attn build that runs the masked and softcapped blocks of calls whose backend is ``backend``: itself
    where it is a flash-attn build; where it is ``cudnn`` or ``torch_flash`` (kernels without masks or a softcap), the
    first of ``flash_attn3``, ``flash_attn`` that can run here and passes ``probe`` (as :func:`select_backend`'s),
    with one INFO line on the ``hf_fpdt`` logger naming it; ``None`` otherwise (those blocks run on ``math``)."""
    if backend in FLASH:
        return backend
    if backend not in SECOND:
        return None
    if capability is None:
        capability = probe_device(device)
        probe = probe or _prober(device, dtype, head_dim)
    passed_over = []
    for name in FLASH[::-1]:  # flash_attn3 first, as _PREFERENCE
        problem = backend_problem(name, capability, dtype, head_dim)
        if problem is None and probe is not None:
            problem = probe(name)
        if problem is None:
            _log.info(
                "masked and softcapped %s blocks (head dim %s) on %s: %r (window-cut and document-cut blocks through "
                "its window / varlen calls), the rest on %r",
                dtype,
                head_dim,
                torch.device(device),
                name,
                backend,
            )
            return name
        passed_over.append(f"{name} ({problem})")
    _log.debug("masked blocks of %r stay on math: %s", backend, "; ".join(passed_over))
    return None


def probe_cudnn_bias(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why ``cudnn`` cannot run masked blocks with an additive bias on ``device``, or ``None`` where it can: the
    installed op must take ``attn_bias`` in forward and backward (:func:`~hf_fpdt.attention.cudnn_blocks.bias_problem`),
    and a masked probe block (GQA 2:1, causal with a window cut and a padded first key, so row 0 keeps no key; three
    row slices) must match the float32 ``math`` path: out, lse (``-inf`` on the empty row), dq, dk, dv."""
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
    lse_err = float((lse - ref_lse).nan_to_num(posinf=1.0, neginf=1.0).abs().max())
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) or not lse_err <= PROBE_TOLERANCE:
        return f"its masked probe block's log-sum-exp is off by {lse_err:.3g} (or -inf on other rows than math's)"
    for what, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))
        if not err <= PROBE_TOLERANCE:  # NaN included
            return f"its masked probe block's {what} is off by {err:.3g} (relative)"
    return None


def masked_cudnn(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    probe: Callable[[str], str | None] | None = None,
) -> bool:
    """Whether the masked blocks (no softcap) of calls whose backend is ``backend`` that no flash-attn build takes
    run on ``cudnn`` with an additive bias (:mod:`hf_fpdt.attention.cudnn_blocks`): only with ``cudnn`` as the
    backend and where ``probe`` (default :func:`probe_cudnn_bias` on ``device``; called with ``"cudnn"``) passes. One
    line on the ``hf_fpdt`` logger: INFO where they do, WARNING where the op takes a bias but its probe fails, DEBUG
    where this torch's op takes none (those blocks stay on ``math``)."""
    if backend != "cudnn":
        return False
    if probe is None:
        problem = probe_cudnn_bias(device, dtype, head_dim)
    else:
        problem = probe("cudnn")
    where = f"{dtype} blocks (head dim {head_dim}) on {torch.device(device)}"
    if problem is None:
        _log.info("masked %s: 'cudnn' with an additive bias over query-row slices", where)
        return True
    no_bias = bias_problem() is not None
    _log.log(logging.DEBUG if no_bias else logging.WARNING, "masked %s stay on math: %s", where, problem)
    return False


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


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[n, Sk]`` / ``[B, n, Sk]`` -> additive ``[1 | B, 1, n, Sk]`` in ``dtype`` (the op's form)."""
    m = mask if mask.dim() == 3 else mask.unsqueeze(0)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf")).unsqueeze(1)


def _mask_rows_per_slice(q: torch.Tensor, sk: int, scores_bytes: int | None) -> int:
    """Query rows per slice of a masked ``cpu_flash`` block: the slice's additive mask ``[B, 1, rows, Sk]`` in ``q``'s
    dtype fits ``scores_bytes`` (default :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes`, the ``math``
    kernel's bound; the op forms no scores of its own beyond its internal tiles), at least one row."""
    bound = math_scores_bytes(q) if scores_bytes is None else scores_bytes
    return max(1, bound // (q.shape[0] * max(sk, 1) * q.element_size()))


_CPU_FLASH = SDPA_OPS.cpu_flash
_CPU_FLASH_BACKWARD = SDPA_OPS.cpu_flash_backward


def _cpu_flash_forward(q, k, v, causal, scale, mask=None, scores_bytes=None):
    """torch's CPU flash op; with a ``mask`` (bool or a :class:`~hf_fpdt.attention.block_keep.BlockKeep`) over
    query-row slices whose additive mask fits ``scores_bytes``: rows are independent, so the slices' ``out`` and
    ``lse`` side by side are the block's, and no mask of the whole block is formed."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        out, lse = _CPU_FLASH(q.transpose(1, 2), kt, vt, 0.0, causal, scale=scale)[:2]
        return out.transpose(1, 2), lse
    b, sq, h, _ = q.shape
    out, lse = q.new_empty(q.shape), None
    rows = _mask_rows_per_slice(q, k.shape[1], scores_bytes)
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        keep = mask_rows(mask, r, n, q.device)
        o, rows_lse = _CPU_FLASH(
            q[:, r : r + n].transpose(1, 2), kt, vt, 0.0, False, attn_mask=_additive(keep, q.dtype), scale=scale
        )[:2]
        if lse is None:
            lse = torch.empty(b, h, sq, dtype=rows_lse.dtype, device=q.device)
        out[:, r : r + n] = o.transpose(1, 2)
        # the op reports lse 0 for a row with no key; it must merge as nothing
        empty = ~(keep if keep.dim() == 3 else keep.unsqueeze(0)).any(-1)  # [1 | B, n]
        lse[:, :, r : r + n] = rows_lse.masked_fill(empty.unsqueeze(1), float("-inf"))
        del keep, o, rows_lse
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None, scores_bytes=None):
    """The CPU flash op's backward; with a ``mask`` over the query-row slices of :func:`_cpu_flash_forward`: each
    slice's ``dq`` rows are exact, its ``dk, dv`` a sum over its rows (accumulated in float32, float64 for float64
    inputs, then in the inputs' dtype as the op returns them)."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)

    def grads(r: int, n: int) -> tuple[torch.Tensor, ...]:  # rows [r, r + n): dq rows, their dk and dv terms
        keep = None if mask is None else mask_rows(mask, r, n, q.device)
        res = _CPU_FLASH_BACKWARD(
            dout[:, r : r + n].transpose(1, 2),
            q[:, r : r + n].transpose(1, 2),
            kt,
            vt,
            out[:, r : r + n].transpose(1, 2),
            lse[:, :, r : r + n].contiguous(),
            0.0,
            causal and mask is None,
            attn_mask=None if keep is None else _additive(keep, q.dtype),
            scale=scale,
        )
        return tuple(g.transpose(1, 2) for g in res)

    sq = q.shape[1]
    rows = sq if mask is None else _mask_rows_per_slice(q, k.shape[1], scores_bytes)
    if rows >= sq:  # one slice: the op's own gradients
        return grads(0, sq)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
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


def _torch_flash_forward(q, k, v, causal, scale):
    groups = q.shape[2] // k.shape[2]
    res = SDPA_OPS.flash(
        q.transpose(1, 2),
        repeat_heads(k, groups).transpose(1, 2),
        repeat_heads(v, groups).transpose(1, 2),
        0.0,
        causal,
        False,
        scale=scale,
    )
    return res[0].transpose(1, 2), _checked_lse(res[1], q, "torch_flash")


def _checked_lse(lse: torch.Tensor, q: torch.Tensor, name: str) -> torch.Tensor:
    """``lse`` as every backend returns it: float32 ``[B, H, Sq]`` (float64 for float64 inputs, as on ``math``;
    natural log: :func:`probe_backend` checks the base once); anything else is a kernel build hf_fpdt does not know,
    refused before it is merged."""
    want, dtype = (q.shape[0], q.shape[2], q.shape[1]), torch.float64 if q.dtype == torch.float64 else torch.float32
    if lse.dtype != dtype or tuple(lse.shape) != want:
        raise RuntimeError(f"{name}: log-sum-exp {lse.dtype} {tuple(lse.shape)}, expected {dtype} {want}")
    return lse


def _torch_flash_backward(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[2] // k.shape[2]
    ke, ve = repeat_heads(k, groups), repeat_heads(v, groups)
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = SDPA_OPS.flash_backward(
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
    dk, dv = (sum_repeated_heads(g.transpose(1, 2), groups) for g in (dk, dv))
    return dq.transpose(1, 2), dk, dv


def _cudnn_forward(q, k, v, causal, scale):
    out, lse = cudnn_forward(q, k, v, causal, scale)
    return out, _checked_lse(lse, q, "cudnn")


_FORWARD = {
    "cudnn": _cudnn_forward,
    "flash_attn3": flash_attn3_forward,
    "cpu_flash": _cpu_flash_forward,
    "flash_attn": flash_attn_forward,
    "torch_flash": _torch_flash_forward,
    "math": math_forward,
}
_BACKWARD = {
    "cudnn": cudnn_backward,
    "flash_attn3": flash_attn3_backward,
    "cpu_flash": _cpu_flash_backward,
    "flash_attn": flash_attn_backward,
    "torch_flash": _torch_flash_backward,
    "math": math_backward,
}


def _block_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None) -> str:
    """Check a block's shapes and name its backend (``backend``, or the device's choice)."""
    _check(q, k, v)
    name = backend or select_backend(q.device, q.dtype, q.shape[-1])
    if name not in _FORWARD:  # _FORWARD and _BACKWARD name the same backends
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return name


def value_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, Callable] | None:
    """Where v's head dim differs from q/k's (multi-head latent attention: DeepSeek's 192 against 128), the width
    every block kernel sees and the zero-padding to it; ``None`` where they agree. Exact: a zero column of q/k adds
    nothing to a score, a zero column of v gives a zero output column (and, with a zero ``dout`` column, nothing to
    backward's ``rowsum(dout * out)``); the padded columns are cut off the results."""
    if q.dim() != 4 or v.dim() != 4 or v.shape[-1] == q.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        return None
    width = max(q.shape[-1], v.shape[-1])
    return width, lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str | None = None,
    *,
    mask: torch.Tensor | BlockKeep | None = None,
    softcap: float | None = None,
    scores_bytes: int | None = None,
    flash_build: FlashCalls | None = None,
    cudnn_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out [B, Sq, Hq, D], lse [B, Hq, Sq])`` (``mask``, ``softcap``: module doc).

    ``scores_bytes``: the bound on one slice of fp32 scores where the block runs on ``math``, and on one slice's
    additive mask on ``cpu_flash`` with a mask (default :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes` of
    ``q``). ``flash_build``: the flash-attn build the runtime resolved
    (:meth:`~hf_fpdt.attention.runtime.FPDTRuntime.masked_flash`): the backend's own where ``backend`` is a flash-attn
    one (not read again per block), or the one ``cudnn`` / ``torch_flash`` blocks with a mask or softcap go to;
    ``None``: a flash-attn backend's build is read per call, and ``cudnn`` / ``torch_flash`` leave such blocks to
    ``math``. ``cudnn_bias``: with ``cudnn`` as the backend, its masked blocks without a softcap that no flash-attn
    build takes run on cuDNN with an additive bias over query-row slices of at most ``scores_bytes``
    (:mod:`hf_fpdt.attention.cudnn_blocks`; :meth:`~hf_fpdt.attention.runtime.FPDTRuntime.masked_cudnn` decides it
    once, after a masked probe block); ``False``: they run on ``math``."""
    padded = value_width(q, k, v)
    if padded is not None:  # v narrower (or wider) than q/k: every kernel on one width, v's columns kept
        _, pad = padded
        kw = {"mask": mask, "softcap": softcap, "scores_bytes": scores_bytes, "flash_build": flash_build}
        kw["cudnn_bias"] = cudnn_bias
        out, lse = block_forward(pad(q), pad(k), pad(v), causal, scale, backend, **kw)
        return out[..., : v.shape[-1]], lse
    name = _block_backend(q, k, v, backend)
    with no_autocast(q.device.type):  # float32 accumulation stays float32 (hf_fpdt.attention.precision)
        plan = None
        if mask is not None or softcap is not None:
            name, plan = masked_route(name, mask, softcap, flash_build, cudnn_bias)
        if name == "math":
            return math_forward(q, k, v, causal, scale, mask, softcap, scores_bytes)
        if name in FLASH:
            calls = flash(name, flash_build)
            if isinstance(plan, WindowBand):
                return band_forward(calls, q, k, v, scale, plan, softcap)
            if isinstance(plan, DocSegments):
                return documents_forward(calls, q, k, v, scale, plan, softcap)
            return calls.forward(q, k, v, causal, scale, softcap or 0.0)
        if mask is not None and name == "cudnn":
            return cudnn_masked_forward(q, k, v, scale, mask, scores_bytes)
        if mask is not None:
            return _cpu_flash_forward(q, k, v, causal, scale, mask, scores_bytes)
        return _FORWARD[name](q, k, v, causal, scale)


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
    mask: torch.Tensor | BlockKeep | None = None,
    softcap: float | None = None,
    scores_bytes: int | None = None,
    flash_build: FlashCalls | None = None,
    cudnn_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact ``(dq, dk, dv)`` of one block given the query rows' *final* ``out`` and ``lse`` (``flash_build``,
    ``cudnn_bias``: as :func:`block_forward`'s)."""
    padded = value_width(q, k, v)
    if padded is not None:  # see block_forward
        _, pad = padded
        kw = {"mask": mask, "softcap": softcap, "scores_bytes": scores_bytes, "flash_build": flash_build}
        kw["cudnn_bias"] = cudnn_bias
        dq, dk, dv = block_backward(pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal, scale, backend, **kw)
        return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]
    name = _block_backend(q, k, v, backend)
    with no_autocast(q.device.type):
        plan = None
        if mask is not None or softcap is not None:
            name, plan = masked_route(name, mask, softcap, flash_build, cudnn_bias)
        if name == "math":
            return math_backward(dout, q, k, v, out, lse, causal, scale, mask, softcap, scores_bytes)
        if name in FLASH:
            calls = flash(name, flash_build)
            if isinstance(plan, WindowBand):
                return band_backward(calls, dout, q, k, v, out, lse, scale, plan, softcap)
            if isinstance(plan, DocSegments):
                return documents_backward(calls, dout, q, k, v, out, lse, scale, plan, softcap)
            return calls.backward(dout, q, k, v, out, lse, causal, scale, softcap or 0.0)
        if mask is not None and name == "cudnn":
            return cudnn_masked_backward(dout, q, k, v, out, lse, scale, mask, scores_bytes)
        if mask is not None:
            return _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask, scores_bytes)
        return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)
