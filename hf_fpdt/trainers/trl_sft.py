"""``FPDTSFTTrainer``: TRL's ``SFTTrainer`` with FPDT sequence parallelism (optional extra ``hf_fpdt[trl]``).

The FPDT side is the trainer's :class:`~hf_fpdt.trainers.adapter.FPDTAdapter` (groups, ``apply``, DP-sharded
loaders collated into this rank's shard, the world's eval loss); TRL keeps everything else: dataset
preparation (tokenizing, completion-only labels, packing), its collator (right padding, or
padding-free rows with ``position_ids``), and its loss. TRL computes the loss with its own fused LM head
(``trl.trainer.utils.add_fused_lm_head``: per-token log-probabilities in tiles, never full logits) over
the backbone that FPDT drives; with pre-shifted ``shift_labels`` from the SP collator it scores each
rank's tokens without shifting, divides by ``num_items_in_batch`` (the valid targets of all ranks) and
scales by the number of processes: the same rule as ``FPDTTrainer``, so the SP loss and gradients equal
one process.

Batches FPDT takes: padded (``padding_free=False``), padding-free, and packed (``packing=True``): rows
whose ``position_ids`` restart at each document are attended as packed documents (blocks across
documents skipped). The varlen keys of TRL's padding-free collator (``cu_seq_lens_*``, ``max_length_*``,
``seq_idx``) describe the unsharded row and are dropped: fpdt finds the documents from the positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from trl import SFTConfig, SFTTrainer

from . import compat_trl
from .accelerate_plugin import FPDTPlugin
from .adapter import FPDTAdapter, FPDTHooks

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class _WithoutVarlenKeys:
    """TRL's collator, less the keys that describe varlen batches of the whole row (picklable)."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, features: list) -> Any:
        batch = self.inner(features)
        for key in VARLEN_KEYS:
            batch.pop(key, None)
        return batch


@contextlib.contextmanager
def _every_rank_counted(accelerator: Any) -> Iterator[None]:
    """Inside: ``gather_for_metrics`` keeps every rank's entry at the last batch.

    TRL gathers per-rank token counts (entropy, accuracy) with ``gather_for_metrics``, which on the last batch keeps
    only as many entries as that batch has samples: under SP the counts of the other ranks' tokens would be dropped.
    The counts are per rank, not per sample, so the cut is turned off meanwhile (training and evaluation).
    """
    loader = accelerator.gradient_state.active_dataloader
    last = loader is not None and getattr(loader, "end_of_dataloader", False)
    remainder = loader.remainder if last else None
    if last:
        loader.remainder = 0  # gather_for_metrics: "no remainder", keep every rank's count
    try:
        yield
    finally:
        if last:
            loader.remainder = remainder


class FPDTSFTTrainer(FPDTHooks, SFTTrainer):
    """TRL's ``SFTTrainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the model object (plain HF; PEFT-wrapped, or ``peft_config=`` for TRL to wrap it). A model
            name is not accepted: FPDT is applied to the model before TRL patches it.
        args: an ``SFTConfig`` (or ``TrainingArguments``, converted by TRL).
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        *trainer_args, **kwargs: passed to ``SFTTrainer``. Evaluation reports losses (and TRL's token
            accuracy and entropy); ``compute_metrics`` is not supported.
    """

    def __init__(
        self,
        model: nn.Module,
        args: SFTConfig | None = None,
        *trainer_args: Any,
        fpdt: FPDTPlugin | None = None,
        **kwargs: Any,
    ) -> None:
        adapter = self.fpdt_adapter = FPDTAdapter(self, model, collate=_WithoutVarlenKeys, eval_num_items=False)
        if kwargs.get("compute_metrics") is not None:
            raise ValueError(
                "FPDTSFTTrainer evaluates losses and TRL's own metrics (mean_token_accuracy, entropy); drop "
                "compute_metrics, or use hf_fpdt.FPDTTrainer with preprocess_logits_for_metrics"
            )
        args = adapter.resolve(args, fpdt, SFTConfig)
        kwargs = adapter.start(model, args, kwargs)
        super().__init__(model, args, *trainer_args, **kwargs)
        adapter.started()

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's loss; its token metrics (entropy, accuracy) count every rank's tokens (:func:`_every_rank_counted`)."""
        with _every_rank_counted(self.accelerator):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """TRL's step; its ``num_tokens`` then counts the samples' tokens (:meth:`_fpdt_count_train_tokens`)."""
        counted = self.fpdt_adapter.counted(inputs)
        before = compat_trl.train_tokens(self)  # the running token count TRL logs as num_tokens
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._fpdt_count_train_tokens(before, counted)
        return loss

    def _fpdt_count_train_tokens(self, before: int, counted: dict[str, torch.Tensor]) -> None:
        """TRL's ``num_tokens`` (the tokens trained on so far) counted from the samples, as on one process.

        After the forward TRL adds the step's tokens: ``attention_mask``'s sum, else ``position_ids``' length (a
        padding-free row), of each rank's inputs, summed over the world. A shard's are not one process's: the
        SP collator drops an all-ones mask (so one row's length is counted) and adds the layout's padding. This
        counts the same way over this rank's share of the samples' tokens (``counted``, from
        :meth:`FPDTAdapter.counted`; without a mask: every one of its tokens, which is one process's rule for a
        batch of all-ones masks or for one padding-free row), and replaces TRL's step count with its sum.
        """
        mask = counted.get("attention_mask")
        mine = mask.sum() if mask is not None else torch.tensor(counted["position_ids"].numel())
        # gather, not gather_for_metrics: these are per-rank counts, not per-sample rows a last batch may cut
        step = int(self.accelerator.gather(mine.to(self.accelerator.device).reshape(1)).sum())
        compat_trl.set_train_tokens(self, before + step)
