"""``hf_fpdt.apply(model, config, group)``: turn an HF causal LM into an FPDT model.

What it installs (on module *instances*; see :mod:`.patch_common` for how each forward is replaced):

* every model: one :class:`~hf_fpdt.runtime.FPDTRuntime` (config, sequence-parallel group, host stores)
  on every attention module and ``attn_implementation="fpdt"``; with a sequence-parallel group of more
  than one rank, a check that every forward call passes explicit ``position_ids``; and (unless
  ``config.offload_layer_inputs`` is off) host offload of the layer inputs that activation
  checkpointing saves (:mod:`hf_fpdt.checkpoint_offload`).
* Llama and GPT-NeoX, additionally: the attention's q/k/v projection and RoPE run chunk by chunk inside
  the pipeline (``"projection"``), the MLP is tiled over the sequence (``"mlp"``), and with labels the
  LM head + cross-entropy are tiled (``"loss"``: ``model(...).loss`` keeps HF's meaning, ``logits`` is
  ``None``).

Any other model gets a warning naming the parts that apply; ``model.fpdt_parts`` lists them.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn

from ..checkpoint_offload import LayerInputOffloader, offload_layer_inputs
from ..config import FPDTConfig
from ..runtime import FPDTRuntime
from . import patch_llama, patch_neox
from .patch_common import patch_attention, patch_causal_lm, patch_mlp
from .transformers import NAME

FAMILIES = (patch_llama, patch_neox)
ALL_PARTS = ("attention", "projection", "mlp", "loss", "layer_input_offload")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of an HF model (those that dispatch through the attention interface)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]


def _is(module: nn.Module, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(module).__mro__)


def _require_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("position_ids") is None:
        raise ValueError(
            "with sequence parallelism every forward call needs position_ids (the global positions of this "
            "rank's tokens, from hf_fpdt.layout); HF would otherwise number each rank's slice from 0"
        )


def _patch_family_modules(model: nn.Module, runtime: FPDTRuntime) -> set[str]:
    parts: set[str] = set()
    for module in list(model.modules()):
        for family in FAMILIES:
            if _is(module, family.ATTENTION):
                patch_attention(module, family.SPEC, runtime)
                parts.add("projection")
            elif _is(module, family.MLP):
                patch_mlp(module, runtime)
                parts.add("mlp")
            elif _is(module, family.CAUSAL_LM):
                patch_causal_lm(module, runtime)
                module.fpdt_runtime = runtime
                parts.add("loss")
    return parts


def _offload_checkpointed_inputs(model: nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    offloader = getattr(model, "fpdt_layer_offloader", None) or LayerInputOffloader()  # one pool for all layers
    for layer in layers:
        offload_layer_inputs(layer, offloader)
    model.fpdt_layer_offloader = offloader
    return bool(layers)


def apply(model: nn.Module, config: FPDTConfig | None = None, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Make ``model`` compute with FPDT; returns the same model object (see the module docstring).

    Works before or after PEFT's ``get_peft_model`` (the patches call the submodules they find at call
    time, and look up trainable parameters per call).

    Args:
        model: an HF causal LM (Llama, GPT-NeoX, or any model using HF's attention interface), possibly
            wrapped (PEFT).
        config: FPDT settings (default: :class:`FPDTConfig` from defaults and ``FPDT_*`` env).
        group: the sequence-parallel process group, passed explicitly (``None`` = one process).
    """
    config = config or FPDTConfig()
    runtime = FPDTRuntime(config, group)
    attn = attention_modules(model)
    if not attn:
        raise ValueError(f"{type(model).__name__} has no attention module hf_fpdt can drive")
    for module in attn:
        module.fpdt_runtime = runtime
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    if runtime.sp_size > 1 and not getattr(model, "_fpdt_position_check", False):
        model.register_forward_pre_hook(_require_position_ids, with_kwargs=True)
        model._fpdt_position_check = True
    parts = {"attention"} | _patch_family_modules(model, runtime)
    if config.offload_layer_inputs and _offload_checkpointed_inputs(model):
        parts.add("layer_input_offload")
    wanted = [p for p in ALL_PARTS if p != "layer_input_offload" or config.offload_layer_inputs]
    missing = [p for p in wanted if p not in parts]
    if missing:
        warnings.warn(
            f"hf_fpdt.apply: {type(model).__name__} is only partly supported (full support: Llama, GPT-NeoX). "
            f"Applied: {', '.join(p for p in ALL_PARTS if p in parts)}. Not applied: {', '.join(missing)} "
            "(those run over the full sequence as in HF, so their memory grows with the sequence length)",
            stacklevel=2,
        )
    model.fpdt_runtime = runtime
    model.fpdt_parts = tuple(p for p in ALL_PARTS if p in parts)
    return model
