"""GPT-NeoX: the chunk projection of ``GPTNeoXAttention`` and the module classes ``apply`` patches.

NeoX fuses q/k/v into one ``query_key_value`` linear whose output is interleaved *per head*
(``[q_h, k_h, v_h]`` for each head h), and rotates only the first ``rotary_ndims`` of each head
(partial rotary); HF's ``apply_rotary_pos_emb`` for NeoX takes the rotary width from ``cos``::

    h        [B, l, E]
    qkv      [B, l, H, 3 D]    -> q, k, v  [B, l, H, D]
    cos/sin  [B | 1, l, R]     R = rotary_ndims <= D
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

from .patch_common import AttentionSpec

ATTENTION = "GPTNeoXAttention"
MLP = "GPTNeoXMLP"
CAUSAL_LM = "GPTNeoXForCausalLM"


def project(
    module: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hidden chunk -> rotated q and k, and v (sequence-major heads)."""
    qkv = module.query_key_value(h).view(*h.shape[:-1], -1, 3 * module.head_size)
    q, k, v = qkv.chunk(3, dim=-1)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    return q, k, v


SPEC = AttentionSpec(
    project=project,
    proj_modules=lambda m: (m.query_key_value,),
    out_proj="dense",
    heads=lambda m: (m.config.num_attention_heads, m.config.num_attention_heads),
)
