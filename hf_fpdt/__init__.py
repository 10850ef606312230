"""hf_fpdt: the Fully Pipelined Distributed Transformer for Hugging Face models.

``import hf_fpdt`` registers ``attn_implementation="fpdt"`` with transformers.

The package reads as the data path, from the ground up; each folder imports only the ones above it here:

* ``config.py``      settings (``FPDTConfig``, ``FPDT_*`` variables) and the constants defined once
* ``models/``        the ``model_type`` registry, the generic chunked parts, presets (+ loading a model config)
* ``data/``          the chunk plan and the one integer chunk size, layout (shard/unshard), SP collator, demo data
* ``memory/``        host store + device budget, memory probes, replay, checkpointing, tiling, the planner
* ``distributed/``   the SP and DP groups, timeouts, all-to-all, rank agreement and digests, peer failures, SP loss
* ``attention/``     kernels, precision, block masks and sparse patterns, the runtime and CPU threads, chunked
                     attention (forward and nested backward), projection, cached attention (generate), autotune
* ``integrations/``  the model surgery: transformers registration, ``apply``, forward patches, layer wrappers,
                     the step plan, SP generation, ZeRO-3's gradient delivery
* ``trainers/``      the trainer adapters: the Accelerate plugin, HF Trainer, TRL trainers and their fused head
* ``bench/``         ``python -m hf_fpdt.bench ...`` (nothing else imports it)
"""

from .attention import sparse_patterns as patterns  # block-sparse attention_pattern constructors: patterns.chunked(...)
from .attention.block_mask import MaskSpec
from .attention.chunked import FPDTAttentionFunction, fpdt_attention
from .attention.runtime import FPDTRuntime
from .config import FPDTConfig
from .data.collate import SPCollator
from .data.layout import shard_batch
from .distributed.agreement import SPAgreementError
from .distributed.groups import build_groups
from .distributed.peers import SPPeerFailure
from .integrations.apply import apply, configure, unapply
from .integrations.registration import register as _register
from .integrations.state import FPDTState
from .memory.planner import Plan, plan

__all__ = [
    "FPDTAttentionFunction",
    "FPDTConfig",
    "FPDTDPOTrainer",
    "FPDTGRPOTrainer",
    "FPDTKTOTrainer",
    "FPDTPlugin",
    "FPDTRLOOTrainer",
    "FPDTRuntime",
    "FPDTSFTTrainer",
    "FPDTState",
    "FPDTTrainer",
    "MaskSpec",
    "Plan",
    "SPAgreementError",
    "SPCollator",
    "SPPeerFailure",
    "apply",
    "build_groups",
    "configure",
    "fpdt_attention",
    "patterns",
    "plan",
    "shard_batch",
    "unapply",
]
__version__ = "0.3.0"

_register()

_TRL = ("FPDTSFTTrainer", "FPDTDPOTrainer", "FPDTKTOTrainer", "FPDTGRPOTrainer", "FPDTRLOOTrainer")
_LAZY = {  # imported on first use: they pull in accelerate, transformers.Trainer, TRL
    "FPDTPlugin": ".trainers.accelerate_plugin",
    "FPDTTrainer": ".trainers.trainer",
    "FPDTSFTTrainer": ".trainers.trl_sft",  # needs the optional extra hf_fpdt[trl]
    "FPDTDPOTrainer": ".trainers.trl_dpo",  # hf_fpdt[trl] too
    "FPDTKTOTrainer": ".trainers.trl_dpo",
    "FPDTGRPOTrainer": ".trainers.trl_grpo",
    "FPDTRLOOTrainer": ".trainers.trl_grpo",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        if name in _TRL:  # an older TRL: a clear ImportError, not one from inside the trainers' module
            importlib.import_module(".trainers.compat_versions", __name__).check_trl(name)
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
