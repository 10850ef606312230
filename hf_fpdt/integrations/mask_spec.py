"""One attention call's :class:`~hf_fpdt.attention.block_mask.MaskSpec`, built once from what HF passes.

Both ways into the chunk pipeline build their spec here: the registered attention function
(:mod:`.registration`, HF's q/k/v) and ``hf_fpdt.apply``'s patched attention module (:mod:`.patches`, the
chunked projection). The rules live in this one place, each HF's (transformers' ``masking_utils``):

* the padding mask: HF's 2D mask as a key mask, or a 4D mask as it is; under sequence parallelism the
  group's key mask in global order (``KEY_MASK``, from ``apply``'s input check). A 2D mask of another length
  than the tokens is fitted to the keys only against a KV cache (HF pads it with 0, masking the keys it
  lacks, or reads its first columns: :func:`fit_padding_mask`); without a cache it is sdpa's error, here a
  ``ValueError`` (:func:`mask_length_error`). A 2D mask that keeps every key reaches the attention as
  :func:`every_key_kept`'s marker (no padding, but a mask was given);
* packed documents (:func:`packed_documents`): ``position_ids`` that restart inside a row, only where the
  call has no attention mask (2D, even all ones, or 4D: left padding's position ids are no packing) and
  HF's forward holds no KV cache. HF makes its cache (``use_cache``: the call's, else the config's, off under
  gradient checkpointing in training; :func:`hf_holds_cache`) before it builds the mask, and then attends
  the row as one sequence: fpdt does the same and logs once how to get documents (``use_cache=False``, or
  the flattening collator's ``cu_seq_lens_q``, which are documents with or without a cache, as
  flash-attention reads them). Under sequence parallelism the group's ids (``DOCUMENT_IDS``, from
  ``apply``'s input check, which applies the same rule);
* NaN in a float 4D mask: sdpa adds the mask to the scores, so a query whose row holds NaN gets NaN; fpdt
  reads masks as keep/drop, and :func:`propagate_mask_nan` gives those rows NaN afterwards;
* the sliding window: none where it is at least as long as the sequence (every key inside it: plain
  causal attention);
* the block-sparse pattern: the runtime's for the module's layer;
* what HF composed for the layer (:mod:`.composed_mask`, carried by the mask fpdt's mask function returned):
  its sliding window replaces the call's ``sliding_window`` keyword (the mask is what eager and sdpa compute
  with; the keyword only flash-attention reads), its attention chunks become ``MaskSpec.chunks`` (from the
  group's left padding under sequence parallelism), and its other terms a block-sparse pattern ANDed with the
  runtime's, evaluated over the whole input once per call. Under sequence parallelism a rank holds pieces of the
  sequence, so other terms are refused by name, and attention chunks follow the whole sequence (global token order;
  packed rows: the group's positions, ``POSITIONS``, from ``apply``'s input check), not the shard HF composed from.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from ..attention.block_mask import MaskSpec, document_ids, document_ids_from_cu_seqlens
from ..attention.runtime import FPDTRuntime
from ..attention.sparse_patterns import both
from .cache_names import cache_from
from .composed_mask import composed_of

_log = logging.get_logger("hf_fpdt")  # transformers' logger class: warning_once

DOCUMENT_IDS = "fpdt_document_ids"  # keyword of packed documents' ids under SP (set by apply's input check)
KEY_MASK = "fpdt_key_mask"  # keyword of the group's padding mask in global order under SP (apply's input check)
POSITIONS = "fpdt_positions"  # keyword of packed rows' positions in global order under SP, with DOCUMENT_IDS


CACHE_NOTICE = (
    "hf_fpdt: position_ids restart inside a row, but this forward holds a KV cache (use_cache is on: the call's "
    "use_cache, else model.config.use_cache), so the row is attended as ONE sequence, not as packed documents, "
    "as sdpa and eager do (HF reads packed documents from position_ids only without a cache). For document "
    "masking pass use_cache=False (or set model.config.use_cache = False; TRL's SFTTrainer does), or the "
    "flattening collator's cu_seq_lens_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
)


def hf_holds_cache(model: nn.Module, kwargs: dict) -> bool:
    """Whether HF's forward of ``model`` (the model a forward pre-hook sees, given the call's ``kwargs``) holds
    a KV cache: one passed in, or the one it makes because ``use_cache`` is on (the call's, else the config's;
    off under gradient checkpointing in training, as HF's ``merge_with_config_defaults`` decides)."""
    if cache_from(kwargs) is not None:
        return True
    use = kwargs.get("use_cache")
    if use is None:
        config = getattr(model, "config", None)
        use = getattr(config, "use_cache", None)
        if use is None and hasattr(config, "get_text_config"):
            use = getattr(config.get_text_config(), "use_cache", None)
    if use and model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False  # HF's base model turns use_cache off under gradient checkpointing in training
    return bool(use)


def packed_documents(position_ids: torch.Tensor | None, cache: bool) -> torch.Tensor | None:
    """``[B, S]`` document ids of packed rows by HF's rule for a call without an attention mask: ``position_ids``
    that restart inside a row, unless HF's forward holds a KV cache (``cache``): then the row is one sequence,
    as in HF, and :data:`CACHE_NOTICE` is logged once. One host sync."""
    docs = document_ids(position_ids) if position_ids is not None else None
    if docs is not None and cache:
        _log.warning_once(CACHE_NOTICE)
        return None
    return docs


def packed_document_ids(
    runtime: FPDTRuntime, position_ids: torch.Tensor | None, kwargs: dict, length: int, module: nn.Module | None = None
) -> torch.Tensor | None:
    """Document ids of packed rows (:func:`packed_documents`; with a cache, or without ``position_ids``, the
    flattening collator's ``cu_seq_lens_q``), or None. ``use_cache`` among ``kwargs`` (what HF's decoder layer
    tells its attention) says whether HF's forward holds a cache. Under sequence parallelism a rank's position
    ids are pieces of the global order, so the ids come from ``hf_fpdt.apply``'s input check
    (``DOCUMENT_IDS``), which gathers the group's positions; so do they on one process after ``apply``."""
    if DOCUMENT_IDS in kwargs:
        return kwargs[DOCUMENT_IDS]
    if runtime.sp_size > 1:
        return None
    cache = bool(kwargs.get("use_cache"))
    if position_ids is not None and not cache:
        return packed_documents(position_ids, cache)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return document_ids_from_cu_seqlens(cu, length)
    if position_ids is not None and getattr(module, "layer_idx", None) in (0, None):
        packed_documents(position_ids, cache)  # the notice, checked once per forward (its first layer)
    return None


def every_key_kept(attention_mask: torch.Tensor) -> torch.Tensor:
    """What fpdt's mask function returns for a 2D mask that keeps every key: an empty ``[B, 0]`` view, so the
    attention knows a mask was given (HF's rule: then no packed documents) without reading it again."""
    return attention_mask[:, :0]


def padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a call computes with: ``attention_mask`` as HF's mask function gave it, None for
    :func:`every_key_kept`'s marker."""
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] == 0:
        return None
    return attention_mask


def mask_length_error(shape: tuple, tokens: int, what: str | None = None) -> ValueError:
    """The error of a 2D ``attention_mask`` of ``shape`` with another length than the ``tokens`` in a call without
    a KV cache (sdpa's own: ``The size of tensor a (50) must match the size of tensor b (47)``), on both ways in;
    ``what``: the tokens' argument and shape where known (``input_ids (2, 50)``)."""
    return ValueError(
        f"attention_mask {tuple(shape)} does not fit {what or f'the {tokens} tokens'}: it has {shape[-1]} columns "
        f"for {tokens} tokens, and this forward holds no KV cache (use_cache=False, or gradient checkpointing in "
        "training), the only case where HF pads or cuts a 2D mask (to the cache's length); sdpa fails on it too. "
        f"Pass a mask of shape [{shape[0]}, {tokens}]: 1 for a real token, 0 for padding"
    )


def fit_padding_mask(attention_mask: torch.Tensor, keys: int) -> torch.Tensor:
    """A 2D mask against ``keys`` keys in a call with a KV cache, as HF's ``prepare_padding_mask`` reads it:
    padded with 0 (the keys it lacks are masked), or its first ``keys`` columns."""
    n = attention_mask.shape[-1]
    if n < keys:
        return F.pad(attention_mask, (0, keys - n))
    return attention_mask[..., :keys]


def propagate_mask_nan(out: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """sdpa's NaN for a float 4D mask holding NaN: it adds the mask to the scores, so every query whose row of
    the mask holds a NaN gets NaN (and the loss NaN). fpdt reads a mask as keep/drop (NaN: dropped), so those
    rows of ``out [B, Sq, H, D]`` are made NaN here (an addition: gradients pass as through sdpa's). One
    reduction over the mask, no host sync; nothing for bool or 2D masks."""
    if attention_mask is None or attention_mask.dim() != 4 or not attention_mask.is_floating_point():
        return out
    rows = attention_mask.amax(dim=(1, 3)).isnan()  # [B | 1, Sq]: amax propagates NaN
    nan = torch.zeros(rows.shape, dtype=out.dtype, device=out.device).masked_fill_(rows.to(out.device), float("nan"))
    return out + nan[:, :, None, None]


def pipeline_masks(
    runtime: FPDTRuntime, attention_mask: torch.Tensor | None, kwargs: dict
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(key_mask, dense_mask)`` of a chunk-pipeline call in global token order: HF's 2D padding mask (what
    :func:`hf_fpdt.integrations.registration.fpdt_mask` returns), or a 4D mask. Under sequence parallelism a
    rank holds pieces of the sequence, so the key mask comes from ``hf_fpdt.apply``'s input check
    (``KEY_MASK``), which gathers the group's masks."""
    if runtime.sp_size > 1:
        if KEY_MASK in kwargs:  # the group's mask, whatever form HF's mask function gave the local shard
            return kwargs[KEY_MASK], None
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError(
                "fpdt attention under sequence parallelism takes a 2D padding mask (batch, length), not a 4D mask "
                "(its rows and columns span tokens other ranks hold): pass the 2D attention_mask, sharded with the "
                "tokens (SPCollator / FPDTPlugin), or train this batch at sp_size 1"
            )
        if attention_mask is not None:
            raise ValueError(
                "fpdt attention under sequence parallelism got a padding mask without the group's global mask: "
                "apply the model with hf_fpdt.apply (its input check gathers the ranks' masks into the global order)"
            )
        return None, None
    if attention_mask is None:
        return None, None
    if attention_mask.dim() == 2:
        return attention_mask.to(dtype=torch.bool), None
    if attention_mask.dim() == 4:
        return None, attention_mask
    raise ValueError(f"fpdt attention takes a 2D padding mask or a 4D mask; got {attention_mask.dim()} dimensions")


def mask_spec(
    runtime: FPDTRuntime,
    module: nn.Module,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
    length: int,
    window: int | None = None,
    softcap: float | None = None,
) -> MaskSpec:
    """The spec of one chunk-pipeline call of attention ``module`` over ``length`` local tokens per row.

    ``attention_mask``: what HF's mask function gave the call (2D, :func:`every_key_kept`'s marker, 4D or None);
    ``kwargs``: HF's keywords of the call (``position_ids``, ``use_cache``, ``cu_seq_lens_q``, and ``apply``'s
    ``DOCUMENT_IDS`` / ``KEY_MASK``); ``window``: HF's ``sliding_window``; ``softcap``: the attention logit
    softcap. The rules are the module docstring's; a mask HF's attention cannot take raises ``ValueError``.
    """
    composed = composed_of(attention_mask)
    key_mask, dense_mask = pipeline_masks(runtime, padding_mask(attention_mask), kwargs)
    # HF's rule: no packed documents where a mask was given (padding, an all-ones 2D mask, a 4D mask)
    passed = composed.given if composed is not None else attention_mask is not None
    given = passed or key_mask is not None or dense_mask is not None
    docs = None if given else packed_document_ids(runtime, kwargs.get("position_ids"), kwargs, length, module)
    sparse = runtime.attention_pattern(getattr(module, "layer_idx", None))
    chunks = None
    if composed is not None:  # what HF composed for this layer: the mask eager and sdpa compute with
        composed.check()
        window = composed.window
        total = length * runtime.sp_size
        if runtime.sp_size > 1:
            if composed.rest:
                composed.refuse("sequence parallelism (each rank holds pieces of the sequence)")
            # HF composed the rank's shard, whose positions jump between its pieces: it reads every shard as packed
            # rows and remaps the chunks to the shard's positions. One process reads the whole sequence: chunks
            # over the group's positions where its rows are packed (the input check's), else over token indices
            composed = replace(composed, positions=kwargs.get(POSITIONS) if docs is not None else None)
            if docs is not None and composed.chunk is not None and composed.positions is None:
                composed.refuse("sequence parallelism without the group's positions (hf_fpdt.apply's input check)")
        if docs is None and composed.documents is not None and composed.documents.shape[-1] == total:
            docs = composed.documents  # HF's packed documents where fpdt's own reading found none
        sp_keys = key_mask if runtime.sp_size > 1 else None  # the group's: its left padding is the sequence's
        chunks = composed.chunk_ids(attention_mask.shape[0], total, attention_mask.device, sp_keys)
        sparse = both(sparse, composed.pattern())
    if window is not None and window >= length * runtime.sp_size:
        window = None  # a window at least as long as the sequence is plain causal attention
    return MaskSpec(window, softcap, docs, sparse, key_mask, dense_mask, chunks)
