"""What the FPDT trainers share: one :class:`FPDTAdapter` per trainer, and the thin :class:`FPDTHooks`.

Each FPDT trainer subclasses its HF / TRL trainer once (``FPDTTrainer(FPDTHooks, Trainer)``,
``FPDTDPOTrainer(_PreferenceHooks, DPOTrainer)``, ...), passes its arguments on to that trainer's ``__init__`` with
the library's own signature, and holds an :class:`FPDTAdapter` (``trainer.fpdt_adapter``), built before the
library's ``__init__`` runs (TRL calls overridden hooks from inside it). The adapter carries everything the trainers
share: the refusals ("needs the model object", settings that would change the loss), the default arguments, the
plugin and its resolution from ``parallelism_config``, the ranks' agreement on the arguments, ``apply``, the
host-memory callback, the trainer's accelerator (:mod:`.dp_seam`, installed once: the library's own loaders
prepared by the plugin, :mod:`.loaders`; a whole-batch trainer under SP holds a DP-level one for its whole life, and
its loop runs TRL's module-level gathers over the DP group), the failures of peers, and the sequence-parallel fused
heads. The token counts are :mod:`.counts`, the evaluation :mod:`.evaluation` (the adapter holds one).

:class:`FPDTHooks` is the trainer side: HF ``Trainer``'s hooks that every FPDT trainer overrides, each one line
handing the library's own method to the adapter (listed in :mod:`.compat_transformers`); it holds no state and has
no ``__init__``. What one trainer family changes (TRL's reference precompute, its rollout) stays in that family's
module, as short overrides delegating to the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainingArguments

from ..distributed.groups import destroy_at_exit
from ..distributed.peers import is_collective_error
from .accelerate_plugin import FPDTPlugin
from .arguments import agree_on_args, check_args, plugin_for
from .compat_transformers import set_gather_function
from .counts import counted
from .dp_seam import DPAccelerator, DPCollectives, FPDTAccelerator
from .evaluation import FPDTEvaluation
from .loaders import prepare_loader, without_seq_len
from .trl_fused_head import install_sp_fused_head

__all__ = ["FPDTAdapter", "FPDTHooks"]


class _ReleaseHostMemory(TrainerCallback):
    """Give the plugin's host pools back at the end of training."""

    def __init__(self, plugin: FPDTPlugin) -> None:
        self.plugin = plugin

    def on_train_end(self, args, state, control, **kwargs):
        self.plugin.release()


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
        self.whole_batches, self.collate = whole_batches, collate
        self.eval_num_items = eval_num_items
        self.module_collectives = module_collectives
        self.plugin: FPDTPlugin  # set by resolve
        self.logits_fn: Callable | None = None
        self.evaluation = FPDTEvaluation(self)

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
        ``__init__``): the trainer holds FPDT's from now on (:mod:`.dp_seam`), whose ``prepare`` shards the library's
        own data loaders over DP (:func:`~hf_fpdt.trainers.loaders.prepare_loader`); a whole-batch trainer under SP
        holds the DP-level one (:class:`DPAccelerator`), so every collective TRL and Trainer run through it goes over
        the DP group. A whole-batch trainer at ``sp_size`` 1 keeps its library's accelerator (DP is the world)."""
        trainer, plugin = self.trainer, self.plugin
        dp_level = self.whole_batches and plugin.sp_size > 1 and plugin.groups is not None
        if self.whole_batches and not dp_level:
            return
        accelerator = trainer.accelerator
        prepare = partial(prepare_loader, plugin, accelerator, whole_batches=self.whole_batches, collate=self.collate)
        if dp_level:
            trainer.accelerator = DPAccelerator(accelerator, plugin.groups, prepare)
            gather = trainer.accelerator.gather_for_metrics
            set_gather_function(trainer, partial(gather, use_gather_object=trainer.args.eval_use_gather_object))
        else:
            trainer.accelerator = FPDTAccelerator(accelerator, prepare)

    @property
    def seam(self) -> DPAccelerator | None:
        """The trainer's DP-level accelerator (whole-batch trainers under SP), else None."""
        accelerator = self.trainer.accelerator
        return accelerator if isinstance(accelerator, DPAccelerator) else None

    def counted(self, inputs: Any, over_dp: bool = False) -> Any:
        """This rank's share of the tokens of ``inputs`` one process counts (:func:`.counts.counted`)."""
        name = getattr(self.trainer.model, "main_input_name", "input_ids")
        return counted(inputs, self.plugin, name, over_dp=over_dp)

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
        return step(model, without_seq_len(inputs), num_items_in_batch)

    def total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a group share theirs, so the DP world counts."""
        return args.train_batch_size * args.gradient_accumulation_steps * self.plugin.dp_size


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
        return self.fpdt_adapter.evaluation.evaluation_loop(super().evaluation_loop, dataloader, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``; an evaluation's ``<prefix>_steps_per_second`` counts one process's steps."""
        return super().log(self.fpdt_adapter.evaluation.eval_logs(logs), *args, **kwargs)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step``: the SP group's loss and predictions (:meth:`FPDTEvaluation.prediction_step`)."""
        step = super().prediction_step
        return self.fpdt_adapter.evaluation.prediction_step(step, model, inputs, prediction_loss_only, ignore_keys)
