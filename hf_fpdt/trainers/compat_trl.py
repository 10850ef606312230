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

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from trl.trainer.utils import (  # TRL's internal helpers (checked in HOOKS)
    FusedCausalLMOutput,
    add_fused_lm_head,
    create_model_from_path,
    get_config_model_id,
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
    "MODULE_COLLECTIVES",
    "aux_loss_enabled",
    "create_model_from_path",
    "generated",
    "get_config_model_id",
    "is_vlm",
    "module_collectives",
]

# Accelerate's module-level collectives TRL's rollout trainers call by name (imported into their modules: the
# rewards, the completion logs, RLOO's KL), which run over the world unless redirected (module_collectives)
MODULE_COLLECTIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "GRPOTrainer": ("trl.trainer.grpo_trainer", ("gather", "gather_object")),
    "RLOOTrainer": ("trl.trainer.rloo_trainer", ("gather", "gather_object")),
}
_COLLECTIVE_PARAMS = {"gather": ("tensor",), "gather_object": ("object",)}
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
            Hook(f"trl:{cls}", "_is_vlm", "attribute", (), f"refuses vision-language inputs under SP in {_ROLL}"),
            *(
                Hook(f"trl:{cls}", attr, "attribute", (), f"reads it in {_ROLL}")
                for attr in ("temperature", "ref_model")
            ),
        )
    ),
    *(
        Hook(module, name, "method", _COLLECTIVE_PARAMS[name], f"redirects it to the DP group in {_ROLL}'s loop")
        for module, names in MODULE_COLLECTIVES.values()
        for name in names
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


def train_tokens(trainer: Any) -> int:
    """SFT's running count of the tokens trained on (``_total_train_tokens``), which it logs as ``num_tokens``."""
    return trainer._total_train_tokens


def set_train_tokens(trainer: Any, count: int) -> None:
    """Replace SFT's running token count and the ``num_tokens`` value its next log shows (``_metrics``)."""
    trainer._total_train_tokens = count
    trainer._metrics["train"]["num_tokens"] = [count]


def generated(trainer: Any, out: tuple) -> dict:
    """The leading fields of ``_generate``'s tuple by name (:data:`GENERATED`; the class TRL's method is from)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in GENERATED and cls.__module__.startswith("trl."):
            return dict(zip(GENERATED[cls.__name__], out))
    raise TypeError(f"{type(trainer).__name__} is not a TRL rollout trainer ({', '.join(GENERATED)})")


def is_vlm(trainer: Any) -> bool:
    """Whether TRL's rollout trainer took a vision-language processor (``_is_vlm``)."""
    return bool(getattr(trainer, "_is_vlm", False))


def aux_loss_enabled(trainer: Any) -> bool:
    """Whether TRL's trainer adds the MoE router auxiliary loss (``aux_loss_enabled``)."""
    return bool(getattr(trainer, "aux_loss_enabled", False))


@contextlib.contextmanager
def module_collectives(trainer: Any, replacements: Mapping[str, Callable]) -> Iterator[None]:
    """Inside: the Accelerate collectives TRL's trainer module calls by name (:data:`MODULE_COLLECTIVES`, for the TRL
    class ``trainer`` derives from) are ``replacements[name]`` (the DP group's, :mod:`hf_fpdt.trainers.dp_seam`).

    The one place hf_fpdt redirects a module-level function, for the time the trainer runs its loop (training,
    evaluation); the names are put back on exit (nested entries restore in order). Trainers of no listed class: as
    they are."""
    listed = (c for c in type(trainer).__mro__ if c.__name__ in MODULE_COLLECTIVES and c.__module__.startswith("trl."))
    cls = next(listed, None)
    if cls is None:
        yield
        return
    module_name, names = MODULE_COLLECTIVES[cls.__name__]
    module = importlib.import_module(module_name)
    saved = {name: getattr(module, name) for name in names}
    for name in names:
        setattr(module, name, replacements[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


check_contract()  # at import: a TRL whose hooks changed stops here, naming them (the module docstring)
