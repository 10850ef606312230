"""One attention call's :class:`~hf_fpdt.core.block_mask.MaskSpec`, built once from what HF passes.

Both ways into the chunk pipeline build their spec here: the registered attention function
(:mod:`.registration`, HF's q/k/v) and ``hf_fpdt.apply``'s patched attention module (:mod:`.patches`, the
chunked projection). The rules live in this one place:

* the padding mask: HF's 2D mask as a key mask, or a 4D mask as it is; under sequence parallelism the
  group's key mask in global order (``KEY_MASK``, from ``apply``'s input check);
* packed documents: ``position_ids`` that restart inside a row (HF's packed-sequence rule), else the
  flattening collator's ``cu_seq_lens_q``; under sequence parallelism the group's ids (``DOCUMENT_IDS``,
  from ``apply``'s input check); and none under a padding mask (HF's rule: left padding's position ids
  are no packing);
* the sliding window: none where it is at least as long as the sequence (every key inside it: plain
  causal attention);
* the block-sparse pattern: the runtime's for the module's layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.block_mask import MaskSpec, document_ids, document_ids_from_cu_seqlens
from ..core.runtime import FPDTRuntime

DOCUMENT_IDS = "fpdt_document_ids"  # keyword of packed documents' ids under SP (set by apply's input check)
KEY_MASK = "fpdt_key_mask"  # keyword of the group's padding mask in global order under SP (apply's input check)


def packed_document_ids(
    runtime: FPDTRuntime, position_ids: torch.Tensor | None, kwargs: dict, length: int
) -> torch.Tensor | None:
    """Document ids of packed rows (HF's packed-sequence rule on ``position_ids``, else the flattening
    collator's ``cu_seq_lens_q``), or None. Under sequence parallelism a rank's position ids are pieces
    of the global order, so the ids come from ``hf_fpdt.apply``'s input check (``DOCUMENT_IDS``), which
    gathers the group's positions."""
    if DOCUMENT_IDS in kwargs:
        return kwargs[DOCUMENT_IDS]
    if runtime.sp_size > 1:
        return None
    if position_ids is not None:
        return document_ids(position_ids)
    cu = kwargs.get("cu_seq_lens_q")
    return document_ids_from_cu_seqlens(cu, length) if cu is not None else None


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

    ``attention_mask``: what HF's mask function gave the call (2D, 4D or None); ``kwargs``: HF's keywords of
    the call (``position_ids``, ``cu_seq_lens_q``, and under sequence parallelism ``apply``'s
    ``DOCUMENT_IDS`` / ``KEY_MASK``); ``window``: HF's ``sliding_window``; ``softcap``: the attention logit
    softcap. The rules are the module docstring's; a mask HF's attention cannot take raises ``ValueError``.
    """
    key_mask, dense_mask = pipeline_masks(runtime, attention_mask, kwargs)
    padded = key_mask is not None or dense_mask is not None  # HF's rule: no packed documents under padding
    docs = None if padded else packed_document_ids(runtime, kwargs.get("position_ids"), kwargs, length)
    if window is not None and window >= length * runtime.sp_size:
        window = None  # a window at least as long as the sequence is plain causal attention
    sparse = runtime.attention_pattern(getattr(module, "layer_idx", None))
    return MaskSpec(window, softcap, docs, sparse, key_mask, dense_mask)
