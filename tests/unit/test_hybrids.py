"""Hybrids through ``hf_fpdt.apply``: Qwen3-Next (gated DeltaNet linear attention + gated full attention, MoE with
a gated shared expert) and Falcon-H1 (Mamba-2 mixer beside the attention in every layer, muP multipliers).

``apply`` chunks the full-attention layers (their projection per chunk inside the pipeline; Qwen3-Next's output
gate and ``o_proj`` tiled), the MLP / MoE and the LM head + loss; the linear-attention and state-space mixers run
whole, as in HF, and ``model.fpdt.whole`` names them (a log line too). One training step (fp32, chunk 16 < 45
tokens) equals HF eager in loss and every gradient; under sequence parallelism these mixers are refused by name.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from families import CHUNK, CONFIG, assert_same, family_batch, recorded_step, train_step
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.integrations.apply import _refuse_whole_under_sp

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
CASES = {"qwen3_next": QWEN3_NEXT, "falcon_h1": FALCON_H1}
WHOLE = {
    "qwen3_next": ("layer 0: linear_attn (Qwen3NextGatedDeltaNet)",),
    "falcon_h1": ("layer 0: mamba (FalconH1Mixer)", "layer 1: mamba (FalconH1Mixer)"),
}


def hybrid_model(model_type: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(model_type, "eager", **CASES[model_type]).train()


@pytest.mark.parametrize("model_type", list(CASES))
def test_hybrid_step_equals_eager_and_names_the_whole_mixers(model_type, caplog):
    ref = hybrid_model(model_type)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="hf_fpdt"):
        warnings.simplefilter("error")  # registered: no partial-support warning
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    assert model.fpdt.whole == WHOLE[model_type]
    assert any("run whole" in r.getMessage() and WHOLE[model_type][0] in r.getMessage() for r in caplog.records)
    batch = family_batch()
    got, rec = recorded_step(model, batch)
    assert_same(train_step(ref, batch), got)
    assert rec.queries and max(rec.queries) <= CHUNK  # the full-attention layer ran chunked
    if model_type == "qwen3_next":
        out = model(**batch)
        assert out.aux_loss is not None and len(out.router_logits) == 1  # the one MoE layer's router, once


def test_hybrid_mixers_are_refused_under_sequence_parallelism():
    whole = WHOLE["qwen3_next"]
    with pytest.raises(ValueError, match=r"qwen3_next under sequence parallelism .*linear_attn \(Qwen3NextGated"):
        _refuse_whole_under_sp("qwen3_next", whole, 2)
    _refuse_whole_under_sp("qwen3_next", whole, 1)  # one process: runs
    _refuse_whole_under_sp("llama", (), 2)  # nothing whole: runs
