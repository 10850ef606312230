"""hf_fpdt: the Fully Pipelined Distributed Transformer for Hugging Face models.

``import hf_fpdt`` registers ``attn_implementation="fpdt"`` with transformers.
"""

from .attention import FPDTAttentionFunction, fpdt_attention
from .config import FPDTConfig
from .integrations.apply import apply
from .integrations.transformers import register as _register
from .runtime import FPDTRuntime

__all__ = ["FPDTAttentionFunction", "FPDTConfig", "FPDTRuntime", "apply", "fpdt_attention"]
__version__ = "0.1.0"

_register()
