"""What the FPDT trainers share: one :class:`FPDTAdapter` per trainer, and the thin :class:`FPDTHooks`.

Each FPDT trainer subclasses its HF / TRL trainer once (``FPDTTrainer(FPDTHooks, Trainer)``,
``FPDTDPOTrainer(_PreferenceHooks, DPOTrainer)``, ...), passes its arguments on to that trainer's ``__init__`` with
the library's own signature, and holds an :class:`FPDTAdapter` (``trainer.fpdt_adapter``), built before the
library's ``__init__`` runs (TRL calls overridden hooks from inside it). The adapter carries everything the trainers
share: the refusals ("needs the model object", settings that would change the loss), the default arguments, the
plugin and its resolution from ``parallelism_config``, the ranks' agreement on the arguments, ``apply``, the
host-memory callback, the loaders (DP-sharded, whole batches or this rank's shard), the token counts, the one DP
seam (:mod:`.dp_seam`: a whole-batch trainer under SP holds a DP-level accelerator for its whole life, and its loop
runs TRL's module-level gathers over the DP group), the sequence-parallel fused heads, and the evaluation's
bookkeeping (the group's loss, predictions in sequence order, one process's steps per second).

:class:`FPDTHooks` is the trainer side: HF ``Trainer``'s hooks that every FPDT trainer overrides, each one line
handing the library's own method to the adapter (listed in :mod:`.compat_transformers`); it holds no state and has
no ``__init__``. What one trainer family changes (TRL's reference precompute, its rollout) stays in that family's
module, as short overrides delegating to the adapter.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

from ..config import IGNORE_INDEX
from ..data.chunks import local_token_index
from ..data.layout import gather_sequence
from ..distributed.groups import destroy_at_exit
from ..distributed.peers import guarded, is_collective_error
from ..integrations.state import state_of
from .accelerate_plugin import FPDTPlugin
from .arguments import agree_on_args, check_args, plugin_for
from .compat_transformers import set_gather_function
from .compat_versions import loader_arguments
from .dp_seam import DPAccelerator, DPCollectives
from .trl_fused_head import install_sp_fused_head

SEQ_LEN_KEY = "fpdt_seq_len"  # the samples' length before the SP layout padded them (not a model input)


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


def _without_seq_len(inputs: Any) -> Any:
    """``inputs`` less the samples' length the loaders add (inputs that are no mapping, GRPO's prompts, as given)."""
    if isinstance(inputs, Mapping) and SEQ_LEN_KEY in inputs:
        return {k: v for k, v in inputs.items() if k != SEQ_LEN_KEY}
    return inputs


def forward_columns(trainer: Any) -> set[str]:
    """The columns HF ``Trainer``'s ``remove_unused_columns`` keeps: the forward's named parameters, the labels."""
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    params = inspect.signature(model.forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return named | {"label", "label_ids", *trainer.label_names}


class FPDTAdapter:
    """What an FPDT trainer adds to its HF / TRL trainer, held by the trainer as ``trainer.fpdt_adapter``.

    Built first in the trainer's ``__init__`` (it refuses anything but a model object), then :meth:`resolve` (the
    default arguments, the plugin) and :meth:`start` (checks, the world, the ranks' agreement on the arguments,
    ``apply``) before the library's ``__init__``, and :meth:`started` after it (the host-memory callback).

    Args:
        trainer: the trainer holding it (read, never rebuilt: its ``args``, ``model``, ``accelerator``, datasets).
        model: the model object; anything else (a name, None) is refused (FPDT is applied to the object once).
        whole_batches: every rank of an SP group gets the whole batches (DP-sharded) for a forward that shards them
            itself (TRL's fused head), and evaluates with the library's own step; else each rank its shard.
        columns: the columns ``remove_unused_columns`` keeps, from the trainer (default: the forward's parameters).
        collate: wraps the trainer's collator before the SP collator shards its batches.
        eval_num_items: the model divided its evaluation loss by ``num_items_in_batch`` (HF ``Trainer``); False: by
            each rank's own valid targets (TRL's SFT evaluates without it).
        module_collectives: ``(trainer, {name: collective}) -> context``: redirects the library's module-level
            collectives to the DP group's for the loop (:func:`hf_fpdt.trainers.compat_trl.module_collectives`).
    """

    def __init__(
        self,
        trainer: Any,
        model: Any,
        *,
        whole_batches: bool = False,
        columns: Callable[[Any], set[str]] = forward_columns,
        collate: Callable[[Callable], Callable] | None = None,
        eval_num_items: bool = True,
        module_collectives: Callable[[Any, Mapping[str, Callable]], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{type(trainer).__name__} needs the model object (e.g. AutoModelForCausalLM.from_pretrained(name)), "
                f"not {model!r}: FPDT is applied to it once, before the trainer wraps it (model_init is not supported)"
            )
        self.trainer = trainer
        self.whole_batches, self.columns, self.collate = whole_batches, columns, collate
        self.eval_num_items = eval_num_items
        self.module_collectives = module_collectives
        self.plugin: FPDTPlugin  # set by resolve
        self.logits_fn: Callable | None = None
        self.eval_steps: int | None = None  # one process's steps of the last evaluation (see eval_logs)

    # ---- set-up -------------------------------------------------------------------------------

    def resolve(self, args: Any, fpdt: FPDTPlugin | None, args_class: type = TrainingArguments) -> Any:
        """The arguments the trainer runs with (``args``, or ``args_class``'s defaults; ``parallelism_config``
        dropped) and the plugin (``fpdt``, or one from ``parallelism_config``'s ``sp_size``, or ``FPDTPlugin()``)."""
        args = args if args is not None else args_class(output_dir="trainer_output")
        args, self.plugin = plugin_for(args, fpdt, type(self.trainer).__name__)
        return args

    def start(self, model: nn.Module, args: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Before the library's ``__init__``: refuse what would change the loss, set up the world and the groups, make
        the ranks agree on ``args`` (every field that changes the step), apply FPDT to ``model``. Returns the keyword
        arguments to pass on: ``kwargs`` less ``preprocess_logits_for_metrics``, which the adapter runs itself."""
        check_args(args, self.plugin.sp_size, type(self.trainer).__name__)
        self.logits_fn = kwargs.get("preprocess_logits_for_metrics")
        if kwargs.get("compute_metrics") is not None and self.logits_fn is None:
            raise ValueError(
                f"{type(self.trainer).__name__} never forms full-sequence logits: with compute_metrics also pass "
                "preprocess_logits_for_metrics, a token-wise reduction it runs tile by tile (e.g. "
                "lambda logits, labels: logits.argmax(-1)); compute_metrics then gets its results"
            )
        from accelerate import PartialState

        _ = args.device  # initialises the distributed state the Trainer's Accelerator will use
        if dist.is_available() and dist.is_initialized():
            # The world a Trainer program runs on (made by TrainingArguments, already at its construction with
            # bf16=True, or here): destroyed before interpreter shutdown unless the program did it first.
            destroy_at_exit(None)
        self.plugin.setup(PartialState())
        agree_on_args(self.plugin.world_group, args)  # every field that changes the step, before anything uses it
        self.plugin.apply(model)
        return {k: v for k, v in kwargs.items() if k != "preprocess_logits_for_metrics"}

    def started(self) -> None:
        """After the library's ``__init__``: the loss-kwargs requirement of sharded sequences, the host-memory
        callback."""
        trainer = self.trainer
        # sharded sequences only: a rank's loss then covers its shard, and Trainer's num_items_in_batch makes the
        # ranks' shares add up to one process's; whole-batch trainers (DPO/KTO/GRPO/RLOO) compute TRL's loss over the
        # whole gathered sequence on every rank (on transformers 5.10 TRL's models report no loss kwargs)
        if self.plugin.world_size > 1 and not self.whole_batches and not trainer.model_accepts_loss_kwargs:
            raise ValueError(
                f"{type(trainer.model).__name__}.forward takes no loss kwargs, so Trainer cannot pass "
                "num_items_in_batch and every rank would average over its own tokens only"
            )
        trainer.add_callback(_ReleaseHostMemory(self.plugin))

    def accelerator_created(self) -> None:
        """After the library created the trainer's accelerator (``create_accelerator_and_postprocess``, inside its
        ``__init__``): a whole-batch trainer under SP holds the DP-level accelerator (:class:`DPAccelerator`) from now
        on, so every collective TRL and Trainer run through it goes over the DP group, and the data loaders the
        library prepares are sharded over DP with whole batches."""
        trainer, plugin = self.trainer, self.plugin
        if not self.whole_batches or plugin.sp_size == 1 or plugin.groups is None:
            return
        prepare = partial(plugin.prepare_dataloader, accelerator=trainer.accelerator, shard_sequences=False)
        trainer.accelerator = DPAccelerator(trainer.accelerator, plugin.groups, prepare)
        gather = trainer.accelerator.gather_for_metrics
        set_gather_function(trainer, partial(gather, use_gather_object=trainer.args.eval_use_gather_object))

    @property
    def seam(self) -> DPAccelerator | None:
        """The trainer's DP-level accelerator (whole-batch trainers under SP), else None."""
        accelerator = self.trainer.accelerator
        return accelerator if isinstance(accelerator, DPAccelerator) else None

    def dp_collectives(self) -> DPCollectives:
        """The DP group's collectives (the seam's, or a sharded trainer's own for its evaluation)."""
        seam = self.seam
        if seam is not None:
            return seam.dp
        return DPCollectives(self.plugin.groups, self.trainer.accelerator.gradient_state)

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """Inside (the trainer's training or evaluation loop): the library's module-level collectives run over the DP
        group too (whole-batch trainers under SP whose library calls any: GRPO, RLOO)."""
        seam = self.seam
        if seam is None or self.module_collectives is None:
            yield
            return
        with self.module_collectives(self.trainer, {"gather": seam.dp.gather, "gather_object": seam.dp.gather_object}):
            yield

    def install_heads(self, *models: nn.Module | None, **head: Any) -> None:
        """The sequence-parallel fused head (hf_fpdt's tiled head; whole batches sharded under SP) on ``models`` (each
        with TRL's head already added; None skipped), at every ``sp_size``, under Accelerate's autocast."""
        for model in models:
            if model is not None:
                install_sp_fused_head(
                    model,
                    self.plugin.sp_group,  # None at sp_size 1: hf_fpdt's tiled head only
                    self.plugin.resolved_chunk_size(),
                    pad_token_id=self.plugin.pad_token_id,
                    autocast=self.trainer.accelerator.autocast,
                    **head,
                )

    @property
    def model(self) -> nn.Module:
        """The model FPDT was applied to (unwrapped from DDP/FSDP/DeepSpeed)."""
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    # ---- data ---------------------------------------------------------------------------------

    def train_loader(self, library: Callable[[], DataLoader]) -> DataLoader:
        """The training loader: every rank of an SP group draws the same samples, collated into its shard. Whole
        batches: the library's own loader (``library``, its ``get_train_dataloader``), which the trainer's accelerator
        prepares (under SP the seam's ``prepare``: sharded over DP)."""
        if self.whole_batches:
            return library()
        dataset, args = self.trainer.train_dataset, self.trainer.args
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = (
                SequentialSampler(dataset) if args.train_sampling_strategy == "sequential" else RandomSampler(dataset)
            )
        return self.loader(dataset, args.train_batch_size, sampler, training=True)

    def eval_dataset(self, eval_dataset: str | Dataset | None) -> Dataset:
        """The dataset to evaluate: ``eval_dataset``, a key of the trainer's ``eval_dataset``, or that dataset."""
        mine = self.trainer.eval_dataset
        if eval_dataset is None and mine is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = mine[eval_dataset]
        return eval_dataset if eval_dataset is not None else mine

    def eval_loader(self, dataset: Dataset) -> DataLoader:
        """The evaluation (or prediction) loader of ``dataset``, in order."""
        sampler = None if isinstance(dataset, IterableDataset) else SequentialSampler(dataset)
        return self.loader(dataset, self.trainer.args.eval_batch_size, sampler, training=False)

    def loader(self, dataset: Dataset, batch_size: int, sampler: Any, training: bool) -> DataLoader:
        """A loader of ``dataset`` built from the training arguments, its columns the forward takes, sharded over the
        DP world and collated into this rank's shard (or whole batches, ``whole_batches``)."""
        args = self.trainer.args
        collate = self.trainer.data_collator
        collate = self.collate(collate) if self.collate is not None else collate
        keep = self.columns(self.trainer) if args.remove_unused_columns else None
        if keep is not None:
            if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
                unused = [c for c in dataset.column_names if c not in keep]
                dataset = dataset.remove_columns(unused) if unused else dataset
            else:
                collate = _KeepKeys(collate, keep)
        if not training or not self.whole_batches:  # training: the length for the token counts (counted)
            collate = _WithSeqLen(collate)
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": collate,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "prefetch_factor": args.dataloader_prefetch_factor,
        }
        params.update(loader_arguments(args))  # the fields newer TrainingArguments have
        if sampler is not None:
            params.update(sampler=sampler, drop_last=args.dataloader_drop_last)
        if training:
            params["worker_init_fn"] = partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            )
        return self.plugin.prepare_dataloader(
            DataLoader(dataset, **params), self.trainer.accelerator, shard_sequences=not self.whole_batches
        )

    # ---- training steps and failures ----------------------------------------------------------

    def train(self, train: Callable, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a collective that fails because a peer is late or dead raises ``SPPeerFailure``."""
        try:
            with self.loop():
                return train(*args, **kwargs)
        except RuntimeError as exc:
            if self.plugin.watch is None or not is_collective_error(exc):
                raise
            raise self.plugin.watch.failure(exc) from exc

    def batch_samples(self, get: Callable, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        """``Trainer.get_batch_samples`` (its token count gathers over the world), watched."""
        if self.plugin.watch is None:
            return get(epoch_iterator, num_batches, device)
        with self.plugin.watch.guard("num_items_in_batch (Trainer.get_batch_samples: gather over the world)"):
            return get(epoch_iterator, num_batches, device)

    def training_step(self, step: Callable, model: nn.Module, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """``Trainer.training_step``, marked so that a peer late for it is named (``train`` raises the error).

        The samples' length the sharded training loaders add (``SEQ_LEN_KEY``) is no model input: the step gets
        the batch without it (Trainer's token counts, ``floating_point_ops`` and ``_track_num_input_tokens``, read it
        from the loop's batch after the step)."""
        if self.plugin.watch is not None:
            self.plugin.watch.mark("training step (DDP forward and gradient reduction, SP all-to-alls)")
        return step(model, _without_seq_len(inputs), num_items_in_batch)

    def total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a group share theirs, so the DP world counts."""
        return args.train_batch_size * args.gradient_accumulation_steps * self.plugin.dp_size

    # ---- logged counts (every metric logged under SP equals one process's) ---------------------

    def counted(self, inputs: Any, over_dp: bool = False) -> Any:
        """The tokens of ``inputs`` that one process would count, this rank's share of them: the per-token fields
        Trainer/TRL count from (the main input, ``attention_mask``, ``position_ids``).

        Sharded batches (``SEQ_LEN_KEY`` given): this rank's positions less the layout's padding (at most
        ``sp_size - 1`` tokens at the sample's end, :func:`~hf_fpdt.data.chunks.local_token_index`), so the
        world's sum of the shares is one process's count. Whole batches (every rank of an SP group holds the
        same ones: the fused-head trainers): all of them on SP rank 0, none on the others, or all of them on every
        rank with ``over_dp`` (a count the DP seam gathers over the DP group). Inputs that are no mapping (GRPO's
        prompts) are returned as they are.
        """
        if not isinstance(inputs, Mapping):  # e.g. GRPO's prompts: nothing Trainer counts
            return inputs
        plugin = self.plugin
        names = (getattr(self.trainer.model, "main_input_name", "input_ids"), "attention_mask", "position_ids")
        fields = [k for k in names if torch.is_tensor(inputs.get(k)) and inputs[k].dim() == 2]
        seq_len = inputs.get(SEQ_LEN_KEY)
        if seq_len is None:
            keep = slice(None) if plugin.sp_rank == 0 or over_dp else slice(0, 0)
        else:
            index = local_token_index(seq_len, plugin.resolved_chunk_size(), plugin.sp_size, plugin.sp_rank)
            keep = (index < seq_len).to(inputs[fields[0]].device) if fields else slice(None)
        return {k: inputs[k][:, keep] for k in fields}

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluation_loop(self, loop: Callable, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop`` gathering each step's results over the DP ranks only.

        Every SP rank of a group holds the group's whole results (loss, predictions, labels), so gathering
        over the world would count each sample ``sp_size`` times, and Accelerate's trimming of the last
        batch (which counts samples per DP rank) would keep the wrong rows. Trainer resets
        ``gather_function`` at the end of its loop; it is set again on every call.
        """
        objects = self.trainer.args.eval_use_gather_object
        set_gather_function(self.trainer, partial(self.dp_collectives().gather_for_metrics, use_gather_object=objects))
        with self.loop():
            output = loop(dataloader, *args, **kwargs)
        # one process's number of steps, for the evaluation's steps_per_second (see eval_logs)
        self.eval_steps = math.ceil(output.num_samples / (self.trainer.args.eval_batch_size * self.plugin.dp_size))
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
        inputs = _without_seq_len(inputs)
        if self.whole_batches:
            return step(model, inputs, prediction_loss_only, ignore_keys)
        plugin, want = self.plugin, not prediction_loss_only
        if want and self.logits_fn is None and plugin.sp_size > 1:
            raise ValueError(
                f"predictions under sequence parallelism (sp_size={plugin.sp_size}) come from "
                "preprocess_logits_for_metrics, a token-wise reduction FPDTTrainer runs tile by tile (e.g. lambda "
                "logits, labels: logits.argmax(-1)): pass it to the trainer, or set prediction_loss_only=True in "
                "the training arguments for losses only; full [B, S, vocab] logits are never formed under SP"
            )
        state = state_of(self.model)
        tiled = want and self.logits_fn is not None and state is not None and "loss" in state.parts
        if tiled:  # the tiled head runs logits_fn
            inputs = {**inputs, "logits_fn": self.logits_fn}
        loss, preds, labels = step(model, inputs, not want, ignore_keys)
        if loss is not None and plugin.world_size > 1:
            loss = self.group_loss(loss, inputs.get("shift_labels"))
        if not want or preds is None:
            return loss, None, None
        if self.logits_fn is not None and not tiled:  # a model without the tiled head: HF's full logits
            preds = self.logits_fn(preds, labels)
        return loss, *self.sequence_order(preds, labels, seq_len)

    def group_loss(self, loss: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
        """The loss of the step's global batch (every rank's token losses over every rank's valid targets),
        what one process computes on that batch, from every rank's share.

        One all-gather of ``(share, valid targets)`` over the world; each rank's token-loss sum is its share
        times the divisor the loss used (``num_items_in_batch`` over the world size with ``eval_num_items``, else
        the rank's own valid targets, at least 1). Every rank gets the same value; the DP gather then weights it by
        the global batch's real samples (one process's weighting).
        """
        plugin = self.plugin
        share = loss.detach().to(plugin.device, torch.float64).sum()
        valid = share.new_zeros(()) if shift_labels is None else (shift_labels != IGNORE_INDEX).sum().to(share)
        row = torch.stack([share, valid])  # built where the collective runs: no host round trip
        rows = [torch.empty_like(row) for _ in range(plugin.world_size)]
        with guarded(plugin.world_group, "all_gather of the evaluation loss shares over the world"):
            dist.all_gather(rows, row, group=plugin.world_group)
        table = torch.stack(rows).cpu()  # [world, 2]
        shares, counts = table[:, 0], table[:, 1]
        divisor = (counts.sum() / plugin.world_size).expand_as(counts) if self.eval_num_items else counts.clamp(min=1)
        return ((shares * divisor).sum() / counts.sum()).to(loss.dtype).to(loss.device)

    def sequence_order(
        self, preds: torch.Tensor, labels: torch.Tensor | None, seq_len: int | None = None
    ) -> tuple[torch.Tensor, Any]:
        """This rank's per-token tensors ``[B, L, ...]`` -> its SP group's ``[B, S, ...]`` in sequence order
        (``S = seq_len``, the layout's padding dropped; ``P * L`` when unknown), and the targets back to HF's
        unshifted labels (``labels[t]`` = target of ``t - 1``)."""
        group, chunk = self.plugin.sp_group, self.plugin.resolved_chunk_size()
        total = preds.shape[1] * self.plugin.sp_size if seq_len is None else seq_len
        preds = gather_sequence(preds.contiguous(), group, total, chunk)
        if labels is None:
            return preds, None
        targets = gather_sequence(labels.contiguous(), group, total, chunk)
        return preds, F.pad(targets[:, :-1], (1, 0), value=IGNORE_INDEX)


class FPDTHooks:
    """HF ``Trainer``'s hooks every FPDT trainer overrides, each handing the library's method to the trainer's
    :class:`FPDTAdapter` (``self.fpdt_adapter``, built in the trainer's ``__init__``). No state, no ``__init__``:
    put it before the library's trainer in the bases (``class FPDTTrainer(FPDTHooks, Trainer)``)."""

    fpdt_adapter: FPDTAdapter

    @property
    def fpdt(self) -> FPDTPlugin:
        """The plugin (SP/DP groups, chunk size, ``apply``)."""
        return self.fpdt_adapter.plugin

    @property
    def fpdt_model(self) -> nn.Module:
        """The model FPDT was applied to (unwrapped from DDP/FSDP/DeepSpeed)."""
        return self.fpdt_adapter.model

    def get_train_dataloader(self) -> DataLoader:
        """The training loader: every rank of an SP group draws the same samples, collated into its shard."""
        return self.fpdt_adapter.train_loader(super().get_train_dataloader)

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """The evaluation loader (``eval_dataset``: a dataset, a key of ``self.eval_dataset``, or None)."""
        if self.fpdt_adapter.whole_batches:
            return super().get_eval_dataloader(eval_dataset)
        return self.fpdt_adapter.eval_loader(self.fpdt_adapter.eval_dataset(eval_dataset))

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """The prediction loader of ``test_dataset``."""
        if self.fpdt_adapter.whole_batches:
            return super().get_test_dataloader(test_dataset)
        return self.fpdt_adapter.eval_loader(test_dataset)

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s accelerator; a whole-batch trainer under SP holds the DP seam's (:mod:`.dp_seam`)."""
        super().create_accelerator_and_postprocess()
        self.fpdt_adapter.accelerator_created()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a collective that fails because a peer is late or dead raises ``SPPeerFailure``."""
        return self.fpdt_adapter.train(super().train, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """``Trainer.get_batch_samples`` (its token count gathers over the world), watched."""
        return self.fpdt_adapter.batch_samples(super().get_batch_samples, epoch_iterator, num_batches, device)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step`` without the loaders' samples' length, marked for naming a late peer."""
        return self.fpdt_adapter.training_step(super().training_step, model, inputs, num_items_in_batch)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a group share theirs, so the DP world counts."""
        return self.fpdt_adapter.total_train_batch_size(args)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """``Trainer.floating_point_ops`` (its ``total_flos``: the world's sum) of this rank's share of the
        samples' tokens, not of its shard (layout padding) or, for whole batches, of every SP rank's copy."""
        return super().floating_point_ops(self.fpdt_adapter.counted(inputs))

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """``num_input_tokens_seen`` (and so ``train_tokens_per_second``) from this rank's share of the samples'
        tokens; Trainer gathers the shares over the world (its private hook: compat_transformers.OVERRIDDEN)."""
        adapter = self.fpdt_adapter
        return super()._track_num_input_tokens(adapter.counted(inputs, over_dp=adapter.seam is not None))

    def evaluation_loop(self, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop`` gathering each step's results over the DP ranks only."""
        return self.fpdt_adapter.evaluation_loop(super().evaluation_loop, dataloader, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``; an evaluation's ``<prefix>_steps_per_second`` counts one process's steps."""
        return super().log(self.fpdt_adapter.eval_logs(logs), *args, **kwargs)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step``: the SP group's loss and predictions (:meth:`FPDTAdapter.prediction_step`)."""
        step = super().prediction_step
        return self.fpdt_adapter.prediction_step(step, model, inputs, prediction_loss_only, ignore_keys)
