"""``FPDTTrainer``: HF ``Trainer`` with FPDT sequence parallelism (an :class:`FPDTPlugin` inside).

Differences from ``Trainer``, each the least that SP needs:

* construction: the plugin builds the SP/DP groups from the training arguments' world and applies
  FPDT to the model (plain or PEFT-wrapped) before ``Trainer`` wraps it (DDP, DeepSpeed, FSDP);
* data loaders: sharded over the DP world and collated into this rank's FPDT shard
  (:meth:`FPDTPlugin.prepare_dataloader`) instead of sharded over every process;
* nothing else in training. ``Trainer`` already counts ``num_items_in_batch`` over every process
  (``average_tokens_across_devices``, required here), which under SP is the whole samples' valid
  targets because every rank counts only its own tokens; it multiplies each rank's loss by the
  number of processes before DDP's world average, which is the SP gradient rule; and its logged loss
  (the world mean of those scaled losses) is the true loss of the global batch;
* evaluation: each step's loss is averaged over the world, so every rank reports the loss of the whole
  global eval batch (``gather_for_metrics`` may then keep any subset of ranks); under SP only losses
  are returned (no ``compute_metrics`` / logits);
* the plugin's host buffers are released when training ends.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import datasets
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

from .accelerate_plugin import FPDTPlugin


class _ReleaseHostMemory(TrainerCallback):
    """Give the plugin's host pools back at the end of training."""

    def __init__(self, plugin: FPDTPlugin) -> None:
        self.plugin = plugin

    def on_train_end(self, args, state, control, **kwargs):
        self.plugin.release()


class FPDTTrainer(Trainer):
    """A ``Trainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the model (plain HF or PEFT); FPDT is applied to it here. ``model_init`` is not supported.
        args: the ``TrainingArguments``.
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        *trainer_args, **kwargs: passed to ``Trainer``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        fpdt: FPDTPlugin | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("FPDTTrainer needs a model (model_init is not supported: FPDT is applied once)")
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        self.fpdt = fpdt if fpdt is not None else FPDTPlugin()
        _check_args(args, self.fpdt.sp_size, kwargs.get("compute_metrics"))
        from accelerate import PartialState

        _ = args.device  # initialises the distributed state the Trainer's Accelerator will use
        self.fpdt.setup(PartialState())
        self.fpdt.apply(model)
        super().__init__(model, args, *trainer_args, **kwargs)
        if self.fpdt.world_size > 1 and not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no loss kwargs, so Trainer cannot pass "
                "num_items_in_batch and every rank would average over its own tokens only"
            )
        self.add_callback(_ReleaseHostMemory(self.fpdt))

    def _get_dataloader(
        self,
        dataset: Dataset,
        description: str,
        batch_size: int,
        sampler_fn=None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        # Trainer's loader, prepared by the plugin (DP-world sampler, layout collate) instead of by
        # accelerator.prepare (whole-world sampler).
        data_collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            data_collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        params = {
            "batch_size": batch_size,
            "collate_fn": data_collator,
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers,
            "multiprocessing_context": self.args.dataloader_multiprocessing_context,
            "prefetch_factor": self.args.dataloader_prefetch_factor,
            "in_order": self.args.dataloader_in_order,
        }
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = self.args.dataloader_drop_last
            if is_training:
                params["worker_init_fn"] = partial(
                    seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
                )
        dataloader = self.fpdt.prepare_dataloader(DataLoader(dataset, **params), self.accelerator)
        if dataloader_key is not None and self.args.dataloader_persistent_workers:
            if not hasattr(self, "_eval_dataloaders"):
                self._eval_dataloaders = {}
            self._eval_dataloaders[dataloader_key] = dataloader
        return dataloader

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a group share theirs, so the DP world counts."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.fpdt.dp_size

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step`` with the step's loss averaged over the world (the global batch's loss)."""
        if self.fpdt.sp_size > 1 and not prediction_loss_only:
            raise ValueError(
                "under sequence parallelism FPDTTrainer evaluates losses only (each rank holds a slice of "
                "the tokens); call evaluate() without compute_metrics, or predict with prediction_loss_only"
            )
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if loss is not None and self.fpdt.world_size > 1:
            # Trainer scaled this rank's share by the number of processes; their mean is the global loss.
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.fpdt.world_group)
            loss /= self.fpdt.world_size
        return loss, logits, labels


def _check_args(args: TrainingArguments, sp_size: int, compute_metrics: Any) -> None:
    """Refuse settings that would silently give another loss or gradient than one process."""
    if not args.average_tokens_across_devices:
        raise ValueError(
            "FPDTTrainer needs average_tokens_across_devices=True: the loss must be divided by the valid "
            "tokens of the whole step (all ranks), not by each rank's share"
        )
    if args.label_smoothing_factor:
        raise ValueError("FPDTTrainer does not support label smoothing (labels arrive pre-shifted and sharded)")
    if args.n_gpu > 1:
        raise ValueError("FPDTTrainer needs one device per process; launch with accelerate/torchrun, not DataParallel")
    if args.train_sampling_strategy == "batch_rebalance":
        raise ValueError("train_sampling_strategy='batch_rebalance' shards over every process; use 'random' with FPDT")
    if sp_size > 1 and compute_metrics is not None:
        raise ValueError("under sequence parallelism FPDTTrainer evaluates losses only; drop compute_metrics")
