"""Llama: the chunk projection of ``LlamaAttention`` and the module classes ``apply`` patches.

``q_proj``, ``k_proj``, ``v_proj`` are separate linears (any of them may be a PEFT ``lora.Linear``;
calling the submodule runs the adapter); RoPE is HF's ``apply_rotary_pos_emb`` on the sequence-major
chunk layout (``unsqueeze_dim=2``)::

    h        [B, l, E]
    q        [B, l, H, D]     k, v  [B, l, Hkv, D]
    cos/sin  [B | 1, l, D]
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .patch_common import AttentionSpec

ATTENTION = "LlamaAttention"
MLP = "LlamaMLP"
CAUSAL_LM = "LlamaForCausalLM"


def project(
    module: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hidden chunk -> rotated q and k, and v (sequence-major heads)."""
    shape = (*h.shape[:-1], -1, module.head_dim)
    q = module.q_proj(h).view(shape)
    k = module.k_proj(h).view(shape)
    v = module.v_proj(h).view(shape)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    return q, k, v


SPEC = AttentionSpec(
    project=project,
    proj_modules=lambda m: (m.q_proj, m.k_proj, m.v_proj),
    out_proj="o_proj",
    heads=lambda m: (m.config.num_attention_heads, m.config.num_key_value_heads),
)
