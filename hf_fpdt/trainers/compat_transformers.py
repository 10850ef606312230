"""HF ``Trainer``'s surface beyond its documented hooks, the one place hf_fpdt's trainers touch it.

``FPDTHooks`` (``hf_fpdt.trainers.adapter``) overrides Trainer's hooks (``create_accelerator_and_postprocess``,
``prediction_step``, ``evaluation_loop``, ...), handing each to the trainer's ``FPDTAdapter``, which sets or reads a
few of Trainer's attributes (``gather_function``, which ``evaluation_loop`` gathers with;
``model_accepts_loss_kwargs``); the trainers keep the library's own loaders, whose ``accelerator.prepare`` the
trainer's FPDT accelerator answers (``hf_fpdt.trainers.dp_seam``), so none of Trainer's private attributes is read.
:data:`HOOKS` names each with the parameters hf_fpdt relies on; ``tests/unit/test_compat_contract.py`` checks them
against the installed transformers. The model surgery's uses of transformers' model internals (``integrations/``) are
feature-detected where they are and are not listed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .compat import Hook

_MIXIN = "hf_fpdt.trainers.adapter (FPDTHooks, FPDTAdapter)"

# Trainer's methods FPDTHooks (and the TRL trainers) override, with the leading parameters they pass on
COMPUTE_LOSS = ("model", "inputs", "return_outputs", "num_items_in_batch")
PREDICTION_STEP = ("model", "inputs", "prediction_loss_only", "ignore_keys")
OVERRIDDEN = {
    "__init__": ("model", "args"),
    "train": (),
    "compute_loss": COMPUTE_LOSS,
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "evaluation_loop": ("dataloader", "description"),
    "prediction_step": PREDICTION_STEP,
    "get_total_train_batch_size": ("args",),
    "floating_point_ops": ("inputs",),  # total_flos: this rank's share of the samples' tokens
    "_track_num_input_tokens": ("inputs",),  # private: num_input_tokens_seen from this rank's share
    "log": ("logs",),  # an evaluation's steps_per_second over one process's steps
    "create_accelerator_and_postprocess": (),  # whole-batch trainers under SP: the DP seam's accelerator from here
}

HOOKS: tuple[Hook, ...] = (
    *(
        Hook("transformers:Trainer", name, "method", params, f"overrides it in {_MIXIN} or the TRL trainers")
        for name, params in OVERRIDDEN.items()
    ),
    Hook("transformers:Trainer", "gather_function", "attribute", (), f"sets it per evaluation in {_MIXIN}"),
    Hook("transformers:Trainer", "model_accepts_loss_kwargs", "attribute", (), f"requires it in {_MIXIN}"),
    Hook(
        "transformers:TrainingArguments",
        "fields",
        "fields",
        (
            "average_tokens_across_devices",
            "label_smoothing_factor",
            "train_sampling_strategy",
            "eval_use_gather_object",
        ),
        "reads them in hf_fpdt.trainers.adapter, hf_fpdt.trainers.evaluation and hf_fpdt.trainers.arguments "
        "(check_args)",
    ),
    Hook(
        "transformers:PreTrainedConfig",
        "_attn_implementation",
        "attribute",
        (),
        "reads it to load DPO's reference with the policy's attention (hf_fpdt.trainers.trl_dpo)",
    ),
)


def set_gather_function(trainer: Any, gather: Callable) -> None:
    """What ``Trainer.evaluation_loop`` gathers each step's results with (it resets it at the end of its loop)."""
    trainer.gather_function = gather


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model config was built with."""
    return config._attn_implementation
