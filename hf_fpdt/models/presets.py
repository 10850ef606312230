"""Model presets built from a config (nothing is downloaded): tests, examples and benchmarks share them."""

from __future__ import annotations

import json
import os

from transformers import AutoConfig, GPTNeoXConfig, LlamaConfig, PretrainedConfig

PRESETS = {
    # GQA (4 query heads over 2 KV heads), odd sizes kept small so CPU tests run in seconds.
    "tiny-llama": lambda: LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
    ),
    # Fused, per-head interleaved query_key_value with partial rotary (25%), GELU MLP, biases.
    "tiny-neox": lambda: GPTNeoXConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.25,
        max_position_embeddings=65536,
    ),
    # The issues' "small Llama" for CPU memory and speed figures.
    "small-llama": lambda: LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1 << 20,
    ),
    # About 1.1B parameters, Llama-shaped (TinyLlama's shape), for GPU figures.
    "llama-1b": lambda: LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=1 << 21,
    ),
    # The layer shape of Llama-3.1-8B (GQA 32/8, 128K vocab), for plans and GPU figures; random weights.
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=1 << 20,
        rope_theta=500000.0,
    ),
    # The layer shapes of Qwen2.5-7B (GQA 28/4, head dim 128) and Phi-4 (GQA 40/10), whose heads SP 8 splits
    # unevenly (hf_fpdt.data.head_split), for plans; random weights.
    "qwen2.5-7b": lambda: AutoConfig.for_model(
        "qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=1 << 17,
        rope_theta=1000000.0,
    ),
    "phi-4": lambda: AutoConfig.for_model(
        "phi3",
        vocab_size=100352,
        hidden_size=5120,
        intermediate_size=17920,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=10,
        max_position_embeddings=1 << 14,
        rope_theta=250000.0,
        pad_token_id=100349,
    ),
}


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """A fresh config of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)} or pass an HF path")
    cfg = PRESETS[name]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def load_model_config(model: str):
    """An HF config from a preset name (:mod:`hf_fpdt.models.presets`), a ``config.json`` path, or a model folder."""
    if model in PRESETS:
        return preset_config(model)
    if os.path.isfile(model):
        with open(model) as fh:
            data = json.load(fh)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{model}: config JSON has no 'model_type'; add one (e.g. \"llama\")")
        return AutoConfig.for_model(model_type, **data)
    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model)
    raise ValueError(f"unknown model {model!r}: use a preset ({', '.join(sorted(PRESETS))}) or an HF config path")
