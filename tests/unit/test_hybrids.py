"""Hybrids through ``hf_fpdt.apply``: Qwen3-Next (gated DeltaNet linear attention + gated full attention, MoE with
a gated shared expert), Falcon-H1 (Mamba-2 mixer beside the attention in every layer, muP multipliers) and Kimi
Linear (Kimi delta attention layers and NoPE multi-head latent attention layers, both under ``self_attn``).

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
from families import CHUNK, CONFIG, assert_same, family_batch, recorded_step, train_step
from mla_hybrids import HYBRIDS, WHOLE, hybrid_model

import hf_fpdt
from hf_fpdt.integrations.apply import _refuse_whole_under_sp


@pytest.mark.parametrize("model_type", list(HYBRIDS))
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


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_checkpointed_hybrid_step_equals_eager(model_type):
    """Under HF's non-reentrant activation checkpointing: the recomputation replays the chunked attention layers'
    output (Qwen3-Next's tiled gate recomputed with it) and recomputes the whole mixers as HF does."""
    ref = hybrid_model(model_type)
    batch = family_batch()
    want = train_step(copy.deepcopy(ref), batch)
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(want, train_step(hf_fpdt.apply(model, CONFIG), batch))
