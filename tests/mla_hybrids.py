"""Tiny multi-head latent attention and hybrid models (fp32, two layers) for ``test_mla``, ``test_hybrids`` and their
sequence-parallel tests: each case switches its family's special pieces on (q LoRA, interleaved or complex RoPE, v
head dim != q/k's, a dense first layer and a MoE with a shared expert; linear-attention / Mamba mixers, muP
multipliers)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from testkit import tiny_model
from transformers import AutoConfig

MLA = {
    "vocab_size": 112,
    "hidden_size": 32,
    "intermediate_size": 40,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MLA_CASES = {  # name: (model_type, overrides beyond MLA)
    "deepseek_v2": ("deepseek_v2", {}),  # complex rotary table (freqs_cis)
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-interleave-no-q-lora": ("deepseek_v3", {"rope_interleave": True, "q_lora_rank": None}),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
}


def _installed(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:  # Kimi Linear: newer than transformers 5.10
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")


def mla_model(model_type: str, attn: str = "eager", state: dict | None = None, **overrides) -> torch.nn.Module:
    _installed(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(model_type, attn, state=state, **{**MLA, **overrides}).train()


BASE = {
    "vocab_size": 112,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN3_NEXT = {
    **BASE,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 24,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],  # layer 0 dense, layer 1 MoE
    "output_router_logits": True,
    "router_aux_loss_coef": 0.5,  # HF's auxiliary loss in the compared loss and gradients
}
FALCON_H1 = {
    **BASE,
    "num_hidden_layers": 2,
    "mamba_d_ssm": 32,  # = mamba_n_heads * mamba_d_head (the config's validation)
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "key_multiplier": 0.7,
    "lm_head_multiplier": 0.8,
    "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.9,
}
KIMI_LINEAR = {  # NoPE MLA in its full-attention layer, Kimi delta attention in the other, DeepSeek-style MoE
    **{k: v for k, v in MLA.items() if k not in ("n_routed_experts", "first_k_dense_replace")},
    "q_lora_rank": None,
    "num_local_experts": 4,
    "layer_types": ["linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse"],
    "linear_head_dim": 8,
    "linear_num_heads": 4,
}
HYBRIDS = {"qwen3_next": QWEN3_NEXT, "falcon_h1": FALCON_H1, "kimi_linear": KIMI_LINEAR}
WHOLE = {
    "qwen3_next": ("layer 0: linear_attn (Qwen3NextGatedDeltaNet)",),
    "falcon_h1": ("layer 0: mamba (FalconH1Mixer)", "layer 1: mamba (FalconH1Mixer)"),
    "kimi_linear": ("layer 0: self_attn (KimiLinearDeltaAttention)",),
}


def hybrid_model(model_type: str) -> torch.nn.Module:
    _installed(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(model_type, "eager", **HYBRIDS[model_type]).train()


def mla_hybrid_config(model_type: str, **overrides):
    """The tiny config of an MLA or hybrid ``model_type`` (:data:`MLA` or :data:`HYBRIDS`), ``overrides`` set."""
    base = HYBRIDS.get(model_type, MLA)
    return AutoConfig.for_model(model_type, **{**base, **overrides})
