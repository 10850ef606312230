"""The SP collator: whole samples in, one sequence-parallel rank's shard of them out (FPDT's layout).

The data-loader half of :mod:`hf_fpdt.data.layout`: :class:`SPCollator` wraps any collate function (default:
``transformers.default_data_collator``) and keeps this rank's tokens with pre-shifted labels and global
position ids. ``FPDTPlugin.prepare_dataloader`` and ``FPDTTrainer`` install it. Imports no ``datasets``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import default_data_collator

from ..config import IGNORE_INDEX
from .layout import is_right_padded, shard_batch


@dataclass
class SPCollator:
    """Collate whole samples, then keep one SP rank's share of them in FPDT's layout.

    ``inner`` (default: ``transformers.default_data_collator``) builds the full batch: ``input_ids
    [B, S]``, unshifted ``labels [B, S]`` (optional), ``position_ids`` (optional, default
    ``arange(S)``), ``attention_mask`` (optional; right padding only, with labels -100 on it, because
    FPDT runs causal attention without a mask). The result, every tensor ``[B, ceil(S / sp_size)]``::

        input_ids, position_ids     this rank's tokens and their global positions
        labels, shift_labels        their next-token targets (the same tensor; HF computes a loss only
                                    when ``labels`` is given, and then uses ``shift_labels`` as they are)

    Other keys pass through when they are not per-token; a per-token key it cannot shard raises.
    Picklable (plain fields), so it works with DataLoader worker processes.
    """

    sp_rank: int
    sp_size: int
    chunk_size: int
    pad_token_id: int = 0
    inner: Callable[[list], Any] | None = None

    def __call__(self, features: list) -> dict:
        batch = dict((self.inner or default_data_collator)(features))
        input_ids = batch.pop("input_ids", None)
        if input_ids is None:
            raise ValueError(f"SPCollator needs input_ids in every batch (got keys {sorted(batch)})")
        if "shift_labels" in batch:
            raise ValueError("SPCollator shifts labels itself: give it unshifted labels, not shift_labels")
        labels = batch.pop("labels", None)
        position_ids = batch.pop("position_ids", None)
        mask = batch.pop("attention_mask", None)
        if mask is not None:
            _check_right_padding(mask, labels)
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(input_ids.shape):
                raise ValueError(f"SPCollator cannot shard the per-token field {key!r}; drop it from the dataset")
        shard = shard_batch(
            input_ids,
            labels,
            rank=self.sp_rank,
            sp_size=self.sp_size,
            chunk_size=self.chunk_size,
            position_ids=position_ids,
            pad_id=self.pad_token_id,
        )
        out = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
        if shard.shift_labels is not None:
            out["labels"] = out["shift_labels"] = shard.shift_labels
        out.update(batch)
        return out


def _check_right_padding(mask: torch.Tensor, labels: torch.Tensor | None) -> None:
    mask = mask.bool()
    if mask.dim() != 2 or not is_right_padded(mask):
        raise ValueError("FPDT supports right padding only (real tokens first, then padding): use padding_side='right'")
    if labels is not None and bool((labels[~mask] != IGNORE_INDEX).any()):
        raise ValueError("labels must be -100 on padding (attention_mask == 0): FPDT attends without a mask")
