"""An FPDT trainer's evaluation (:class:`FPDTEvaluation`): the SP group's loss and predictions, gathered over the DP
ranks only, and one process's steps per second.

Every SP rank of a group holds the group's whole results (loss, predictions, labels), so gathering over the world
would count each sample ``sp_size`` times: each step's results go over the DP group (the seam's collectives,
:class:`~hf_fpdt.trainers.dp_seam.DPCollectives`). Sharded trainers compute each rank's share of the loss and
combine the shares over the world (:meth:`FPDTEvaluation.group_loss`), and put the per-token predictions back in
sequence order over the SP group; whole-batch trainers run the library's own step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ..config import IGNORE_INDEX
from ..data.layout import gather_sequence
from ..distributed.peers import guarded
from ..integrations.state import state_of
from .compat_transformers import set_gather_function
from .loaders import SEQ_LEN_KEY, without_seq_len


class FPDTEvaluation:
    """The evaluation of the trainer an :class:`~hf_fpdt.trainers.adapter.FPDTAdapter` serves (``adapter``: its
    trainer, plugin, ``logits_fn``, ``whole_batches``, ``eval_num_items``, DP collectives and loop context, read at
    each call)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.eval_steps: int | None = None  # one process's steps of the last evaluation (see eval_logs)

    def evaluation_loop(self, loop: Callable, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop`` gathering each step's results over the DP ranks only.

        Every SP rank of a group holds the group's whole results (loss, predictions, labels), so gathering
        over the world would count each sample ``sp_size`` times, and Accelerate's trimming of the last
        batch (which counts samples per DP rank) would keep the wrong rows. Trainer resets
        ``gather_function`` at the end of its loop; it is set again on every call.
        """
        adapter = self.adapter
        settings = adapter.trainer.args
        gather = adapter.dp_collectives().gather_for_metrics
        set_gather_function(adapter.trainer, partial(gather, use_gather_object=settings.eval_use_gather_object))
        with adapter.loop():
            output = loop(dataloader, *args, **kwargs)
        # one process's number of steps, for the evaluation's steps_per_second (see eval_logs)
        self.eval_steps = math.ceil(output.num_samples / (settings.eval_batch_size * adapter.plugin.dp_size))
        return output

    def eval_logs(self, logs: dict[str, float]) -> dict[str, float]:
        """``logs`` with an evaluation's ``<prefix>_steps_per_second`` counting one process's steps.

        ``Trainer.evaluate`` counts ``ceil(samples / (eval_batch_size * world_size))`` steps, but the SP ranks of
        a group share their batches: each rank ran ``ceil(samples / (eval_batch_size * dp_size))``, the number
        :meth:`evaluation_loop` left (consumed by the next log, which is the evaluation's own)."""
        steps, self.eval_steps = self.eval_steps, None
        for key in [k for k in logs if k.endswith("_steps_per_second") and k != "train_steps_per_second"]:
            runtime = logs.get(key.removesuffix("_steps_per_second") + "_runtime")
            if steps is not None and runtime:  # in place: Trainer.evaluate returns this dict (its own)
                logs[key] = round(steps / runtime, 3)  # rounded as transformers' speed_metrics rounds it
        return logs

    def prediction_step(
        self, step: Callable, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step`` (``step``) with the SP group's loss and, unless loss only, its predictions.

        Returns ``(loss of the step's global batch, predictions [B, S, ...] of its samples in sequence order,
        their unshifted labels [B, S])``. Predictions come from ``preprocess_logits_for_metrics`` run tile by
        tile; without it, at ``sp_size == 1``, the full logits ``[B, S, V]`` (what the ``sdpa`` model returns,
        formed only here), and under SP a ``ValueError`` naming the argument. Whole-batch trainers: the library's
        step, whose loss is already the SP group's (results are gathered over DP by :meth:`evaluation_loop`).
        """
        seq_len = inputs.get(SEQ_LEN_KEY) if isinstance(inputs, Mapping) else None
        inputs = without_seq_len(inputs)
        if self.adapter.whole_batches:
            return step(model, inputs, prediction_loss_only, ignore_keys)
        plugin, want = self.adapter.plugin, not prediction_loss_only
        if want and self.adapter.logits_fn is None and plugin.sp_size > 1:
            raise ValueError(
                f"predictions under sequence parallelism (sp_size={plugin.sp_size}) come from "
                "preprocess_logits_for_metrics, a token-wise reduction FPDTTrainer runs tile by tile (e.g. lambda "
                "logits, labels: logits.argmax(-1)): pass it to the trainer, or set prediction_loss_only=True in "
                "the training arguments for losses only; full [B, S, vocab] logits are never formed under SP"
            )
        state = state_of(self.adapter.model)
        tiled = want and self.adapter.logits_fn is not None and state is not None and "loss" in state.parts
        if tiled:  # the tiled head runs logits_fn
            inputs = {**inputs, "logits_fn": self.adapter.logits_fn}
        loss, preds, labels = step(model, inputs, not want, ignore_keys)
        if loss is not None and plugin.world_size > 1:
            loss = self.group_loss(loss, inputs.get("shift_labels"))
        if not want or preds is None:
            return loss, None, None
        if self.adapter.logits_fn is not None and not tiled:  # a model without the tiled head: HF's full logits
            preds = self.adapter.logits_fn(preds, labels)
        return loss, *self.sequence_order(preds, labels, seq_len)

    def group_loss(self, loss: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
        """The loss of the step's global batch (every rank's token losses over every rank's valid targets),
        what one process computes on that batch, from every rank's share.

        One all-gather of ``(share, valid targets)`` over the world; each rank's token-loss sum is its share
        times the divisor the loss used (``num_items_in_batch`` over the world size with ``eval_num_items``, else
        the rank's own valid targets, at least 1). Every rank gets the same value; the DP gather then weights it by
        the global batch's real samples (one process's weighting).
        """
        plugin = self.adapter.plugin
        share = loss.detach().to(plugin.device, torch.float64).sum()
        valid = share.new_zeros(()) if shift_labels is None else (shift_labels != IGNORE_INDEX).sum().to(share)
        row = torch.stack([share, valid])  # built where the collective runs: no host round trip
        rows = [torch.empty_like(row) for _ in range(plugin.world_size)]
        with guarded(plugin.world_group, "all_gather of the evaluation loss shares over the world"):
            dist.all_gather(rows, row, group=plugin.world_group)
        table = torch.stack(rows).cpu()  # [world, 2]
        shares, counts = table[:, 0], table[:, 1]
        whole = self.adapter.eval_num_items  # the loss divided by num_items_in_batch: the world's valid targets
        divisor = (counts.sum() / plugin.world_size).expand_as(counts) if whole else counts.clamp(min=1)
        return ((shares * divisor).sum() / counts.sum()).to(loss.dtype).to(loss.device)

    def sequence_order(
        self, preds: torch.Tensor, labels: torch.Tensor | None, seq_len: int | None = None
    ) -> tuple[torch.Tensor, Any]:
        """This rank's per-token tensors ``[B, L, ...]`` -> its SP group's ``[B, S, ...]`` in sequence order
        (``S = seq_len``, the layout's padding dropped; ``P * L`` when unknown), and the targets back to HF's
        unshifted labels (``labels[t]`` = target of ``t - 1``)."""
        group, chunk = self.adapter.plugin.sp_group, self.adapter.plugin.resolved_chunk_size()
        ring = self.adapter.plugin.resolved_ring_degree()
        total = preds.shape[1] * self.adapter.plugin.sp_size if seq_len is None else seq_len
        with guarded(group, "all_gather of the predictions (evaluation's sequence order)"):
            preds = gather_sequence(preds.contiguous(), group, total, chunk, ring=ring)
        if labels is None:
            return preds, None
        with guarded(group, "all_gather of the labels (evaluation's sequence order)"):
            targets = gather_sequence(labels.contiguous(), group, total, chunk, ring=ring)
        return preds, F.pad(targets[:, :-1], (1, 0), value=IGNORE_INDEX)
