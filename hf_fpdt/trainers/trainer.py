"""``FPDTTrainer``: HF ``Trainer`` with FPDT sequence parallelism (an :class:`FPDTPlugin` inside).

Differences from ``Trainer``, each the least that SP needs, all through Trainer's public hooks
(``get_train_dataloader``, ``get_eval_dataloader``, ``get_test_dataloader``, ``prediction_step``,
``get_total_train_batch_size``, callbacks; no private method is overridden):

* construction: the plugin builds the SP/DP groups from the training arguments' world and applies
  FPDT to the model (plain or PEFT-wrapped) before ``Trainer`` wraps it (DDP, DeepSpeed, FSDP);
* data loaders: built from the training arguments (batch size, workers, sampling), columns the model's
  forward does not take dropped (``remove_unused_columns``), then sharded over the DP world and collated
  into this rank's FPDT shard (:meth:`FPDTPlugin.prepare_dataloader`) instead of sharded over every process;
* nothing else in training. ``Trainer`` already counts ``num_items_in_batch`` over every process
  (``average_tokens_across_devices``, required here), which under SP is the whole samples' valid
  targets because every rank counts only its own tokens; it multiplies each rank's loss by the
  number of processes before DDP's world average, which is the SP gradient rule; and its logged loss
  (the world mean of those scaled losses) is the true loss of the global batch;
* evaluation: each step's loss is the loss of the global batch (all ranks' token losses over all valid
  targets, what one process computes on that batch), and results are gathered over the DP ranks only, one
  copy per SP group, the last batch cut to the samples it holds: loss, metrics and prediction rows equal
  one process with the global batch for any eval set size and batch size (with ``dp > 1``, a last batch
  that Accelerate filled up with repeated samples counts them in its loss). Predictions for
  ``compute_metrics`` come from ``preprocess_logits_for_metrics`` (required with ``compute_metrics``, e.g.
  ``lambda logits, labels: logits.argmax(-1)``), which runs inside the model's tiled LM head on one tile
  of tokens at a time (``logits [1, n, V]`` and those tokens' *targets*), so logits never exist for the
  whole sequence; its per-token results are gathered over the SP group in sequence order.
  ``compute_metrics`` then gets what HF's ``Trainer`` gives it: predictions ``[B, S, ...]`` at every
  position and the unshifted labels ``[B, S]`` (position 0: -100), so the same function works with and
  without FPDT (the evaluation loaders' batches carry the samples' length, ``fpdt_seq_len``, so the
  layout's padding is dropped again);
* the plugin's host buffers are released when training ends; the world the Trainer runs on (which
  ``TrainingArguments`` or this trainer initialised) and the SP/DP groups are destroyed at interpreter exit
  unless the program did it first;
* failures: the world's collectives wait at most ``sp_timeout`` (:class:`FPDTPlugin`), and one that fails
  because a peer is late or dead (Trainer's token count, DDP's forward and gradient reduction, logging)
  raises :class:`~hf_fpdt.core.agreement.SPPeerFailure` naming that peer, the collective and the timeout
  (``get_batch_samples`` and ``training_step`` mark where each rank is; ``train`` translates the error).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

from ..config import IGNORE_INDEX
from ..core.agreement import gather_rows, guarded, is_collective_error
from ..core.groups import destroy_at_exit
from ..core.step_inputs import agree_on_args
from ..data.chunks import local_token_index
from ..data.layout import gather_sequence
from ..integrations.state import state_of
from .accelerate_plugin import FPDTPlugin
from .compat_transformers import set_gather_function
from .compat_versions import loader_arguments


class _ReleaseHostMemory(TrainerCallback):
    """Give the plugin's host pools back at the end of training."""

    def __init__(self, plugin: FPDTPlugin) -> None:
        self.plugin = plugin

    def on_train_end(self, args, state, control, **kwargs):
        self.plugin.release()


class _KeepKeys:
    """Collate wrapper that drops the keys of each feature the model's forward does not take (picklable)."""

    def __init__(self, inner: Callable, keep: set[str]) -> None:
        self.inner, self.keep = inner, keep

    def __call__(self, features: list) -> Any:
        return self.inner([{k: v for k, v in f.items() if k in self.keep} for f in features])


_DP_ROWS = "all_gather of the rows (results gathered over the DP group)"
SEQ_LEN_KEY = "fpdt_seq_len"  # the samples' length before the SP layout padded them (not a model input)


class _WithSeqLen:
    """Collate wrapper of evaluation loaders (and sharded training loaders): records the whole batch's sequence
    length (picklable), so the gathered predictions drop the layout's padding and the logged token counts count
    the samples' tokens only. ``prediction_step`` and ``training_step`` remove it before the forward."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, features: list) -> Any:
        batch = dict(self.inner(features))
        batch[SEQ_LEN_KEY] = int(batch["input_ids"].shape[-1]) if "input_ids" in batch else None
        return batch


class FPDTTrainerMixin:
    """What FPDT changes in a ``Trainer`` (or a subclass such as TRL's ``SFTTrainer``): put it first in the bases.

    Subclasses adapt it through :meth:`_fpdt_default_args`, :meth:`_fpdt_inner_collator` and
    :meth:`_forward_columns`.
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
        args = args if args is not None else self._fpdt_default_args()
        args, self.fpdt = plugin_for(args, fpdt, type(self).__name__)
        _check_args(args, self.fpdt.sp_size)
        self.logits_fn = kwargs.pop("preprocess_logits_for_metrics", None)
        if kwargs.get("compute_metrics") is not None and self.logits_fn is None:
            raise ValueError(
                "FPDTTrainer never forms full-sequence logits: with compute_metrics also pass "
                "preprocess_logits_for_metrics, a token-wise reduction it runs tile by tile (e.g. "
                "lambda logits, labels: logits.argmax(-1)); compute_metrics then gets its results"
            )
        from accelerate import PartialState

        _ = args.device  # initialises the distributed state the Trainer's Accelerator will use
        if dist.is_available() and dist.is_initialized():
            # The world a Trainer program runs on (made by TrainingArguments, already at its construction with
            # bf16=True, or here): destroyed before interpreter shutdown unless the program did it first.
            destroy_at_exit(None)
        self.fpdt.setup(PartialState())
        agree_on_args(self.fpdt.world_group, args)  # every field that changes the step, before anything uses it
        self.fpdt.apply(model)
        super().__init__(model, args, *trainer_args, **kwargs)
        # sharded sequences only: a rank's loss then covers its shard, and Trainer's num_items_in_batch makes the
        # ranks' shares add up to one process's; whole-batch trainers (DPO/KTO/GRPO/RLOO) compute TRL's loss over the
        # whole gathered sequence on every rank (on transformers 5.10 TRL's models report no loss kwargs)
        if self.fpdt.world_size > 1 and self._fpdt_shard_sequences() and not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no loss kwargs, so Trainer cannot pass "
                "num_items_in_batch and every rank would average over its own tokens only"
            )
        self.add_callback(_ReleaseHostMemory(self.fpdt))

    def _fpdt_default_args(self) -> TrainingArguments:
        return TrainingArguments(output_dir="trainer_output")

    # ---- data ---------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """The training loader: every rank of an SP group draws the same samples, collated into its shard."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sequential = self.args.train_sampling_strategy == "sequential"
            sampler = SequentialSampler(dataset) if sequential else RandomSampler(dataset)
        return self._fpdt_loader(dataset, self.args.train_batch_size, sampler, training=True)

    def _fpdt_eval_dataset(self, eval_dataset: str | Dataset | None) -> Dataset:
        """The dataset to evaluate: ``eval_dataset``, a key of ``self.eval_dataset``, or ``self.eval_dataset``."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        return eval_dataset if eval_dataset is not None else self.eval_dataset

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """The evaluation loader (``eval_dataset``: a dataset, a key of ``self.eval_dataset``, or None)."""
        dataset = self._fpdt_eval_dataset(eval_dataset)
        return self._fpdt_loader(dataset, self.args.eval_batch_size, self._sequential(dataset), training=False)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """The prediction loader of ``test_dataset``."""
        return self._fpdt_loader(test_dataset, self.args.eval_batch_size, self._sequential(test_dataset), False)

    @staticmethod
    def _sequential(dataset: Dataset) -> SequentialSampler | None:
        return None if isinstance(dataset, IterableDataset) else SequentialSampler(dataset)

    def _fpdt_inner_collator(self) -> Callable:
        """The collate function whose whole-sample batches the SP collator shards (the trainer's own)."""
        return self.data_collator

    def _fpdt_shard_sequences(self) -> bool:
        """Whether the loaders give each rank its shard of the sequences (True) or whole batches, for a forward
        that shards them itself (TRL's fused head, :mod:`hf_fpdt.trainers.trl_fused_head`)."""
        return True

    def _fpdt_loader(self, dataset: Dataset, batch_size: int, sampler, training: bool) -> DataLoader:
        collate = self._fpdt_inner_collator()
        keep = self._forward_columns()
        if keep is not None:
            if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
                unused = [c for c in dataset.column_names if c not in keep]
                dataset = dataset.remove_columns(unused) if unused else dataset
            else:
                collate = _KeepKeys(collate, keep)
        if not training or self._fpdt_shard_sequences():  # training: the length for the token counts (_fpdt_counted)
            collate = _WithSeqLen(collate)
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": collate,
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers,
            "prefetch_factor": self.args.dataloader_prefetch_factor,
        }
        params.update(loader_arguments(self.args))  # the fields newer TrainingArguments have
        if sampler is not None:
            params.update(sampler=sampler, drop_last=self.args.dataloader_drop_last)
        if training:
            params["worker_init_fn"] = partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            )
        return self.fpdt.prepare_dataloader(
            DataLoader(dataset, **params), self.accelerator, shard_sequences=self._fpdt_shard_sequences()
        )

    def _forward_columns(self) -> set[str] | None:
        """The columns ``remove_unused_columns`` keeps: the forward's named parameters and the label names."""
        if not self.args.remove_unused_columns:
            return None
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        params = inspect.signature(model.forward).parameters
        named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        return named | {"label", "label_ids", *self.label_names}

    # ---- failures -----------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a collective that fails because a peer is late or dead raises ``SPPeerFailure``."""
        try:
            return super().train(*args, **kwargs)
        except RuntimeError as exc:
            if self.fpdt.watch is None or not is_collective_error(exc):
                raise
            raise self.fpdt.watch.failure(exc) from exc

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """``Trainer.get_batch_samples`` (its token count gathers over the world), watched."""
        if self.fpdt.watch is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        with self.fpdt.watch.guard("num_items_in_batch (Trainer.get_batch_samples: gather over the world)"):
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step``, marked so that a peer late for it is named (``train`` raises the error).

        The samples' length the sharded training loaders add (``SEQ_LEN_KEY``) is no model input: the step gets
        the batch without it (Trainer's token counts, :meth:`floating_point_ops` and
        :meth:`_track_num_input_tokens`, read it from the loop's batch after the step)."""
        if self.fpdt.watch is not None:
            self.fpdt.watch.mark("training step (DDP forward and gradient reduction, SP all-to-alls)")
        if isinstance(inputs, Mapping) and SEQ_LEN_KEY in inputs:
            inputs = {k: v for k, v in inputs.items() if k != SEQ_LEN_KEY}
        return super().training_step(model, inputs, num_items_in_batch)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a group share theirs, so the DP world counts."""
        return args.train_batch_size * args.gradient_accumulation_steps * self.fpdt.dp_size

    # ---- logged counts (every metric logged under SP equals one process's) ---------------------

    def _fpdt_counted(self, inputs: Any) -> Any:
        """The tokens of ``inputs`` that one process would count, this rank's share of them: the per-token fields
        Trainer/TRL count from (the main input, ``attention_mask``, ``position_ids``).

        Sharded batches (``SEQ_LEN_KEY`` given): this rank's positions less the layout's padding (at most
        ``sp_size - 1`` tokens at the sample's end, :func:`~hf_fpdt.data.chunks.local_token_index`), so the
        world's sum of the shares is one process's count. Whole batches (every rank of an SP group holds the
        same ones: the fused-head trainers): all of them on SP rank 0, none on the others. Inputs that are no
        mapping (GRPO's prompts) are returned as they are.
        """
        if not isinstance(inputs, Mapping):  # e.g. GRPO's prompts: nothing Trainer counts
            return inputs
        names = (getattr(self.model, "main_input_name", "input_ids"), "attention_mask", "position_ids")
        fields = [k for k in names if torch.is_tensor(inputs.get(k)) and inputs[k].dim() == 2]
        seq_len = inputs.get(SEQ_LEN_KEY)
        if seq_len is None:
            keep = slice(None) if self.fpdt.sp_rank == 0 else slice(0, 0)
        else:
            index = local_token_index(seq_len, self.fpdt.resolved_chunk_size(), self.fpdt.sp_size, self.fpdt.sp_rank)
            keep = (index < seq_len).to(inputs[fields[0]].device) if fields else slice(None)
        return {k: inputs[k][:, keep] for k in fields}

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """``Trainer.floating_point_ops`` (its ``total_flos``: the world's sum) of this rank's share of the
        samples' tokens, not of its shard (layout padding) or, for whole batches, of every SP rank's copy."""
        return super().floating_point_ops(self._fpdt_counted(inputs))

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """``num_input_tokens_seen`` (and so ``train_tokens_per_second``) from this rank's share of the samples'
        tokens (:meth:`_fpdt_counted`); Trainer gathers the shares over the world."""
        # Trainer's private hook (compat_transformers.OVERRIDDEN) counts the main input / attention_mask of the
        # batch it is given; the shard's would count the layout's padding, whole batches sp_size times.
        return super()._track_num_input_tokens(self._fpdt_counted(inputs))

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluation_loop(self, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop`` gathering each step's results over the DP ranks only.

        Every SP rank of a group holds the group's whole results (loss, predictions, labels), so gathering
        over the world would count each sample ``sp_size`` times, and Accelerate's trimming of the last
        batch (which counts samples per DP rank) would keep the wrong rows. Trainer resets
        ``gather_function`` at the end of its loop; it is set again on every call.
        """
        set_gather_function(self, self._gather_for_metrics)
        output = super().evaluation_loop(dataloader, *args, **kwargs)
        # one process's number of steps, for the evaluation's steps_per_second (see log)
        self._fpdt_eval_steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.fpdt.dp_size))
        return output

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``; an evaluation's ``<prefix>_steps_per_second`` counts one process's steps.

        ``Trainer.evaluate`` counts ``ceil(samples / (eval_batch_size * world_size))`` steps, but the SP ranks of
        a group share their batches: each rank ran ``ceil(samples / (eval_batch_size * dp_size))``, the number
        :meth:`evaluation_loop` left (consumed by the next log, which is the evaluation's own)."""
        steps = self.__dict__.pop("_fpdt_eval_steps", None)
        for key in [k for k in logs if k.endswith("_steps_per_second") and k != "train_steps_per_second"]:
            runtime = logs.get(key.removesuffix("_steps_per_second") + "_runtime")
            if steps is not None and runtime:  # in place: Trainer.evaluate returns this dict (its own)
                logs[key] = round(steps / runtime, 3)  # rounded as transformers' speed_metrics rounds it
        return super().log(logs, *args, **kwargs)

    def _gather_for_metrics(self, data: Any, use_gather_object: bool | None = None) -> Any:
        """``Accelerator.gather_for_metrics`` over the DP group: one copy per SP group, in DP rank order,
        the last batch cut to the samples it really holds (the loader's remainder over the DP world)."""
        from accelerate.utils import recursively_apply

        if use_gather_object is None:
            use_gather_object = self.args.eval_use_gather_object
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if not use_gather_object:  # a rank's scalar (a loss, TRL's entropy sum) is one row, as Accelerate gathers it
            data = recursively_apply(lambda t: t.reshape(1) if t.dim() == 0 else t, data)
        group = self.fpdt.dp_group
        if group is not None:
            if use_gather_object:
                pieces: list = [None] * dist.get_world_size(group)
                with guarded(group, "all_gather_object of the evaluation results over the DP group"):
                    dist.all_gather_object(pieces, data, group=group)
                data = [x for piece in pieces for x in (piece if isinstance(piece, list | tuple) else [piece])]
            else:
                data = recursively_apply(partial(gather_rows, group, what=_DP_ROWS), data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            cut = state.remainder
            data = data[:cut] if use_gather_object else recursively_apply(lambda t: t[:cut], data)
        return data

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step`` with the SP group's loss and, unless loss only, its predictions.

        Returns ``(loss of the step's global batch, predictions [B, S, ...] of its samples in sequence order,
        their unshifted labels [B, S])``. Predictions come from ``preprocess_logits_for_metrics`` run tile by
        tile; without it, at ``sp_size == 1``, the full logits ``[B, S, V]`` (what the ``sdpa`` model returns,
        formed only here), and under SP a ``ValueError`` naming the argument.
        """
        seq_len = inputs.get(SEQ_LEN_KEY)
        inputs = {k: v for k, v in inputs.items() if k != SEQ_LEN_KEY}
        want = not prediction_loss_only
        if want and self.logits_fn is None and self.fpdt.sp_size > 1:
            raise ValueError(
                f"predictions under sequence parallelism (sp_size={self.fpdt.sp_size}) come from "
                "preprocess_logits_for_metrics, a token-wise reduction FPDTTrainer runs tile by tile (e.g. lambda "
                "logits, labels: logits.argmax(-1)): pass it to the trainer, or set prediction_loss_only=True in "
                "the training arguments for losses only; full [B, S, vocab] logits are never formed under SP"
            )
        state = state_of(self.fpdt_model)
        tiled = want and self.logits_fn is not None and state is not None and "loss" in state.parts
        if tiled:  # the tiled head runs logits_fn
            inputs = {**inputs, "logits_fn": self.logits_fn}
        loss, preds, labels = super().prediction_step(model, inputs, not want, ignore_keys)
        if loss is not None and self.fpdt.world_size > 1:
            loss = self._group_loss(loss, inputs.get("shift_labels"))
        if not want or preds is None:
            return loss, None, None
        if self.logits_fn is not None and not tiled:  # a model without the tiled head: HF's full logits
            preds = self.logits_fn(preds, labels)
        return loss, *self._sequence_order(preds, labels, seq_len)

    def _group_loss(self, loss: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
        """The loss of the step's global batch (every rank's token losses over every rank's valid targets),
        what one process computes on that batch, from every rank's share.

        One all-gather of ``(share, valid targets)`` over the world; each rank's token-loss sum is its
        share times the divisor the loss used (:meth:`_fpdt_loss_divisor`). Every rank gets the same value;
        the DP gather then weights it by the global batch's real samples (one process's weighting).
        """
        share = loss.detach().to(self.fpdt.device, torch.float64).sum()
        valid = share.new_zeros(()) if shift_labels is None else (shift_labels != IGNORE_INDEX).sum().to(share)
        row = torch.stack([share, valid])  # built where the collective runs: no host round trip
        rows = [torch.empty_like(row) for _ in range(self.fpdt.world_size)]
        with guarded(self.fpdt.world_group, "all_gather of the evaluation loss shares over the world"):
            dist.all_gather(rows, row, group=self.fpdt.world_group)
        table = torch.stack(rows).cpu()  # [world, 2]
        shares, counts = table[:, 0], table[:, 1]
        sums = shares * self._fpdt_loss_divisor(counts, counts.sum())
        return (sums.sum() / counts.sum()).to(loss.dtype).to(loss.device)

    def _fpdt_loss_divisor(self, counts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """What each rank's evaluation loss was divided by, from every rank's valid targets ``counts [world]``
        and their ``total``: ``Trainer`` passes ``num_items_in_batch`` (the world's targets) to the model
        and multiplies by the number of processes."""
        return (total / self.fpdt.world_size).expand_as(counts)

    @property
    def fpdt_model(self) -> nn.Module:
        """The model FPDT was applied to (unwrapped from DDP/FSDP/DeepSpeed)."""
        return self.accelerator.unwrap_model(self.model)

    def _sequence_order(
        self, preds: torch.Tensor, labels: torch.Tensor | None, seq_len: int | None = None
    ) -> tuple[torch.Tensor, Any]:
        """This rank's per-token tensors ``[B, L, ...]`` -> its SP group's ``[B, S, ...]`` in sequence order
        (``S = seq_len``, the layout's padding dropped; ``P * L`` when unknown), and the targets back to HF's
        unshifted labels (``labels[t]`` = target of ``t - 1``)."""
        group, chunk = self.fpdt.sp_group, self.fpdt.resolved_chunk_size()
        total = preds.shape[1] * self.fpdt.sp_size if seq_len is None else seq_len
        preds = gather_sequence(preds.contiguous(), group, total, chunk)
        if labels is None:
            return preds, None
        targets = gather_sequence(labels.contiguous(), group, total, chunk)
        return preds, F.pad(targets[:, :-1], (1, 0), value=IGNORE_INDEX)


class FPDTTrainer(FPDTTrainerMixin, Trainer):
    """A ``Trainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the model (plain HF or PEFT); FPDT is applied to it here. ``model_init`` is not supported.
        args: the ``TrainingArguments``.
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        *trainer_args, **kwargs: passed to ``Trainer``. ``preprocess_logits_for_metrics`` runs tile by
            tile inside the model (see the module docstring) and is required with ``compute_metrics``.
    """


def plugin_for(args: Any, fpdt: FPDTPlugin | None, name: str) -> tuple[Any, FPDTPlugin]:
    """The training arguments and the plugin an FPDT trainer runs with.

    ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))`` (Accelerate's sequence parallelism
    setting) is read as the FPDT SP size: the plugin is ``FPDTPlugin(sp_size=N)`` (a given ``fpdt`` with another
    ``sp_size`` is a ``ValueError``), and the trainer runs on a copy of the arguments without it (Accelerate would
    otherwise start its own DeepSpeed-Ulysses sequence parallelism on the same processes). Other parallelism
    dimensions (tensor, context, sharded or replicated data) are refused. The caller's objects are not written.
    """
    config = getattr(args, "parallelism_config", None)
    if config is None:
        return args, fpdt if fpdt is not None else FPDTPlugin()
    others = {n: getattr(config, n, None) for n in ("tp_size", "cp_size", "dp_shard_size", "dp_replicate_size")}
    others = {n: v for n, v in others.items() if v is not None and v > 1}
    if others:
        raise ValueError(
            f"{name} takes parallelism_config's sp_size only (got {others}): FPDT's data parallelism is the "
            "processes over the SP size; use DeepSpeed ZeRO or FSDP through the Accelerate config for sharding"
        )
    sp_size = getattr(config, "sp_size", None) or 1  # Accelerate's sp_size is new in 1.11
    if fpdt is not None and fpdt.sp_size != sp_size:
        raise ValueError(
            f"{name}: parallelism_config has sp_size={sp_size} and the plugin FPDTPlugin(sp_size={fpdt.sp_size}); "
            "set the sequence-parallel size once (either, or both equal)"
        )
    args = copy.copy(args)
    args.parallelism_config = None
    return args, fpdt if fpdt is not None else FPDTPlugin(sp_size=sp_size)


def _check_args(args: TrainingArguments, sp_size: int) -> None:
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
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by FPDTTrainer; use "
            "'random' or 'sequential' (every rank of an SP group must draw the same samples)"
        )
