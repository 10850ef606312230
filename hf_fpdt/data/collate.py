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

from .layout import pad_sequence, shard_batch


@dataclass
class SPCollator:
    """Collate whole samples, then keep one SP rank's share of them in FPDT's layout.

    ``inner`` (default: ``transformers.default_data_collator``) builds the full batch: ``input_ids
    [B, S]``, unshifted ``labels [B, S]`` (optional), ``position_ids`` (optional, default
    ``arange(S)``), ``attention_mask`` (optional, 2D; any padding: left, right, holes; the attention masks
    padding keys as sdpa does). The result, every tensor ``[B, ceil(S / sp_size)]``::

        input_ids, position_ids     this rank's tokens and their global positions
        labels, shift_labels        their next-token targets (the same tensor; HF computes a loss only
                                    when ``labels`` is given, and then uses ``shift_labels`` as they are)
        attention_mask              this rank's share of the padding mask (0 on the layout's padding too),
                                    only where some token is padding (``hf_fpdt.apply``'s input check
                                    gathers it into the global order for the attention)

    Other keys pass through when they are not per-token; a per-token key it cannot shard raises.
    Picklable (plain fields), so it works with DataLoader worker processes.
    """

    sp_rank: int
    sp_size: int
    chunk_size: int
    pad_token_id: int = 0
    inner: Callable[[list], Any] | None = None
    ring: int = 1  # the SP group's ring degree (hf_fpdt.config.sp_degrees): the layout's rounds

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
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != tuple(input_ids.shape)):
            raise ValueError(
                f"SPCollator takes a 2D attention_mask of the input's shape {tuple(input_ids.shape)}; got "
                f"{tuple(mask.shape)} (a 4D mask spans tokens other ranks hold: train such batches at sp_size 1)"
            )
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
            ring=self.ring,
        )
        out = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
        if mask is not None and not bool(mask.bool().all()):  # any padding: this rank's share, the layout's padding 0
            out["attention_mask"] = pad_sequence(mask.long(), shard.index.numel() * self.sp_size, 0)[:, shard.index]
        if shard.shift_labels is not None:
            out["labels"] = out["shift_labels"] = shard.shift_labels
        out.update(batch)
        return out
