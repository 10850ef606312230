"""hf_fpdt: the Fully Pipelined Distributed Transformer for Hugging Face models.

``import hf_fpdt`` registers ``attn_implementation="fpdt"`` with transformers.
"""

from .attention import FPDTAttentionFunction, fpdt_attention
from .config import FPDTConfig
from .integrations.apply import apply
from .integrations.transformers import register as _register
from .planner import Plan, plan
from .runtime import FPDTRuntime

__all__ = [
    "FPDTAttentionFunction",
    "FPDTConfig",
    "FPDTPlugin",
    "FPDTRuntime",
    "FPDTSFTTrainer",
    "FPDTTrainer",
    "Plan",
    "apply",
    "fpdt_attention",
    "plan",
]
__version__ = "0.1.0"

_register()

_LAZY = {  # imported on first use: they pull in accelerate, transformers.Trainer, TRL
    "FPDTPlugin": ".integrations.accelerate_plugin",
    "FPDTTrainer": ".integrations.trainer",
    "FPDTSFTTrainer": ".integrations.trl_sft",  # needs the optional extra hf_fpdt[trl]
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
