"""A block's route to a kernel, decided in one place: the :class:`Router` of a (device, dtype, head dim).

Every kernel works on the sequence-major layout the chunk pipeline uses (:mod:`hf_fpdt.attention.block_kernel`)::

    q    [B, Sq, Hq, D]      k, v [B, Sk, Hkv, D]      (Hq a multiple of Hkv: MHA, GQA, MQA)
    out  [B, Sq, Hq, D]      lse  [B, Hq, Sq]  (float32; float64 for float64 inputs)

``Router.forward`` returns the block's normalised output and its log-sum-exp. ``Router.backward`` takes the *final*
output and log-sum-exp of the query rows (merged over all key/value blocks they attend to): with those,
``P = exp(q k^T * scale - lse)`` is the true softmax restricted to the block and ``rowsum(dout * out)`` the true
correction term, so the returned ``dq, dk, dv`` are exact contributions of this block (the same identity ring
attention relies on). So the forward and the backward of one block may run on different kernels.

``causal=True`` means the top-left aligned causal mask, used only for the diagonal block where the query and key
chunks cover the same tokens. ``mask`` (bool ``[Sq, Sk]`` or ``[B, Sq, Sk]``, True = attend; replaces ``causal``) is
the pattern of a block only partly inside a sliding window or a document (:mod:`hf_fpdt.attention.block_mask`), or a
:class:`~hf_fpdt.attention.block_keep.BlockKeep` that builds it a slice of query rows at a time (the chunk pipeline's
form). ``softcap`` applies ``cap * tanh(s / cap)`` to the scaled scores (Gemma 2) before the mask. Query rows with no
key in the block get ``out = 0``, ``lse = -inf`` (they merge as nothing).

The route of a block (:meth:`Router.route`), in this order:

1. no mask, no softcap: the router's kernel (its :attr:`Router.backend`);
2. a mask or a softcap that the router's flash-attn build takes (:attr:`Router.flash`: the backend's own build, or
   with ``cudnn`` / ``torch_flash`` as the backend a build probed beside it): a window-cut block as its band, a
   document-cut block through the varlen calls, a softcap where the build has one
   (:func:`~hf_fpdt.attention.flash_blocks.flash_plan`);
3. a mask without a softcap on the backend's own masked entry points where it has them: ``cpu_flash`` (additive mask
   over row slices), ``cudnn`` where :attr:`Router.cudnn_bias` (its masked probe passed: an additive bias over row
   slices);
4. everything else on ``math`` (query-row slices of at most ``scores_bytes`` of fp32 scores, any device).

The router is resolved once per runtime and (device, dtype, head dim) (:func:`resolve_router`,
:meth:`hf_fpdt.attention.runtime.FPDTRuntime.router`) and taken by the chunked, cached (generation) and compiled
paths alike. The backend is chosen by capability in the registry's order of preference unless named
(``FPDTConfig.backend`` / ``FPDT_BACKEND``): ``select_backend`` / ``resolve_backend`` of
:mod:`hf_fpdt.attention.kernels`; a fused CUDA kernel only after its probe block runs right, with one line on the
``hf_fpdt`` logger naming the choice and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .block_keep import BlockKeep, DocSegments, WindowBand
from .block_kernel import DeviceCapability, probe_mismatch
from .cudnn_blocks import bias_problem, probe_cudnn_bias
from .flash_blocks import (
    FLASH,
    SECOND,
    band_backward,
    band_forward,
    documents_backward,
    documents_forward,
    flash,
    flash_plan,
)
from .flash_builds import FlashCalls, flash_calls
from .kernels import KERNELS, Probe, backend_problem, kernel, probe_device, prober, resolve_backend, select_backend
from .math_blocks import math_backward, math_forward
from .precision import no_autocast

_log = logging.getLogger("hf_fpdt")

Plan = WindowBand | DocSegments | None


@dataclass(frozen=True)
class Router:
    """Where the blocks of one (device, dtype, head dim) run (module doc).

    Attributes:
        backend: the kernel of dense and causal blocks (a registry name, :data:`hf_fpdt.config.BACKENDS`).
        flash: the flash-attn build that takes the window-cut, document-cut and softcapped blocks it can (the
            backend's own where that is a flash-attn kernel, else one probed beside ``cudnn`` / ``torch_flash``), or
            ``None``.
        cudnn_bias: with ``cudnn`` as the backend, its masked blocks without a softcap that ``flash`` does not take
            run on cuDNN with an additive bias (its masked probe passed); else on ``math``.
    """

    backend: str
    flash: FlashCalls | None = None
    cudnn_bias: bool = False
    off: frozenset = frozenset()  # kinds of blocks (:func:`block_kind`) sent to math: their probe failed
    failed: set = field(default_factory=set, compare=False, repr=False)  # kinds that raised on a real block

    def __post_init__(self) -> None:
        kernel(self.backend)  # an unknown name is an error here, not at the first block

    def route(self, mask: torch.Tensor | BlockKeep | None, softcap: float | None) -> tuple[str, Plan]:
        """The kernel a block with ``mask`` / ``softcap`` runs on, and the plan it runs with (a window band, the
        documents' segments, or ``None``: a plain call); ``math`` for a kind of block whose probe failed or that
        raised on a real block (:attr:`off`, :attr:`failed`)."""
        name, plan = self._fused(mask, softcap)
        if name != "math" and (self.off or self.failed):
            kind = block_kind(name, plan, mask, softcap)
            if kind in self.off or kind in self.failed:
                return "math", None
        return name, plan

    def _fused(self, mask, softcap) -> tuple[str, Plan]:
        if mask is None and softcap is None:
            return self.backend, None
        calls = self._build()
        if calls is not None:
            plan = flash_plan(calls, mask, softcap)
            if plan is not False:
                return calls.backend, plan
        own = KERNELS[self.backend]
        if mask is not None and own.masked_forward is not None and (softcap is None or own.softcap):
            if not own.masked_probed or (self.backend == "cudnn" and self.cudnn_bias):
                return self.backend, None
        return "math", None

    def _fallback(self, err: RuntimeError, name: str, plan: Plan, mask, softcap) -> None:
        """A fused kernel raised on a real block: its kind runs on ``math`` from now on (one WARNING line); an error
        of ``math`` itself, or running out of memory, is the caller's."""
        if name == "math" or isinstance(err, torch.OutOfMemoryError):
            raise err
        kind = block_kind(name, plan, mask, softcap)
        self.failed.add(kind)
        _log.warning("%s blocks on %r raised %s: %s; they run on math from now on", kind, name, type(err).__name__, err)

    def _build(self) -> FlashCalls | None:
        """The flash-attn build of masked blocks: :attr:`flash`, or the backend's own installed build (read now) where
        the backend is a flash-attn kernel and the router was made without one."""
        if self.backend in FLASH:
            return flash(self.backend, self.flash)
        return self.flash if self.backend in SECOND else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        *,
        mask: torch.Tensor | BlockKeep | None = None,
        softcap: float | None = None,
        scores_bytes: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one block: ``(out [B, Sq, Hq, D], lse [B, Hq, Sq])``. ``scores_bytes``: the bound on one
        query-row slice of fp32 scores (``math``) or of an additive mask / bias (``cpu_flash``, ``cudnn``)."""
        padded = value_width(q, k, v)
        if padded is not None:  # v narrower (or wider) than q/k: every kernel on one width, v's columns kept
            _, pad = padded
            kw = {"mask": mask, "softcap": softcap, "scores_bytes": scores_bytes}
            out, lse = self.forward(pad(q), pad(k), pad(v), causal, scale, **kw)
            return out[..., : v.shape[-1]], lse
        _check(q, k, v)
        name, plan = self.route(mask, softcap)
        # the build, read once per block (no build installed: the caller's error, not a kernel failing on a block)
        calls = flash(name, self._build()) if name in FLASH else None
        try:
            return self._forward(name, plan, calls, q, k, v, causal, scale, mask, softcap, scores_bytes)
        except RuntimeError as err:
            self._fallback(err, name, plan, mask, softcap)
        return self._forward("math", None, None, q, k, v, causal, scale, mask, softcap, scores_bytes)

    def _forward(self, name, plan, calls, q, k, v, causal, scale, mask, softcap, scores_bytes):
        with no_autocast(q.device.type):  # float32 accumulation stays float32 (hf_fpdt.attention.precision)
            if name in FLASH:
                if isinstance(plan, WindowBand):
                    return band_forward(calls, q, k, v, scale, plan, softcap)
                if isinstance(plan, DocSegments):
                    return documents_forward(calls, q, k, v, scale, plan, softcap)
                return calls.forward(q, k, v, causal, scale, softcap or 0.0)
            chosen = KERNELS[name]
            if mask is None and softcap is None and not chosen.softcap:  # math's one entry takes scores_bytes
                return chosen.forward(q, k, v, causal, scale)
            return chosen.masked_forward(q, k, v, causal, scale, mask, softcap, scores_bytes)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        *,
        mask: torch.Tensor | BlockKeep | None = None,
        softcap: float | None = None,
        scores_bytes: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exact ``(dq, dk, dv)`` of one block given the query rows' *final* ``out`` and ``lse``."""
        padded = value_width(q, k, v)
        if padded is not None:  # see forward
            _, pad = padded
            kw = {"mask": mask, "softcap": softcap, "scores_bytes": scores_bytes}
            dq, dk, dv = self.backward(pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal, scale, **kw)
            return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]
        _check(q, k, v)
        name, plan = self.route(mask, softcap)
        calls = flash(name, self._build()) if name in FLASH else None  # read once per block, as forward's
        args = (dout, q, k, v, out, lse, causal, scale, mask, softcap, scores_bytes)
        try:
            return self._backward(name, plan, calls, *args)
        except RuntimeError as err:
            self._fallback(err, name, plan, mask, softcap)
        return self._backward("math", None, None, *args)

    def _backward(self, name, plan, calls, dout, q, k, v, out, lse, causal, scale, mask, softcap, scores_bytes):
        with no_autocast(q.device.type):
            if name in FLASH:
                if isinstance(plan, WindowBand):
                    return band_backward(calls, dout, q, k, v, out, lse, scale, plan, softcap)
                if isinstance(plan, DocSegments):
                    return documents_backward(calls, dout, q, k, v, out, lse, scale, plan, softcap)
                return calls.backward(dout, q, k, v, out, lse, causal, scale, softcap or 0.0)
            chosen = KERNELS[name]
            if mask is None and softcap is None and not chosen.softcap:
                return chosen.backward(dout, q, k, v, out, lse, causal, scale)
            return chosen.masked_backward(dout, q, k, v, out, lse, causal, scale, mask, softcap, scores_bytes)

    def takes_additive_on_cpu(self, q: torch.Tensor, softcap: float | None) -> bool:
        """Whether a block under a caller's explicit 4D mask (generation's ``masked_block``) runs on CPU's flash op
        with the mask made additive a row slice at a time (else on ``math``): on the CPU, ``cpu_flash`` the backend,
        no softcap."""
        return q.device.type == "cpu" and self.backend == "cpu_flash" and softcap is None


def block_kind(name: str, plan: Plan, mask, softcap) -> str:
    """The kind of a block on fused kernel ``name``, as its probe and its fallback name it: ``"dense"``,
    ``"window band"``, ``"documents"``, ``"softcap"`` (a flash-attn build's plain call with one) or ``"masked"`` (a
    kernel's own masked entry points: ``cudnn``'s bias, ``cpu_flash``'s additive mask)."""
    if isinstance(plan, WindowBand):
        return "window band"
    if isinstance(plan, DocSegments):
        return "documents"
    if mask is not None:
        return "masked"
    return "softcap" if softcap is not None else "dense"


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


def value_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, Callable] | None:
    """Where v's head dim differs from q/k's (multi-head latent attention: DeepSeek's 192 against 128), the width
    every block kernel sees and the zero-padding to it; ``None`` where they agree. Exact: a zero column of q/k adds
    nothing to a score, a zero column of v gives a zero output column (and, with a zero ``dout`` column, nothing to
    backward's ``rowsum(dout * out)``); the padded columns are cut off the results."""
    if q.dim() != 4 or v.dim() != 4 or v.shape[-1] == q.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        return None
    width = max(q.shape[-1], v.shape[-1])
    return width, lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t


# --- resolution: once per runtime and (device, dtype, head dim) ---------------------------------------------------


def masked_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Probe | None = None,
) -> str | None:
    """The flash-attn build that runs the masked and softcapped blocks of calls whose backend is ``backend``: itself
    where it is a flash-attn build; where it is ``cudnn`` or ``torch_flash`` (kernels without masks or a softcap), the
    first of ``flash_attn3``, ``flash_attn`` that can run here and passes ``probe`` (as ``kernels.select_backend``'s),
    with one INFO line on the ``hf_fpdt`` logger naming it; ``None`` otherwise (those blocks run on ``math``)."""
    if backend in FLASH:
        return backend
    if backend not in SECOND:
        return None
    if capability is None:
        capability = probe_device(device)
        probe = probe or prober(device, dtype, head_dim)
    passed_over = []
    for name in FLASH[::-1]:  # flash_attn3 first, as the order of preference
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


def masked_cudnn(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    probe: Probe | None = None,
) -> bool:
    """Whether the masked blocks (no softcap) of calls whose backend is ``backend`` that no flash-attn build takes
    run on ``cudnn`` with an additive bias (:mod:`hf_fpdt.attention.cudnn_blocks`): only with ``cudnn`` as the
    backend and where ``probe`` (default :func:`~hf_fpdt.attention.cudnn_blocks.probe_cudnn_bias` on ``device``;
    called with ``"cudnn"``) passes. One line on the ``hf_fpdt`` logger: INFO where they do, WARNING where the op takes
    a bias but its probe fails, DEBUG where this torch's op takes none (those blocks stay on ``math``)."""
    if backend != "cudnn":
        return False
    problem = probe_cudnn_bias(device, dtype, head_dim) if probe is None else probe("cudnn")
    where = f"{dtype} blocks (head dim {head_dim}) on {torch.device(device)}"
    if problem is None:
        _log.info("masked %s: 'cudnn' with an additive bias over query-row slices", where)
        return True
    no_bias = bias_problem() is not None
    _log.log(logging.DEBUG if no_bias else logging.WARNING, "masked %s stay on math: %s", where, problem)
    return False


def probe_blocks(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> list[tuple[str, dict]]:
    """The probe blocks of each kind a fused route may take, as ``(what, block_forward keywords)`` over inputs ``[2, 48,
    2 | 1, D]`` (batch 2, GQA 2:1): a causal diagonal block; a softcapped one; a block cut by its window alone (keys
    0..47 against queries 64..111, window 40: a band, rows that see nothing); a document-cut diagonal block (other
    boundaries per batch row, a window); a window cut over 40 keys (a mask without a batch: a stride-0 batch bias whose
    row stride is padded past 40) and padded keys per batch row (a batch bias)."""
    device = torch.device(device)
    ids = torch.tensor([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])
    keys = torch.ones(2, 40, dtype=torch.bool)
    keys[0, :5] = False
    keys[1, 30:] = False
    docs = BlockKeep(0, 0, 48, 48, causal=True, window=30, docs_q=ids.to(device), docs_k=ids.to(device))
    return [
        ("dense", {"causal": True}),
        ("softcap", {"causal": True, "softcap": 30.0}),
        ("window band", {"mask": BlockKeep(64, 0, 48, 48, window=40)}),
        ("documents", {"mask": docs}),
        ("masked", {"mask": BlockKeep(64, 0, 48, 40, window=40)}),
        ("masked", {"mask": BlockKeep(0, 0, 48, 40, causal=True, keys=keys.to(device))}),
    ]


def probe_kinds(router: Router, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> dict[str, str]:
    """Why each kind of block ``router`` sends to a fused kernel fails its probe block (:func:`probe_blocks`: forward
    and backward against the float32 ``math`` path, :func:`~hf_fpdt.attention.block_kernel.probe_mismatch`), by kind
    (:func:`block_kind`); a kind absent passed or stays on a kernel that needs no probe (``math``, ``cpu_flash``)."""
    if not (KERNELS[router.backend].probed or router.backend in FLASH or router.flash is not None):
        return {}  # nothing fused to probe (math, cpu_flash): no probe block is even built
    device, d = torch.device(device), head_dim or 64
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, 48, 2, d, generator=g).to(device, dtype) for _ in range(2))
    k48, v48 = (torch.randn(2, 48, 1, d, generator=g).to(device, dtype) for _ in range(2))
    problems: dict[str, str] = {}
    for what, kw in probe_blocks(device, dtype, head_dim):
        mask, softcap, causal = kw.get("mask"), kw.get("softcap"), kw.get("causal", False)
        name, plan = router._fused(mask, softcap)
        kind = block_kind(name, plan, mask, softcap)
        if name == "math" or not (name in FLASH or KERNELS[name].probed) or kind in problems:
            continue
        sk = mask.sk if mask is not None else 48
        k, v = k48[:, :sk], v48[:, :sk]
        scale = d**-0.5
        with no_autocast(device.type):
            try:
                calls = flash(name, router._build()) if name in FLASH else None
                out, lse = router._forward(name, plan, calls, q, k, v, causal, scale, mask, softcap, None)
                final = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows with no key, as the pipeline
                grads = router._backward(
                    name, plan, calls, dout, q, k, v, out, final, causal, scale, mask, softcap, None
                )
            except Exception as err:  # any failure of the installed kernel means: this kind on math
                problems[kind] = f"its {what} probe block raised {type(err).__name__}: {str(err)[:160]}"
                continue
            f = [t.float() for t in (dout, q, k, v)]
            ref_out, ref_lse = math_forward(*f[1:], causal, scale, mask, softcap)
            ref_final = ref_lse.masked_fill(torch.isneginf(ref_lse), float("inf"))
            ref_grads = math_backward(*f, ref_out, ref_final, causal, scale, mask, softcap)
        problem = probe_mismatch(f"{what} probe block's ", (out, lse, *grads), (ref_out, ref_lse, *ref_grads))
        if problem is not None:
            problems[kind] = problem
    return problems


def resolve_router(
    requested: str | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    kinds: Callable[..., dict[str, str]] | None = None,
) -> Router:
    """The :class:`Router` of ``dtype`` blocks of ``head_dim`` on ``device``: the backend (``kernels.resolve_backend``;
    ``requested`` a name, or ``None`` / ``"auto"``), the flash-attn build of its masked blocks
    (:func:`masked_backend`, its entry points read once) and whether ``cudnn`` takes the rest with a bias
    (:func:`masked_cudnn`), each probed and logged once; on a GPU, each kind of block the router then sends to a fused
    kernel is probed on its own block (:func:`probe_kinds`: batch 2, a stride-0 and a padded bias, a window band,
    documents, a softcap), and a kind that fails runs on ``math`` (one WARNING line naming it and why). ``kinds``:
    that probe (default :func:`probe_kinds` off the CPU, none on it)."""
    backend = resolve_backend(requested, device, dtype, head_dim)
    name = masked_backend(backend, device, dtype, head_dim)
    calls = None if name is None else flash_calls(name)
    calls = calls if isinstance(calls, FlashCalls) else None
    router = Router(backend, calls, masked_cudnn(backend, device, dtype, head_dim))
    if kinds is None and torch.device(device).type != "cpu":  # on the CPU nothing fused needs a probe
        kinds = probe_kinds
    problems = kinds(router, device, dtype, head_dim) if kinds is not None else {}
    if not problems:
        return router
    _log.warning(
        "%s blocks (head dim %s) on %s: %s run on math (%s)",
        dtype,
        head_dim,
        torch.device(device),
        ", ".join(sorted(problems)),
        "; ".join(f"{kind}: {why}" for kind, why in sorted(problems.items())),
    )
    return replace(router, off=frozenset(problems))


def block_router(
    q: torch.Tensor, backend: str | None = None, flash_build: FlashCalls | None = None, cudnn_bias: bool = False
) -> Router:
    """A router for one call of :func:`block_forward` / :func:`block_backward`: ``backend`` (``None``: the device's
    choice, ``kernels.select_backend``), its flash-attn build ``flash_build`` (``None``: a flash-attn backend's build is
    read per call, and ``cudnn`` / ``torch_flash`` leave masked blocks to ``math``), ``cudnn_bias`` as the
    :class:`Router`'s. Nothing is probed beyond the backend's selection: a test's or a bench's fixed route."""
    name = backend or select_backend(q.device, q.dtype, q.shape[-1])
    if name in FLASH:  # its installed build, read once for the call (not again by each route and kernel call)
        flash_build = flash(name, flash_build)
    return Router(name, flash_build, cudnn_bias)


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
    """One block on the route of :func:`block_router` (``backend``, ``flash_build``, ``cudnn_bias``):
    :meth:`Router.forward`."""
    router = block_router(q, backend, flash_build, cudnn_bias)
    return router.forward(q, k, v, causal, scale, mask=mask, softcap=softcap, scores_bytes=scores_bytes)


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
    """:func:`block_forward`'s backward: :meth:`Router.backward`."""
    router = block_router(q, backend, flash_build, cudnn_bias)
    kw = {"mask": mask, "softcap": softcap, "scores_bytes": scores_bytes}
    return router.backward(dout, q, k, v, out, lse, causal, scale, **kw)
