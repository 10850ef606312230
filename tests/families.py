"""Every registered family's tiny config (fp32, two layers, GQA, head_dim 8, the family's special pieces switched
on) and the checks that a step is chunked for real: a ``TorchDispatchMode`` that sees every aten op
(:class:`Recorder`) and :func:`violations` (a tensor with the sequence and a wide dimension together, an
``[S, S]`` tensor, an attention kernel call over more than one chunk of queries). Shared by the family, window,
packed-document and DeepSpeed tests."""

from __future__ import annotations

import pytest
import torch
import transformers
from mla_hybrids import HYBRIDS, mla_hybrid_config
from testkit import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig
from vl_text import rope_outside_attention, vl_config

import hf_fpdt

RTOL = 1e-5
BATCH, SEQ, CHUNK = 2, 45, 16  # 3 chunks, the last one short
HIDDEN, INTER, VOCAB = 32, 40, 112  # none of them equals SEQ or BATCH * SEQ
# loss tiles of 15 tokens (the default rule keeps tiles >= 64 tokens: a whole row here)
CONFIG = hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6)
ATTN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# gpt-oss's rotary scaling (its default, with an original context of 32 tokens so that it matters here)
YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 150000.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}

# model_type -> what the family's config turns on beyond COMMON
FAMILIES = {
    "llama": {},
    "mistral": {},  # default sliding_window 4096 > SEQ: plain causal attention
    "qwen2": {},
    "qwen3": {},  # per-head q/k norms
    "gemma": {},  # (1 + w) norms, sqrt(hidden) embedding scale
    "phi3": {"partial_rotary_factor": 0.5},  # fused qkv_proj and gate_up_proj
    "olmo2": {},  # q/k norms over the whole projection
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 3.0},
    "smollm3": {"no_rope_layers": [1, 0]},  # layer 1 without RoPE
    "starcoder2": {},  # biases, plain GELU MLP, LayerNorm
    "gpt_neox": {"rotary_pct": 0.25},
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5},  # per-head LayerNorm q/k, logits scaled
    # MoE: router over the whole sequence, experts tiled; HF's auxiliary loss (weighted 0.5 so that it
    # shows in every gradient of the routers) from the untouched router logits
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": INTER},
    # attention sinks (drawn N(0, 1) by family_model, so they shape every row), sliding (window 20 > CHUNK) and
    # full layers alternating, YaRN rotary tables, biased q/k/v and router, clamped SwiGLU experts
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 20, "rope_parameters": YARN},
}
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
MOE_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")
# registered model types whose tiny configs live in their own helpers (their tests: test_mla, test_hybrids, test_mrope)
EXTRA = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite", *HYBRIDS), mla_hybrid_config),
    **dict.fromkeys(("qwen2_5_vl_text", "qwen3_vl_text"), vl_config),
}


def family_config(model_type: str, **overrides):
    """The tiny config of a registered ``model_type``: :data:`FAMILIES`' (with :data:`MOE` for the MoE ones), or
    those of ``mla_hybrids`` (multi-head latent attention, hybrids) and ``vl_text`` (vision-language models)."""
    if model_type in EXTRA:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:  # a registered type newer than the installed transformers
            pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
        if EXTRA[model_type] is vl_config and not rope_outside_attention(model_type):
            pytest.skip(f"transformers {transformers.__version__} rotates {model_type} inside its attention")
        return EXTRA[model_type](model_type, **overrides)
    moe = MOE if model_type in MOE_TYPES else {}
    cfg = {**COMMON, **FAMILIES.get(model_type, {}), **moe, **overrides}
    if model_type == "gpt_neox":
        for key in ("num_key_value_heads", "head_dim"):
            cfg.pop(key)
    if model_type == "granite":
        cfg["attention_multiplier"] = 0.2
    return AutoConfig.for_model(model_type, **cfg)


def family_model(cfg) -> torch.nn.Module:
    model = tiny_model(cfg, "eager").train()
    with torch.no_grad():  # attention sinks (HF initialises them near 0, where they barely change a row): N(0, 1)
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def family_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt without targets
    return {"input_ids": ids, "labels": labels}


def train_step(model, batch) -> tuple[torch.Tensor, dict]:
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _rel(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))


def assert_same(ref, got) -> None:
    assert _rel(got[0], ref[0]) < RTOL, (got[0], ref[0])
    assert ref[1].keys() == got[1].keys() and ref[1]
    for name, g in ref[1].items():
        assert got[1][name] is not None, name
        assert _rel(got[1][name], g) < RTOL, f"{name}: {_rel(got[1][name], g)}"


class Recorder(TorchDispatchMode):
    """Every op output's shape, and the query lengths of the attention kernel calls."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple] = []
        self.queries: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in (ATTN_FWD, ATTN_BWD):
            self.queries.append(args[0].shape[2] if func == ATTN_FWD else args[1].shape[2])
        return out


def violations(rec: Recorder, inter: int, seq: int = SEQ, batch: int = BATCH, chunk: int = CHUNK) -> list[str]:
    """Tensors with the full sequence and a wide dimension; attention calls over more than one chunk."""
    wide, full = {inter, 2 * inter, VOCAB}, {seq, batch * seq}
    bad = [f"{s}: full sequence x wide" for s in rec.shapes if set(s) & wide and set(s) & full]
    bad += [f"{s}: [S, S]" for s in rec.shapes if sum(d >= seq for d in s) > 1]
    bad += [f"attention over {q} queries" for q in rec.queries if q > chunk]
    return bad


def recorded_step(model, batch) -> tuple[tuple, Recorder]:
    rec = Recorder()
    with rec:
        result = train_step(model, batch)
    return result, rec
