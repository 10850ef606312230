"""``hf_fpdt.apply(model, config, group)``: turn an HF causal LM into an FPDT model.

This installs one :class:`~hf_fpdt.runtime.FPDTRuntime` (config, sequence-parallel group, host stores)
on every attention module, switches the model to ``attn_implementation="fpdt"``, and with a
sequence-parallel group of more than one rank checks every forward call for explicit
``position_ids`` (HF would otherwise number each rank's slice from 0).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..config import FPDTConfig
from ..runtime import FPDTRuntime
from .transformers import NAME


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of an HF model (those that dispatch through the attention interface)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]


def _require_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("position_ids") is None:
        raise ValueError(
            "with sequence parallelism every forward call needs position_ids (the global positions of this "
            "rank's tokens, from hf_fpdt.layout); HF would otherwise number each rank's slice from 0"
        )


def apply(model: nn.Module, config: FPDTConfig | None = None, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Make ``model`` compute with FPDT; returns the same model object.

    Args:
        model: an HF causal LM (Llama, GPT-NeoX, or any model using HF's attention interface).
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
    model.fpdt_runtime = runtime
    return model
