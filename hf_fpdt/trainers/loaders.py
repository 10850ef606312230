"""The FPDT trainers' data loaders: the library's own (``Trainer.get_train_dataloader``, TRL's overrides: their
samplers, columns, collators and worker seeding), prepared by the trainer's accelerator
(:class:`~hf_fpdt.trainers.dp_seam.FPDTAccelerator`), which hands each loader to :func:`prepare_loader`: sharded over
the DP ranks (every rank of an SP group draws the same samples) and collated into this rank's shard, or whole
batches for a forward that shards them itself (TRL's fused head)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DataLoader

from .accelerate_plugin import FPDTPlugin

SEQ_LEN_KEY = "fpdt_seq_len"  # the samples' length before the SP layout padded them (not a model input)


class _WithSeqLen:
    """Collate wrapper of sharded loaders: records the whole batch's sequence length (picklable), so the gathered
    predictions drop the layout's padding and the logged token counts count the samples' tokens only.
    ``prediction_step`` and ``training_step`` remove it before the forward."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, features: list) -> Any:
        batch = dict(self.inner(features))
        batch[SEQ_LEN_KEY] = int(batch["input_ids"].shape[-1]) if "input_ids" in batch else None
        return batch


def without_seq_len(inputs: Any) -> Any:
    """``inputs`` less the samples' length the loaders add (inputs that are no mapping, GRPO's prompts, as given)."""
    if isinstance(inputs, Mapping) and SEQ_LEN_KEY in inputs:
        return {k: v for k, v in inputs.items() if k != SEQ_LEN_KEY}
    return inputs


def prepare_loader(
    plugin: FPDTPlugin,
    accelerator: Any,
    loader: DataLoader,
    *,
    whole_batches: bool,
    collate: Callable[[Callable], Callable] | None = None,
) -> DataLoader:
    """``loader`` (the library's, not yet prepared) sharded over the DP world by ``plugin``: whole batches, or
    collated into this rank's shard (its collator wrapped by ``collate`` first, the samples' length recorded).
    ``accelerator``: the trainer's own, which registers the result. ``loader`` is not changed (a shallow copy)."""
    if not whole_batches:
        inner = loader.collate_fn if collate is None else collate(loader.collate_fn)
        loader = copy.copy(loader)
        loader.collate_fn = _WithSeqLen(inner)
    return plugin.prepare_dataloader(loader, accelerator, shard_sequences=not whole_batches)
