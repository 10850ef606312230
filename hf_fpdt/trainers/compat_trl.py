"""TRL's private surface, the one place hf_fpdt's trainers touch it (optional extra ``hf_fpdt[trl]``).

The TRL trainers override private methods of TRL's trainers (the reference precompute of DPO/KTO, the rollout,
reward and scoring steps of GRPO/RLOO), read attributes TRL sets on itself (``_is_vlm``, ``aux_loss_enabled``, the
completion logs ``_logs``), unpack ``_generate``'s tuple by position, and call helpers of ``trl.trainer.utils``.
:data:`HOOKS` names each, with the parameters hf_fpdt relies on; ``tests/unit/test_compat_contract.py`` checks
them against the installed TRL (a renamed override would otherwise stop being called without any error at
``sp_size`` 1). The accessors below are what the trainers call instead of reaching into TRL's objects.

setup.cfg puts no upper bound on TRL: the same check runs when this module is imported (by every FPDT TRL trainer's
module, so ``hf_fpdt.FPDTDPOTrainer`` and ``from hf_fpdt.trainers.trl_dpo import ...`` too), and a TRL release whose
hooks changed is an ``ImportError`` naming its version and each hook that changed (:func:`check_contract`), not a
trainer that silently stops calling an override. A release whose hooks are unchanged works. The check reads the
source of TRL's trainers and of HF's ``Trainer`` once per process (4.2 s measured on the 2-core machine under a load
of 7-13, where importing TRL itself took 37 s; a second check in the process: 0.04 s).
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from typing import Any

from trl.trainer.utils import (  # TRL's internal helpers (checked in HOOKS)
    FusedCausalLMOutput,
    add_fused_lm_head,
    create_model_from_path,
    get_config_model_id,
    repeat_iterable_dataset,
)

from . import compat
from .compat import Hook
from .compat_transformers import COMPUTE_LOSS, PREDICTION_STEP
from .compat_versions import trl_requirement

__all__ = [
    "HOOKS",
    "check_contract",
    "FusedCausalLMOutput",
    "add_fused_lm_head",
    "aux_loss_enabled",
    "completion_logs",
    "eval_sampler",
    "create_model_from_path",
    "fresh_completion_logs",
    "generated",
    "get_config_model_id",
    "is_vlm",
    "repeat_iterable_dataset",
    "set_completion_logs",
    "train_sampler",
]

LOG_KEYS = ("images", "prompt", "completion", "rewards", "advantages", "extra")  # GRPO/RLOO's ``self._logs``
# what ``_generate`` returns first, by position, per trainer (the SP ranks of a group compare them)
GENERATED = {
    "GRPOTrainer": ("prompt_ids", "completion_ids", "tool_mask"),
    "RLOOTrainer": ("prompt_ids", "completion_ids", "completions"),
}
# what the SP fused head fills of TRL's fused-head output
FUSED_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")

_DPO = "overrides it in hf_fpdt.trainers.trl_dpo (the reference precompute with whole batches over DP)"
_ROLL = "hf_fpdt.trainers.trl_grpo"

HOOKS: tuple[Hook, ...] = (
    # ---- the positional arguments the trainers pass on
    Hook("trl:SFTTrainer", "__init__", "method", ("model", "args"), "passes (model, args) on in trl_sft"),
    *(
        Hook(f"trl:{c}", "__init__", "method", ("model", "ref_model", "args"), "passes them on in trl_dpo")
        for c in ("DPOTrainer", "KTOTrainer")
    ),
    *(
        Hook(f"trl:{c}", "__init__", "method", ("model", "reward_funcs", "args"), f"passes them on in {_ROLL}")
        for c in ("GRPOTrainer", "RLOOTrainer")
    ),
    Hook(
        "trl:SFTTrainer",
        "compute_loss",
        "method",
        COMPUTE_LOSS,
        "overrides it in hf_fpdt.trainers.trl_sft (every rank's token counts at the last batch)",
    ),
    # ---- DPO / KTO (hf_fpdt.trainers.trl_dpo)
    *(
        h
        for cls in ("DPOTrainer", "KTOTrainer")
        for h in (
            Hook(f"trl:{cls}", "_precompute_ref_logps", "method", ("dataset", "name", "batch_size"), _DPO),
            Hook(f"trl:{cls}", "_set_signature_columns_if_needed", "method", (), "calls it for TRL's columns"),
            Hook(f"trl:{cls}", "_signature_columns", "attribute", (), "reads TRL's columns in trl_dpo"),
            Hook(f"trl:{cls}", "aux_loss_enabled", "attribute", (), "refuses the MoE aux loss under SP in trl_dpo"),
            Hook(f"trl:{cls}", "ref_model", "attribute", (), "installs the SP fused head on it in trl_dpo"),
            Hook(
                f"trl:{cls}",
                "compute_loss",
                "method",
                COMPUTE_LOSS,
                "overrides it in trl_dpo (metrics gathered over DP)",
            ),
            Hook(
                f"trl:{cls}",
                "prediction_step",
                "method",
                PREDICTION_STEP,
                "overrides it through FPDTHooks (TRL's step, whole batches: no rescaling)",
            ),
        )
    ),
    *(
        Hook(f"trl:{cfg}", "fields", "fields", ("precompute_ref_log_probs", "model_init_kwargs", "use_liger_kernel"))
        for cfg in ("DPOConfig", "KTOConfig")
    ),
    # ---- GRPO / RLOO (hf_fpdt.trainers.trl_grpo)
    *(
        h
        for cls in ("GRPOTrainer", "RLOOTrainer")
        for h in (
            Hook(
                f"trl:{cls}",
                "_calculate_rewards",
                "method",
                ("inputs", "prompts", "completions", "completion_ids_list"),
                f"overrides it in {_ROLL} (one copy of the rewards per SP group)",
            ),
            Hook(f"trl:{cls}", "_generate", "method", ("prompts",), f"overrides it in {_ROLL} (SP ranks agree)"),
            Hook(f"trl:{cls}", "_generate", "returns", GENERATED[cls], f"unpacks its result by position in {_ROLL}"),
            Hook(
                f"trl:{cls}",
                "_generate_and_score_completions",
                "method",
                ("inputs",),
                f"overrides it in {_ROLL} (collectives over DP, one copy of the completion logs)",
            ),
            Hook(f"trl:{cls}", "_logs", "keys", LOG_KEYS, f"swaps the completion logs around the rollout in {_ROLL}"),
            Hook(f"trl:{cls}", "_is_vlm", "attribute", (), f"refuses vision-language inputs under SP in {_ROLL}"),
            Hook(f"trl:{cls}", "_get_train_sampler", "method", ("dataset",), f"calls it in {_ROLL}'s train loader"),
            Hook(f"trl:{cls}", "_get_eval_sampler", "method", ("eval_dataset",), f"calls it in {_ROLL}'s eval loader"),
            *(
                Hook(f"trl:{cls}", attr, "attribute", (), f"reads it in {_ROLL}")
                for attr in ("temperature", "num_generations", "num_iterations", "shuffle_dataset", "ref_model")
            ),
            Hook(
                f"trl:{cls}",
                "compute_loss",
                "method",
                COMPUTE_LOSS,
                f"overrides it in {_ROLL} (statistics over DP)",
            ),
            Hook(
                f"trl:{cls}",
                "prediction_step",
                "method",
                PREDICTION_STEP,
                f"overrides it in {_ROLL} (TRL's step over the DP view)",
            ),
        )
    ),
    *(
        Hook(
            f"trl:{cfg}",
            "fields",
            "fields",
            (
                "use_vllm",
                "use_transformers_continuous_batching",
                "generation_batch_size",
                "steps_per_generation",
                "num_generations",
                "num_generations_eval",
                "beta",
            ),
            f"reads them in {_ROLL}",
        )
        for cfg in ("GRPOConfig", "RLOOConfig")
    ),
    Hook("trl:GRPOConfig", "fields", "fields", ("cast_lm_head_to_fp32",), f"reads it in {_ROLL}"),
    Hook("trl:SFTTrainer", "_total_train_tokens", "attribute", (), "recounts num_tokens under SP in trl_sft"),
    Hook("trl:SFTTrainer", "_metrics", "attribute", (), "sets the logged num_tokens under SP in trl_sft"),
    # ---- trl.trainer.utils (internal module)
    Hook(
        "trl.trainer.utils",
        "add_fused_lm_head",
        "method",
        ("model", "temperature", "cast_lm_head_to_fp32"),
        f"adds the head again on the reference in {_ROLL}",
    ),
    Hook("trl.trainer.utils", "create_model_from_path", "method", ("model_id",), "loads the reference in trl_dpo"),
    Hook("trl.trainer.utils", "get_config_model_id", "method", ("config",), "finds the reference's path in trl_dpo"),
    Hook(
        "trl.trainer.utils",
        "repeat_iterable_dataset",
        "method",
        ("dataset", "mini_repeat_count", "batch_size", "repeat_count"),
        f"repeats iterable prompts in {_ROLL}",
    ),
    Hook(
        "trl.trainer.utils:FusedCausalLMOutput",
        "fields",
        "fields",
        FUSED_FIELDS,
        "builds it in hf_fpdt.trainers.trl_fused_head (the tiled head's answer)",
    ),
)


def check_contract(hooks: tuple[Hook, ...] = HOOKS) -> None:
    """Raise an ``ImportError`` naming the installed TRL's version and every hook of ``hooks`` it does not have as
    hf_fpdt relies on it (:func:`hf_fpdt.trainers.compat.problems`); nothing where all match. Run at import."""
    found = compat.problems(hooks)
    if found:
        lowest = re.search(r">=\s*([0-9][\w.]*)", trl_requirement())
        install = f"pip install 'trl=={lowest.group(1)}.*'" if lowest else "pip install 'hf_fpdt[trl]'"
        raise ImportError(
            f"hf_fpdt's TRL trainers cannot run on the installed trl {compat.version('trl')}: "
            f"{len(found)} of the TRL hooks they override or read changed:\n  "
            + "\n  ".join(found)
            + f"\nInstall a TRL release whose hooks hf_fpdt knows (the trl extra's lowest: {install}), or an "
            "hf_fpdt release that supports this one"
        )


def fresh_completion_logs() -> dict:
    """GRPO/RLOO's completion logs (``self._logs``'s schema, :data:`LOG_KEYS`), unbounded: they collect one
    generation batch, gathered over the world."""
    return {
        "images": deque(),
        "prompt": deque(),
        "completion": deque(),
        "rewards": defaultdict(deque),
        "advantages": deque(),
        "extra": defaultdict(deque),
    }


def train_tokens(trainer: Any) -> int:
    """SFT's running count of the tokens trained on (``_total_train_tokens``), which it logs as ``num_tokens``."""
    return trainer._total_train_tokens


def set_train_tokens(trainer: Any, count: int) -> None:
    """Replace SFT's running token count and the ``num_tokens`` value its next log shows (``_metrics``)."""
    trainer._total_train_tokens = count
    trainer._metrics["train"]["num_tokens"] = [count]


def completion_logs(trainer: Any) -> dict:
    """The rollout trainer's completion logs (TRL's ``_logs``)."""
    return trainer._logs


def set_completion_logs(trainer: Any, logs: dict) -> None:
    trainer._logs = logs


def generated(trainer: Any, out: tuple) -> dict:
    """The leading fields of ``_generate``'s tuple by name (:data:`GENERATED`; the class TRL's method is from)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in GENERATED and cls.__module__.startswith("trl."):
            return dict(zip(GENERATED[cls.__name__], out))
    raise TypeError(f"{type(trainer).__name__} is not a TRL rollout trainer ({', '.join(GENERATED)})")


def train_sampler(trainer: Any, dataset: Any) -> Any:
    """The rollout trainer's training sampler (TRL's ``RepeatSampler`` over the DP world)."""
    return trainer._get_train_sampler(dataset)


def eval_sampler(trainer: Any, dataset: Any) -> Any:
    """The rollout trainer's evaluation sampler."""
    return trainer._get_eval_sampler(dataset)


def is_vlm(trainer: Any) -> bool:
    """Whether TRL's rollout trainer took a vision-language processor (``_is_vlm``)."""
    return bool(getattr(trainer, "_is_vlm", False))


def aux_loss_enabled(trainer: Any) -> bool:
    """Whether TRL's trainer adds the MoE router auxiliary loss (``aux_loss_enabled``)."""
    return bool(getattr(trainer, "aux_loss_enabled", False))


check_contract()  # at import: a TRL whose hooks changed stops here, naming them (the module docstring)
