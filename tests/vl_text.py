"""Tiny vision-language models (Qwen2.5-VL, Qwen3-VL: fp32, two text layers, one vision block) and text-only batches
with their 3D rotary position ids, for ``test_mrope`` and its sequence-parallel test."""

from __future__ import annotations

import warnings

import torch
from testkit import tiny_model
from transformers import AutoConfig

TEXT = {
    "vocab_size": 112,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# mrope_section: the rotary frequencies (head_dim / 2 = 4) split over the temporal, height and width positions
VL = {
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}},
    "qwen3_vl": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    },
}
VISION = {
    "qwen2_5_vl": {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32},
    "qwen3_vl": {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32},
}


def vl_config(model_type: str, **text_overrides):
    """A tiny ``model_type`` (``qwen2_5_vl`` or ``qwen3_vl``, or their ``*_text``) config, ``text_overrides`` set on
    its text config."""
    model_type = model_type.removesuffix("_text")
    return AutoConfig.for_model(
        model_type,
        text_config={**TEXT, **VL[model_type], **text_overrides},
        vision_config=VISION[model_type],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def vl_model(model_type: str, attn: str = "eager", state: dict | None = None) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(vl_config(model_type), attn, state=state).train()


OFFSETS = (0, 5, 9)  # the temporal, height and width rows start apart, so each rotary section sees its own row


def mrope_positions(batch: int, seq: int, rows: int = 3, text: torch.Tensor | None = None) -> torch.Tensor:
    """3D rotary positions ``[rows, B, S]`` of a text-only batch: each row counts up by one from its offset
    (:data:`OFFSETS`); ``rows=4``: the text positions (``text``, default the token index) first, as Qwen2.5-VL /
    Qwen3-VL take them for packed rows."""
    base = torch.arange(seq)
    pos = torch.stack([base + off for off in OFFSETS]).unsqueeze(1).expand(3, batch, seq)
    if rows == 4:
        pos = torch.cat([(base if text is None else text).expand(1, batch, seq), pos])
    return pos.clone()


def assert_same_text(ref: tuple, got: tuple, rtol: float = 1e-5) -> None:
    """Loss and every gradient of a text-only step equal (the vision tower's parameters get none on either side)."""
    from families import assert_same

    with_grad = {n: g for n, g in ref[1].items() if g is not None}
    assert with_grad and all(got[1][n] is None for n in ref[1] if n not in with_grad)
    assert_same((ref[0], with_grad), (got[0], {n: got[1][n] for n in with_grad}))


def rope_outside_attention(model_type: str) -> bool:
    """Whether the installed transformers rotates ``model_type``'s q/k with ``apply_rotary_pos_emb`` from HF's
    ``cos`` / ``sin`` (5.24), which ``apply``'s chunked projection calls; 5.10's Qwen2.5-VL mixes the 3D sections
    inside the attention instead, and ``apply`` refuses it by name."""
    import importlib

    base = model_type.removesuffix("_text")
    return hasattr(importlib.import_module(f"transformers.models.{base}.modeling_{base}"), "apply_rotary_pos_emb")
