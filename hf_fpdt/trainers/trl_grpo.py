"""``FPDTGRPOTrainer`` and ``FPDTRLOOTrainer``: TRL's online RL trainers with FPDT sequence parallelism.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` generate completions inside the trainer, score them with reward
functions, and train on prompt + completion with per-token log-probabilities from their fused LM head. Under
SP (``sp_size > 1``) an SP group of processes plays the part of one data-parallel process of TRL:

* **data**: every rank of an SP group draws the same prompts (TRL's ``RepeatSampler``, sharded over the DP
  ranks only) as whole samples; ``generation_batch_size`` counts the DP world
  (``per_device_train_batch_size * dp_size * steps_per_generation``; ``steps_per_generation`` is kept);
* **rollout**: every rank of the group calls HF ``generate`` with the same prompts, and the prompt's prefill runs
  sequence-parallel (:mod:`hf_fpdt.integrations.sp_generation`, which also checks that the ranks sample with the
  same random state). The ranks of a group are seeded alike (``seed + dp_rank``, where TRL seeds
  ``seed + process_index``), so DP rank ``d`` samples what TRL's process ``d`` samples; each decode step takes SP
  rank 0's logits, so the group generates one set of completions whatever its ranks compute. The completions are
  then compared (a digest per rank: a cheap check that catches a ``rollout_func`` that reads the rank), and ranks
  that hold different ones raise :class:`~hf_fpdt.distributed.agreement.SPAgreementError` alike. vLLM and
  continuous batching are refused under SP;
* **rewards and advantages**: computed as TRL does, then SP rank 0's broadcast to its group (the group's one DP
  rank: no result depends on its ranks computing alike, e.g. a reward model's last bit); TRL's collectives (rewards,
  completion logs, completion lengths, token counts, KL/entropy/clip statistics, the slice of this process) run over
  the DP group, one copy per SP group, never over the world (which would count each sample ``sp_size`` times): the
  trainer holds the DP seam's accelerator (:mod:`hf_fpdt.trainers.dp_seam`), and while its loop runs TRL's
  module-level ``gather`` / ``gather_object`` are the DP group's
  (:func:`~hf_fpdt.trainers.compat_trl.module_collectives`); the loaders are TRL's own, sharded over DP by the
  seam's ``prepare``;
* **training forward**: :func:`~hf_fpdt.trainers.trl_fused_head.install_sp_fused_head` on the policy (the
  PEFT base model TRL patched) and on a separate reference model: each whole-batch fused-head call runs this
  rank's shard and returns per-token ``log_probs`` / ``entropy`` of the whole sequence, so TRL's loss code (the
  KL term, the clipping against the old policy, every ``loss_type``'s normalisation) runs unchanged on
  whole-sequence tensors and gives one process's loss; gradients equal one process after DDP's average.

So losses, logged metrics and parameters equal TRL's run on ``dp_size`` processes (one process at ``dp_size
== 1``) for the same completions. At ``sp_size == 1`` the trainers are TRL's, with FPDT applied to the model.
"""

from __future__ import annotations

import copy
from typing import Any

from accelerate.utils import is_peft_model, set_seed
from torch import nn
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from ..distributed.agreement import agree, from_first_rank
from ..distributed.digests import agree_on_weights
from . import compat_trl
from .accelerate_plugin import FPDTPlugin
from .adapter import FPDTAdapter, FPDTHooks

_ADVICE = (
    "every rank of an SP group must generate the same completions: seed every rank alike (the trainer seeds "
    "seed + dp_rank), keep reward functions and rollout functions deterministic, and use HF generate"
)


class _RolloutHooks(FPDTHooks):
    """What SP changes in TRL's online trainers (GRPO, RLOO) besides :class:`FPDTHooks` (see the module docstring);
    put it before TRL's trainer in the bases, with ``_config_class``."""

    _config_class: type = GRPOConfig

    def __init__(
        self,
        model: nn.Module,
        reward_funcs: Any = None,
        args: Any = None,
        *,
        fpdt: FPDTPlugin | None = None,
        **kwargs: Any,
    ) -> None:
        adapter = self.fpdt_adapter = FPDTAdapter(
            self, model, whole_batches=True, module_collectives=compat_trl.module_collectives
        )
        args = adapter.resolve(args, fpdt, self._config_class)
        plugin = adapter.plugin
        if plugin.sp_size > 1:
            args = self._sp_args(args, plugin.sp_size, type(self).__name__)
        kwargs = adapter.start(model, args, kwargs)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        adapter.started()
        if plugin.sp_size > 1 and compat_trl.is_vlm(self):
            raise ValueError(
                f"{type(self).__name__} under sequence parallelism scores token ids (each rank embeds its own shard); "
                "vision-language inputs train at sp_size 1"
            )
        self._fpdt_models()
        # TRL seeded seed + process_index; an SP group samples and shuffles as one process: seed + dp_rank (again
        # after FPDT met the reference model, so the rollouts draw from TRL's random state at any sp_size)
        set_seed(self.args.seed + plugin.dp_rank)

    def _sp_args(self, args: Any, sp_size: int, name: str) -> Any:
        """The arguments as the DP world sees them (a copy; the caller's object is not written)."""
        if args.use_vllm:
            raise ValueError(
                f"{name}: vLLM generation under sequence parallelism (sp_size={sp_size}) is not supported: every "
                "rank of an SP group must generate the same completions, and vLLM runs outside the SP group. Set "
                "use_vllm=False (HF generate, whose prefill runs sequence-parallel), or train at sp_size 1"
            )
        if args.use_transformers_continuous_batching:
            raise ValueError(
                f"{name}: continuous batching (use_transformers_continuous_batching) under sequence parallelism "
                f"(sp_size={sp_size}) is not supported; set it to False (HF generate), or train at sp_size 1"
            )
        world = args.world_size
        if world % sp_size:
            raise ValueError(f"sp_size={sp_size} does not divide the {world} processes")
        dp = world // sp_size
        args = copy.copy(args)
        args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
        if args.generation_batch_size % args.num_generations:
            raise ValueError(
                f"generation_batch_size ({args.generation_batch_size} = per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x dp_size {dp} x steps_per_generation "
                f"{args.steps_per_generation} under sequence parallelism) must be divisible by num_generations "
                f"({args.num_generations})"
            )
        generations_eval = args.num_generations_eval or args.num_generations
        if args.do_eval and args.eval_strategy != "no" and (args.per_device_eval_batch_size * dp) % generations_eval:
            raise ValueError(
                f"the global eval batch size ({args.per_device_eval_batch_size} x dp_size {dp}) must be divisible "
                f"by the number of generations used for evaluation ({generations_eval})"
            )
        return args

    def _fpdt_models(self) -> None:
        """FPDT on a separate reference model, and the sequence-parallel fused head on the policy and on it."""
        plugin = self.fpdt_adapter.plugin
        ref = getattr(self, "ref_model", None)
        ref = self.accelerator.unwrap_model(ref) if ref is not None else None
        cast = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
        if ref is not None:
            # TRL added its fused head to the reference model before FPDT could be applied; apply wraps that forward
            # (answering fused-head calls itself), so the head goes on again, outside, as on the policy
            plugin.apply(ref)
            agree_on_weights(plugin.world_group, ref, "the reference model's weights (ref_model)")
            compat_trl.add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=cast)
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        # the reference: prepared (Accelerate's wrapper) before, hence the adapter's autocast
        self.fpdt_adapter.install_heads(policy, ref, temperature=self.temperature, head_fp32=cast)

    # ---- one rollout per SP group ----------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over the DP group by the seam), SP rank 0's: the group's one DP rank."""
        rows = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        plugin = self.fpdt_adapter.plugin
        if plugin.sp_size == 1:
            return rows
        return from_first_rank(plugin.sp_group, rows, "the rewards of the completions")

    def _generate(self, prompts: list):
        """TRL's rollout; under SP the ranks of a group check that they generated the same completions."""
        out = super()._generate(prompts)
        plugin = self.fpdt_adapter.plugin
        if plugin.sp_size > 1:
            agree(plugin.sp_group, compat_trl.generated(self, out), what="the completions generated", advice=_ADVICE)
        return out

    def _generate_and_score_completions(self, inputs: list) -> dict:
        """TRL's rollout, rewards and advantages (its collectives over the DP group); the advantages SP rank 0's."""
        out = super()._generate_and_score_completions(inputs)
        plugin = self.fpdt_adapter.plugin
        if plugin.sp_size > 1 and out.get("advantages") is not None:  # computed alike from the same rewards
            out = {**out, "advantages": from_first_rank(plugin.sp_group, out["advantages"], "the advantages")}
        return out


class FPDTGRPOTrainer(_RolloutHooks, GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the model object (plain HF; PEFT-wrapped, or ``peft_config=`` for TRL to wrap it). A model
            name is not accepted: FPDT is applied to it before TRL patches it. With ``beta > 0`` and no PEFT,
            TRL loads the reference model from ``model.config.name_or_path``; FPDT is applied to it too.
        reward_funcs: as ``GRPOTrainer``'s.
        args: a ``GRPOConfig``. Under SP: ``use_vllm=False`` and no continuous batching (HF ``generate``, every
            rank of a group generating alike); ``generation_batch_size`` counts the DP world.
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        **kwargs: passed to ``GRPOTrainer`` by name (``train_dataset``, ``processing_class``, ``peft_config``, ...).
    """

    _config_class = GRPOConfig


class FPDTRLOOTrainer(_RolloutHooks, RLOOTrainer):
    """TRL's ``RLOOTrainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    As :class:`FPDTGRPOTrainer`; under SP, ``beta`` must be 0: RLOO's KL penalty enters the rewards through a
    gather over every process inside TRL, which would mix the SP ranks' copies (use :class:`FPDTGRPOTrainer`,
    whose KL term is part of the loss, or train at sp_size 1).
    """

    _config_class = RLOOConfig

    def _sp_args(self, args: Any, sp_size: int, name: str) -> Any:
        if args.beta != 0.0:
            raise ValueError(
                f"{name} under sequence parallelism (sp_size={sp_size}) supports beta=0.0 only (got {args.beta}): "
                "RLOO subtracts its KL penalty from the rewards after a gather over every process, which would "
                "count each SP group's samples sp_size times. Set beta=0.0, use FPDTGRPOTrainer (KL in the loss), "
                "or train at sp_size 1"
            )
        return super()._sp_args(args, sp_size, name)
