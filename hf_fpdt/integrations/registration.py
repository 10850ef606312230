"""``attn_implementation="fpdt"``: the attention and mask functions registered with transformers.

The attention function receives HF's full local ``q [B, H, S, D]``, ``k, v [B, Hkv, S, D]`` and runs
them through the chunk pipeline of :mod:`hf_fpdt.attention.chunked`. Its settings come from the model's one
runtime (:func:`runtime_of`): the :class:`~hf_fpdt.integrations.state.FPDTState` that ``hf_fpdt.apply`` or
``hf_fpdt.configure`` attached to the model's attention modules, else, on the attention-only path
(``attn_implementation="fpdt"`` alone), one made by the model's first fpdt call from the defaults plus the
``FPDT_*`` environment and shared by every layer of that model (one autotuner, one device budget,
``chunk_size="auto"`` measured once). HF hands the attention function the attention module only (which
knows neither its model nor its siblings), and the mask function no module; the modules of one model
share one HF config object, so :data:`MODELS`
keeps those states keyed by its identity (:class:`~hf_fpdt.integrations.state.ModelStates`: nothing is
written into the user's modules or config, and a state goes when its config is collected).

Only causal decoder attention is supported. Attention sinks (``s_aux``, one logit per query head in the softmax
denominator) are computed on every path below (:mod:`hf_fpdt.attention.sinks`); a module with a KV compressor
(DeepSeek-V4: keys and mask extended inside the module, after the mask function) is refused.

The mask function never builds an ``[S, S]`` mask: without a
cache it returns the 2D key padding mask (any padding), an empty marker for a mask that keeps every key (a
mask was given: HF's rule reads no packed documents then), or nothing; a user's 4D mask reaches the attention
as it is. Calls that need gradients run the chunk pipeline with that mask (read one block at a time,
:mod:`hf_fpdt.attention.block_mask`), also with an empty cache that HF fills on the side; a cache that holds
earlier tokens is refused for gradients. Calls without gradients on one process, and calls with a KV
cache, go to :mod:`hf_fpdt.attention.cached_attention` (inference only): the mask function then returns a 2D key
padding mask (of the written slots, for a static cache), or HF's 4D mask for a cache that has dropped keys
(a full sliding-window cache). Sliding windows, softcaps and packed documents (``position_ids`` restarting
inside a row, or the flattening collator's ``cu_seq_lens_q``) are block patterns of the chunk loop
(:mod:`hf_fpdt.attention.block_mask`), in training and generation alike. Under sequence parallelism
``generate`` runs the prompt sequence-parallel (:mod:`.sp_generation`, which tells each call its phase).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.autotune import Autotuner
from ..attention.block_mask import MaskSpec
from ..attention.cached_attention import cached_attention_forward, generation_mask, serves
from ..attention.chunked import fpdt_attention
from ..attention.precision import sdpa_precision
from ..attention.runtime import FPDTRuntime
from ..attention.sparse_patterns import SparsePattern
from ..config import FPDTConfig
from .compiled import (
    EAGER_REASON,
    break_for_pattern,
    traced_attention,
    traced_call,
    traced_mask,
    traced_without_grad,
)
from .composed_mask import carry, composed_of, generation_mask_4d, outside_interface
from .composed_mask import read as read_composed
from .inputs import output_attentions_notice
from .mask_spec import (
    every_key_kept,
    fit_padding_mask,
    mask_length_error,
    mask_spec,
    padding_mask,
    propagate_mask_nan,
)
from .sp_generation import SP_KEYWORD, SPPrefill
from .state import FPDTState, ModelStates, state_of

NAME = "fpdt"


# The attention-only path's states, one per model. Transformers' attention interface, which holds the
# function below, is process-wide, and so is this registry of the models it served; it holds no model.
MODELS = ModelStates()


def _model_key(module: nn.Module) -> object:
    """What the attention modules of one model share: their HF config object (the module itself without one)."""
    config = getattr(module, "config", None)
    return module if config is None else config


def _default_state() -> FPDTState:
    config = FPDTConfig()  # the defaults and the FPDT_* environment
    return FPDTState(FPDTRuntime(config, autotuner=Autotuner(backend=config.backend)))


def model_state(module: nn.Module) -> FPDTState | None:
    """The state of the model ``module`` (an attention module) belongs to, or None where no call made one yet:
    the one ``apply`` / ``configure`` attached, else the attention-only path's (:data:`MODELS`)."""
    return state_of(module) or MODELS.get(_model_key(module))


def runtime_of(module: nn.Module) -> FPDTRuntime:
    """The runtime of the model ``module`` (an attention module) belongs to: the one ``apply`` / ``configure``
    attached, else the model's attention-only runtime, made by its first call (see the module docstring)."""
    state = state_of(module) or MODELS.get_or_make(_model_key(module), _default_state)
    return state.runtime


def check_dropout(dropout: float) -> None:
    """The check every fpdt attention call makes (registered function and ``apply``'s patched module): no
    attention dropout. Masks are checked where they are read (:func:`hf_fpdt.integrations.mask_spec.mask_spec`,
    :class:`hf_fpdt.attention.block_mask.BlockMask`); restarting ``position_ids`` are packed documents there."""
    if dropout:
        raise ValueError(
            f"fpdt attention does not implement attention dropout (got {dropout}); set attention_dropout=0"
        )


@sdpa_precision  # under torch.autocast: q/k/v cast and the output's dtype as sdpa's
def fpdt_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: ``q [B, H, S, D]`` -> ``(out [B, S, H, D], None)``.

    Under ``torch.compile`` an inference call is traced (:mod:`hf_fpdt.integrations.compiled`); everything
    else runs eagerly (:func:`pipeline_attention_forward`)."""
    if torch.compiler.is_compiling():  # a runtime is made eagerly (runtime_of), never inside a trace
        state = model_state(module)
        runtime = state.runtime if state is not None else None
        if traced_call(runtime, module, query, key, value, dropout, kwargs):
            return traced_attention(runtime, query, key, value, attention_mask, scaling, kwargs), None
        break_for_pattern(runtime, module)  # a pattern layer: a graph break that names it (fullgraph=True fails)
    return pipeline_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


@torch.compiler.disable(reason=EAGER_REASON)  # the chunk pipeline runs eagerly (README: torch.compile)
def pipeline_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """:func:`fpdt_attention_forward` outside a traced region: the chunk pipeline, or the cached attention
    for inference calls (with the host syncs that skip padded blocks)."""
    output_attentions_notice(kwargs)  # as sdpa: no attention weights, a notice once
    runtime = runtime_of(module)
    cached = bool(kwargs.pop("fpdt_cached", False))  # set by apply's attention patch when it holds a cache
    sp = kwargs.pop(SP_KEYWORD, None)  # sequence-parallel generation (hf_fpdt.integrations.sp_generation)
    # a sliding window is a band of blocks, a softcap part of the block math (hf_fpdt.attention.block_mask, kernels)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    sinks = kwargs.get("s_aux")  # attention sinks: one logit per query head in the denominator (attention.sinks)
    sparse = runtime.attention_pattern(getattr(module, "layer_idx", None))
    composed = composed_of(attention_mask)  # what HF composed for the layer, where more than causal
    if composed is not None and composed.window_only:
        window = composed.window  # HF's window (what eager computes with), on every path below
    if sp is not None:
        if composed is not None:
            composed.refuse("sequence-parallel generate()")
        _refuse_sparse_cached(sparse, "sequence-parallel generate()")
        check_dropout(dropout)
        _check_module(module, kwargs)
        if isinstance(sp, SPPrefill):  # the prompt's shard: the training pipeline, no gradients, padding masked
            # (a prompt: no packed documents; SP generation leaves sliding-window models and patterns alone)
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            with torch.no_grad():
                spec = MaskSpec(softcap=softcap, key_mask=sp.keys)
                return fpdt_attention(q, k, v, runtime, scaling, spec, sinks), None
        out = cached_attention_forward(
            query, key, value, sp.keys, runtime, scaling, softcap=softcap, group=runtime.group, sinks=sinks
        )
        return out, None
    given = attention_mask  # as HF's mask function gave it (with every_key_kept's marker: no packed documents)
    attention_mask = padding_mask(attention_mask)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < key.shape[2]:
        # a static cache: only the first n slots are written (fpdt_mask's key mask of the written slots)
        key, value = key[:, :, : attention_mask.shape[1]], value[:, :, : attention_mask.shape[1]]
    spec = None
    if serves(query, key, value, attention_mask, runtime, cached):  # inference with a cache, or on one process
        full = query.shape[2] == key.shape[2]
        more = composed is not None and not composed.window_only  # chunks or other terms: the pipeline's
        if full and (attention_mask is None and not cached or more):
            # a full sequence, unpadded; or one whose mask is more than causal and a window
            spec = mask_spec(runtime, module, given, kwargs, query.shape[2], window, softcap)
        if spec is None or spec.causal_only:
            # generate's position ids under left padding repeat 0 over the padding: not a packing (no spec)
            _refuse_sparse_cached(sparse, "a call with a KV cache or an attention mask")
            check_dropout(dropout)
            _check_module(module, kwargs)
            out = cached_attention_forward(
                query, key, value, attention_mask, runtime, scaling, window, softcap, sinks=sinks
            )
            return propagate_mask_nan(out, attention_mask), None
        # a full-sequence forward without gradients whose blocks follow a window, softcap, documents or a
        # sparse pattern: the chunk pipeline below runs it (storing nothing for backward)
    check_dropout(dropout)
    _check_module(module, kwargs)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if spec is None:
        spec = mask_spec(runtime, module, given, kwargs, q.shape[1], window, softcap)
    out = fpdt_attention(q, k, v, runtime, scaling, spec, sinks)
    return propagate_mask_nan(out, attention_mask), None  # sdpa's NaN rows of a float 4D mask holding NaN


def _refuse_sparse_cached(sparse: SparsePattern | None, what: str) -> None:
    if sparse is not None:
        raise ValueError(
            f"fpdt attention with a block-sparse attention_pattern ({sparse.name}) serves full-sequence forwards "
            f"(training, evaluation without a cache or mask); {what} is not supported with it: call the model "
            "without a cache and attention mask (use_cache=False, no padding), or apply the model without "
            "attention_pattern for generation"
        )


# The attention keywords whose tensors fpdt reads or that do not change the scores (positions, the flattening
# collator's boundaries, cache bookkeeping); a tensor under any other keyword may change what attention computes
# (a relative-position bias, sparse top-k indices), and is refused by name.
KNOWN_TENSORS = frozenset(
    {
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "cache_position",
        "labels",
        "shift_labels",  # the loss keywords a causal LM hands its base model with the rest of its kwargs (Llama 4)
        "num_items_in_batch",
        "s_aux",  # attention sinks: computed with (hf_fpdt.attention.sinks)
    }
)


def _check_module(module: nn.Module, kwargs: dict) -> None:
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("fpdt attention supports causal (decoder) self-attention only; this module is not causal")
    if getattr(module, "compressor", None) is not None:
        raise ValueError(
            f"fpdt attention: {type(module).__name__} has a KV compressor (DeepSeek-V4's compressed attention): it "
            "appends compressed key/value entries to the keys and extends the attention mask inside the attention "
            "module, after transformers' mask function, so fpdt's mask would not describe its keys; use "
            "attn_implementation='eager' for this model"
        )
    unknown = sorted(
        k
        for k, v in kwargs.items()
        if isinstance(v, torch.Tensor) and k not in KNOWN_TENSORS and not k.startswith("fpdt_")
    )
    if unknown:
        owner = type(module).__name__
        raise ValueError(
            f"fpdt attention: {owner} passes the attention the tensor keyword(s) {unknown} (e.g. a position bias or "
            "sparse top-k indices), which fpdt does not compute with and which may change the scores; use "
            "attn_implementation='sdpa' for this model"
        )


def fpdt_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """HF mask interface. No cache (or an empty one): no mask where none is given (causal structure is built
    into the chunk loop), :func:`~hf_fpdt.integrations.mask_spec.every_key_kept`'s empty marker where the mask
    keeps every key, else the 2D key padding mask ``[B, S]`` (any padding: left, right, holes; the blocks read
    it one at a time, and padding queries see what sdpa lets them see). A mask of another length than the keys
    is fitted as HF does against a cache's length, and refused without a cache (sdpa's error). A cache that
    holds tokens: :func:`hf_fpdt.attention.cached_attention.generation_mask`.

    ``mask_function`` (what HF composed for the layer type) is read whole first
    (:mod:`hf_fpdt.integrations.composed_mask`): a mask that is more than causal attention (a window, attention
    chunks, any other term) travels on the returned mask to the attention (no cache), or, with a cache that
    holds tokens, is HF's 4D mask of the call, as sdpa's; a mask that cannot be computed is refused by name
    where a layer attends with it (a model may build masks it does not use: a decoder's encoder mask)."""
    if traced_without_grad():  # a traced inference call: sdpa's mask (under SP the group's key mask wins)
        return traced_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
        )
    own = outside_interface(kwargs.get("config"))
    if own is not None:
        model_type = getattr(kwargs.get("config"), "model_type", None)
        raise ValueError(
            f"fpdt attention: model type {model_type!r} ({own}) computes attention in its own code, not through "
            "transformers' attention interface, so fpdt's attention never runs and the mask its mask function "
            "returns (none for causal attention) would leave that code unmasked; use attn_implementation='sdpa'"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("fpdt attention accepts a 2D padding mask (batch, length) only")
    if attention_mask is not None and kv_length < q_length and attention_mask.shape[-1] == kv_length:
        # fewer keys than queries: HF sized them by a shorter mask, so no cache holds them (sdpa's error)
        raise mask_length_error(tuple(attention_mask.shape), q_length)
    composed, asked = None, False
    if mask_function is not None:
        model_type = getattr(kwargs.get("config"), "model_type", None) or "unknown"
        composed = read_composed(mask_function, model_type, given=attention_mask is not None)
        asked = kwargs.get("allow_is_causal_skip") is False and _asked(composed)
        if composed.plain:  # (a refusal travels too: it is raised where a layer attends with the mask)
            composed = None
    cached = kv_offset != 0 or kv_length != q_length or int(q_offset) != 0
    if not cached and asked:
        # the model asks for the mask itself (its own code reads it, e.g. DeepSeek's sparse top-k indexer): HF's
        # 4D mask, as sdpa's (O(S^2) bools), which the attention reads block by block
        kwargs["mask_function"] = mask_function
        return generation_mask_4d(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs)
    if not cached:
        mask = _uncached_mask(attention_mask, kv_length)
        if composed is None:
            return mask
        if torch.compiler.is_compiling():  # a traced training step: the mask's structure cannot ride along
            composed.refuse("a torch.compile'd forward with gradients (the chunk pipeline runs eagerly)")
        return carry(mask, composed, batch_size, kwargs.get("device") or "cpu")
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    if composed is not None:  # more than causal attention against a cache: HF's own 4D mask, as sdpa's
        return generation_mask_4d(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs)
    return generation_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, **kwargs)


def _asked(composed) -> bool:
    """Whether nothing in the composed mask explains HF's ``allow_is_causal_skip=False`` (an overlay, packed
    documents), so the model itself asked for the mask: its own code reads it."""
    return composed.documents is None and not composed.rest and composed.refusal is None


def _uncached_mask(attention_mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """:func:`fpdt_mask`'s answer without a cache (see there)."""
    if attention_mask is None:
        return None
    if attention_mask.shape[-1] != kv_length:  # an (empty) cache sized the keys: HF pads or cuts the mask
        attention_mask = fit_padding_mask(attention_mask, kv_length)
    if bool(attention_mask.all()):  # one host sync per forward
        return every_key_kept(attention_mask)  # no padding, but a mask: no packed documents (HF's rule)
    return attention_mask.to(dtype=torch.bool)


def register() -> None:
    """Register ``"fpdt"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fpdt_attention_forward)
    AttentionMaskInterface.register(NAME, fpdt_mask)
