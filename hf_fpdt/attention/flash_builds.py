"""How to call the installed flash-attn builds: every name of flash-attn hf_fpdt touches lives here.

flash-attn's block entry points changed between releases, and a wrong call either raises at the first block or,
worse, runs and returns something else::

    FA2  flash_attn.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap (>= 2.6),
             ..., return_attn_probs) -> (out, softmax_lse [B, H, Sq], S_dmask)
         flash_attn.flash_attn_interface._flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
             dropout_p, softmax_scale, causal, window_size | window_size_left/right, softcap, ...)
    FA3  flash_attn_interface._flash_attn_forward: the 2024 beta (q, k, v, softmax_scale, causal, window_size, ...)
             -> (out, q, k, v, out_padded, softmax_lse, S_dmask); newer builds (q, k, v, k_new, ..., softmax_scale,
             causal, window_size_left, window_size_right, ..., softcap, ...) -> (out, softmax_lse, ...); builds
             whose entry point is a torch op take its arguments positionally only
         flash_attn_interface._flash_attn_backward(dout, q, k, v, out, softmax_lse, [cu_seqlens.., max_seqlen..,]
             dq, dk, dv, softmax_scale, causal | is_causal, ...)

So nothing is assumed: :func:`flash_calls` reads each entry point's parameters from the installed module
(``inspect.signature``, or a torch op's schema), fills every one of them by name, from the values of one block
(with the aliases the releases used) or its default, and calls positionally, which every build accepts. The
forward's log-sum-exp is found in the result by what it is (float32 ``[B, H, Sq]``, after ``out``), not by its
index, so the beta's ``(out, q, ...)`` cannot pass ``q`` off as the LSE. A parameter the block cannot fill (no
default, not a known name) makes the build unusable, with the reason. Whether a usable build computes the right
thing is the probe's question (:func:`hf_fpdt.attention.kernels.probe_backend`).

Varlen (documents of a packed block as one batch of sequences, :mod:`hf_fpdt.attention.flash_blocks`)::

    FA2  flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
             softmax_scale, causal, window_size (>= 2.3), softcap (>= 2.6), ..., return_attn_probs)
         flash_attn.flash_attn_interface._flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
             window_size | window_size_left/right (2.7+), softcap (>= 2.6), ...)
         the log-sum-exp: [n_seqs, H, max_seqlen_q] (row i of sequence s at [s, :, i]) before 2.6,
             [H, total_q] from 2.6 (its varlen_fwd's ``unpadded_lse``, with ``softcap`` in the same release)
    FA3  the same _flash_attn_forward / _flash_attn_backward with cu_seqlens_q/k and max_seqlen_q/k set
             (builds whose entry points name them; the 2024 beta's do not): log-sum-exp [H, total_q]

q/k/v/out of a varlen call are ``[total, H, D]``; :meth:`FlashCalls.varlen_forward` returns the log-sum-exp as
``[H, total_q]`` whatever the build's layout, and :meth:`FlashCalls.varlen_backward` hands it back in the build's.

A build takes a sliding window where both entry points name one (:attr:`FlashCalls.window`: ``window_size`` or
``window_size_left`` / ``window_size_right``); a window-cut block passes its bottom-right aligned ``(left, right)``
(:class:`hf_fpdt.attention.block_keep.WindowBand`), every other block ``(-1, -1)``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

PACKAGES = {  # backend -> (module of the forward, its name, module of the backward, its name)
    "flash_attn": ("flash_attn", "flash_attn_func", "flash_attn.flash_attn_interface", "_flash_attn_backward"),
    "flash_attn3": ("flash_attn_interface", "_flash_attn_forward", "flash_attn_interface", "_flash_attn_backward"),
}
VARLEN = {  # backend -> its varlen entry points, as PACKAGES (FA3: the same functions, with cu_seqlens set)
    "flash_attn": (
        "flash_attn",
        "flash_attn_varlen_func",
        "flash_attn.flash_attn_interface",
        "_flash_attn_varlen_backward",
    ),
    "flash_attn3": PACKAGES["flash_attn3"],
}
_VARLEN_PARAMS = frozenset(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
_NONE = (  # parameters a dense, non-paged, non-varlen block passes as None whatever their default
    "k_new",
    "v_new",
    "qv",
    "out",
    "out_",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "cu_seqlens_k_new",
    "seqused_q",
    "seqused_k",
    "sequed_q",
    "sequed_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "page_table",
    "kv_batch_idx",
    "leftpad_k",
    "rotary_cos",
    "rotary_sin",
    "seqlens_rotary",
    "q_descale",
    "k_descale",
    "v_descale",
    "descale_q",
    "descale_k",
    "descale_v",
    "alibi_slopes",
    "rng_state",
    "scheduler_metadata",
    "gen_",
)


@dataclass(frozen=True)
class VarlenBatch:
    """The sequences of one varlen call: ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 ``[n + 1]`` on the device), the
    longest of each, and the query lengths on the host (to move the log-sum-exp between layouts without a read)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    lengths_q: tuple[int, ...]

    def values(self) -> dict:
        return {
            "cu_seqlens_q": self.cu_q,
            "cu_seqlens_k": self.cu_k,
            "max_seqlen_q": self.max_q,
            "max_seqlen_k": self.max_k,
        }


@dataclass(frozen=True)
class FlashCalls:
    """One installed build's two entry points and the parameter names each takes, in order; ``varlen``: the build's
    varlen entry points as another :class:`FlashCalls` (``None``: the build has none hf_fpdt can fill)."""

    backend: str
    forward_fn: Callable
    forward_params: tuple[str, ...]
    forward_defaults: dict
    backward_fn: Callable
    backward_params: tuple[str, ...]
    backward_defaults: dict
    forward_keyword_only: frozenset = frozenset()  # parameters that only take a keyword (after ``*``)
    backward_keyword_only: frozenset = frozenset()
    varlen: FlashCalls | None = None
    names: tuple[str, str] = ()  # the entry points' dotted names, for errors (default: PACKAGES')

    @property
    def softcap(self) -> bool:
        """Whether this build takes a logit softcap (FA2 >= 2.6, FA3)."""
        return "softcap" in self.forward_params and "softcap" in self.backward_params

    @property
    def window(self) -> bool:
        """Whether both entry points take a sliding window: ``window_size=(left, right)`` (FA2 >= 2.3 and its
        backward up to 2.6, the FA3 beta) or ``window_size_left`` / ``window_size_right`` (FA2 2.7+'s backward,
        FA3)."""
        return all(
            "window_size" in params or {"window_size_left", "window_size_right"} <= set(params)
            for params in (self.forward_params, self.backward_params)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] = (-1, -1),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` of one block (``[B, S, H, D]`` inputs); ``window``:
        flash-attn's ``(left, right)``, bottom-right aligned, -1 unbounded (only for a build with :attr:`window`)."""
        values = _values(causal, scale, softcap, window, q=q, k=k, v=v)
        where = self._where("forward")
        args, kwargs = _args(self.forward_params, self.forward_defaults, values, where, self.forward_keyword_only)
        res = self.forward_fn(*args, **kwargs)
        return res[0], _lse_of(res, q, self.backend)

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
        softcap: float = 0.0,
        window: tuple[int, int] = (-1, -1),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of one block given the final ``out, lse`` (written into buffers allocated here);
        ``window`` as the forward's."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = _values(
            causal, scale, softcap, window, dout=dout.contiguous(), q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv
        )
        values["softmax_lse"] = lse.contiguous()
        args, kwargs = _args(
            self.backward_params, self.backward_defaults, values, self._where("backward"), self.backward_keyword_only
        )
        self.backward_fn(*args, **kwargs)
        return dq, dk, dv

    @property
    def padded_lse(self) -> bool:
        """Whether this varlen backward takes the log-sum-exp as ``[n_seqs, H, max_seqlen_q]`` (FA2 before 2.6, whose
        varlen entry points have no ``softcap``) rather than ``[H, total_q]``."""
        return self.backend == "flash_attn" and "softcap" not in self.backward_params

    def varlen_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: VarlenBatch,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] = (-1, -1),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [total_q, H, D], lse [H, total_q] float32)`` of one varlen call (``[total, H, D]`` inputs; on the
        :attr:`varlen` calls of a build)."""
        values = _values(causal, scale, softcap, window, q=q, k=k, v=v, **seqs.values())
        args, kwargs = _args(
            self.forward_params, self.forward_defaults, values, self._where("forward"), self.forward_keyword_only
        )
        res = self.forward_fn(*args, **kwargs)
        return res[0], _varlen_lse_of(res, q, seqs, self.backend)

    def varlen_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        seqs: VarlenBatch,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] = (-1, -1),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` (``[total, H, D]``) of one varlen call given the final ``out`` and ``lse [H, total_q]``."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = _values(
            causal, scale, softcap, window, dout=dout.contiguous(), q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv,
            **seqs.values(),
        )  # fmt: skip
        values["softmax_lse"] = _padded(lse, seqs) if self.padded_lse else lse.contiguous()
        args, kwargs = _args(
            self.backward_params, self.backward_defaults, values, self._where("backward"), self.backward_keyword_only
        )
        self.backward_fn(*args, **kwargs)
        return dq, dk, dv

    def _where(self, which: str) -> str:
        if self.names:
            return self.names[0] if which == "forward" else self.names[1]
        module, fwd, bmodule, bwd = PACKAGES[self.backend]
        return f"{module}.{fwd}" if which == "forward" else f"{bmodule}.{bwd}"


def _token_places(seqs: VarlenBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed query token: its sequence and its row within it (``[total_q]`` each, on ``device``); from the
    device's ``cu_seqlens_q`` (no copy from the host)."""
    cu = seqs.cu_q.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    total = sum(seqs.lengths_q)
    seq = torch.repeat_interleave(torch.arange(len(seqs.lengths_q), device=device), lengths, output_size=total)
    return seq, torch.arange(total, device=device) - cu[:-1][seq]


def _padded(lse: torch.Tensor, seqs: VarlenBatch) -> torch.Tensor:
    """``[H, total_q]`` -> FA2 < 2.6's ``[n_seqs, H, max_seqlen_q]`` (rows past a sequence's length unused: 0)."""
    seq, row = _token_places(seqs, lse.device)
    padded = lse.new_zeros(len(seqs.lengths_q), lse.shape[0], seqs.max_q)
    padded[seq, :, row] = lse.t()
    return padded


def _varlen_lse_of(res, q: torch.Tensor, seqs: VarlenBatch, backend: str) -> torch.Tensor:
    """A varlen forward's log-sum-exp as ``[H, total_q]``: found by what it is (float32, ``[H, total_q]``, or FA2
    < 2.6's ``[n_seqs, H, >= max_seqlen_q]``, taken apart by the host lengths)."""
    total, h, n = q.shape[0], q.shape[1], len(seqs.lengths_q)
    for t in res[1:]:
        if not isinstance(t, torch.Tensor) or not _lse_dtype(t, q):
            continue
        if tuple(t.shape) == (h, total):
            return t
        if t.dim() == 3 and tuple(t.shape[:2]) == (n, h) and t.shape[2] >= seqs.max_q:
            seq, row = _token_places(seqs, t.device)
            return t[seq, :, row].t()
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in res]
    raise RuntimeError(
        f"{backend}: no float32 log-sum-exp [H={h}, total_q={total}] (or [{n}, {h}, max_seqlen_q]) among the varlen "
        f"forward's results {shapes}; this flash-attn build returns another layout: set FPDTConfig.backend to another "
        "backend"
    )


def _values(causal: bool, scale: float, softcap: float, window: tuple[int, int] = (-1, -1), **tensors) -> dict:
    """Every name (and alias across releases) a block's call fills."""
    left, right = (int(w) for w in window)
    return {
        **tensors,
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "scale": scale,
        "causal": causal,
        "is_causal": causal,
        "window_size": (left, right),
        "window_size_left": left,
        "window_size_right": right,
        "softcap": softcap or 0.0,
        "deterministic": False,
        "return_attn_probs": True,  # FA2's func returns (out, lse, S_dmask) only with it
        "return_softmax": False,
    }


def _args(params: tuple[str, ...], defaults: dict, values: dict, where: str, keyword_only: frozenset) -> tuple:
    """``(args, kwargs)``: every parameter filled, positionally but for the keyword-only ones."""
    args, kwargs = [], {}
    for name in params:
        if name in values:
            value = values[name]
        elif name in defaults:
            value = defaults[name]
        elif name in _NONE:
            value = None
        else:  # flash_calls checked this; a build changed under a running process
            raise TypeError(f"{where}: no value for its parameter {name!r}")
        if name in keyword_only:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def _lse_dtype(lse: torch.Tensor, q: torch.Tensor) -> bool:
    """A log-sum-exp in float32 (every real build), or float64 for float64 inputs (the tests' float64 stand-ins)."""
    return lse.dtype == torch.float32 or lse.dtype == q.dtype == torch.float64


def _lse_of(res, q: torch.Tensor, backend: str) -> torch.Tensor:
    """The forward result's log-sum-exp: the first float32 ``[B, H, Sq]`` tensor after ``out`` (module doc)."""
    b, sq, h, _ = q.shape
    for t in res[1:]:
        if isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape) == (b, h, sq):
            if not _lse_dtype(t, q):
                raise RuntimeError(f"{backend}: the forward's log-sum-exp is {t.dtype}, expected float32")
            return t
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in res]
    raise RuntimeError(
        f"{backend}: no float32 log-sum-exp [B={b}, H={h}, Sq={sq}] among the forward's results {shapes}; "
        "this flash-attn build returns another layout: set FPDTConfig.backend to another backend"
    )


def _signature(fn: Callable) -> tuple[tuple[str, ...], dict, frozenset]:
    """Parameter names in order, their defaults and the keyword-only ones: a ``torch.library.custom_op`` by its
    Python function (FA2 2.7+ registers its entry points so), a torch op by its schema (keyword-only arguments
    after ``*``), anything else by ``inspect.signature``."""
    init = getattr(fn, "_init_fn", None)  # torch.library.custom_op's CustomOpDef: its signature is (*args, **kwargs)
    if callable(init):
        fn = init
    overload = getattr(fn, "default", None)  # torch.ops.<ns>.<name>, an OpOverloadPacket: its one overload
    schema = getattr(overload if overload is not None else fn, "_schema", None)
    if hasattr(schema, "arguments"):
        args = schema.arguments
        defaults = {a.name: a.default_value for a in args if a.has_default_value()}
        return tuple(a.name for a in args), defaults, frozenset(a.name for a in args if a.kwarg_only)
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    return tuple(p.name for p in params), defaults, frozenset(p.name for p in params if p.kind == p.KEYWORD_ONLY)


def _unfillable(params: tuple[str, ...], defaults: dict, sample: dict) -> list[str]:
    return [n for n in params if n not in sample and n not in defaults and n not in _NONE]


def flash_calls(backend: str, import_module: Callable = importlib.import_module) -> FlashCalls | str:
    """The installed build of ``backend`` (``"flash_attn"`` / ``"flash_attn3"``) as :class:`FlashCalls`, or why
    it cannot be used (not importable, e.g. a wheel built for another torch; an entry point missing; a parameter
    the block cannot fill)."""
    module, fwd, bmodule, bwd = PACKAGES[backend]
    try:
        fns = getattr(import_module(module), fwd), getattr(import_module(bmodule), bwd)
    except Exception as err:  # ImportError, OSError (undefined CUDA symbols), AttributeError
        return f"{module} does not import or lacks {fwd}/{bwd} ({type(err).__name__}: {str(err)[:120]})"
    try:
        (fp, fd, fk), (bp, bd, bk) = _signature(fns[0]), _signature(fns[1])
    except (TypeError, ValueError, AttributeError) as err:
        return f"cannot read the parameters of {module}.{fwd} / {bmodule}.{bwd} ({err})"
    sample = {**_values(False, 1.0, 0.0), **dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"))}
    sample["softmax_lse"] = None
    missing = [f"{module}.{fwd}({n})" for n in _unfillable(fp, fd, sample)]
    missing += [f"{bmodule}.{bwd}({n})" for n in _unfillable(bp, bd, sample)]
    if missing:
        return f"this build's parameters {', '.join(missing)} are unknown to hf_fpdt"
    varlen = _varlen_calls(backend, import_module, sample)
    return FlashCalls(backend, fns[0], fp, fd, fns[1], bp, bd, fk, bk, varlen=varlen)


def _varlen_calls(backend: str, import_module: Callable, sample: dict) -> FlashCalls | None:
    """The build's varlen entry points (:data:`VARLEN`) where both import and name ``cu_seqlens_q/k`` and
    ``max_seqlen_q/k`` and hf_fpdt can fill every other parameter; ``None`` otherwise (document-cut blocks then run
    on ``math``)."""
    module, fwd, bmodule, bwd = VARLEN[backend]
    try:
        fns = getattr(import_module(module), fwd), getattr(import_module(bmodule), bwd)
        (fp, fd, fk), (bp, bd, bk) = _signature(fns[0]), _signature(fns[1])
    except Exception:  # no varlen entry point, or one whose parameters cannot be read: the build runs without
        return None
    if not (_VARLEN_PARAMS <= set(fp) and _VARLEN_PARAMS <= set(bp)):
        return None
    if _unfillable(fp, fd, sample) or _unfillable(bp, bd, sample):
        return None
    return FlashCalls(backend, fns[0], fp, fd, fns[1], bp, bd, fk, bk, names=(f"{module}.{fwd}", f"{bmodule}.{bwd}"))
