"""Vision-language text decoders with 3D rotary positions (Qwen2.5-VL, Qwen3-VL: ``position_ids`` of shape
``[3, B, S]`` or ``[4, B, S]``, text-only batches) equal HF eager, attention-only and under ``hf_fpdt.apply``.

The multimodal RoPE becomes HF's ``cos`` / ``sin`` tables before the attention, so ``apply``'s chunked projection
rotates with them unchanged (``qwen2_5_vl_text``, ``qwen3_vl_text`` in the registry: projection, MLP and loss
chunked); packed documents are read from the text row of ``[4, B, S]`` positions (HF's rule) and not from
``[3, B, S]`` ones. fp32, chunk 16 < 45 tokens, loss and every gradient (the vision tower gets none). Two
sequence-parallel ranks: ``tests/integration/test_mrope_sp.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from families import CHUNK, CONFIG, INTER, family_batch, recorded_step, train_step, violations
from vl_text import VL, assert_same_text, mrope_positions, rope_outside_attention, vl_model

import hf_fpdt
from hf_fpdt.integrations.forward_hooks import text_positions

DOCS = (13, 20, 12)


def _batch(rows: int | None, packed: bool = False) -> dict:
    batch = family_batch()
    b, s = batch["input_ids"].shape
    if rows is None:
        return batch
    text = torch.cat([torch.arange(n) for n in DOCS]) if packed else None
    return {**batch, "position_ids": mrope_positions(b, s, rows, text), "use_cache": False}


@pytest.mark.parametrize("rows", [3, 4])
@pytest.mark.parametrize("model_type", list(VL))
def test_mrope_text_batch_equals_eager(model_type, rows):
    ref = vl_model(model_type)
    batch = _batch(rows)
    want = train_step(copy.deepcopy(ref), batch)
    assert_same_text(want, train_step(vl_model(model_type, "sdpa", state=ref.state_dict()), batch))
    attention_only = hf_fpdt.configure(vl_model(model_type, "fpdt", state=ref.state_dict()), CONFIG)
    assert_same_text(want, train_step(attention_only, batch))
    if not rope_outside_attention(model_type):  # an older transformers (5.10's Qwen2.5-VL): refused by name
        with pytest.raises(ValueError, match="has no apply_rotary_pos_emb"):
            hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # registered: no partial-support warning
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    got, rec = recorded_step(model, batch)
    assert_same_text(want, got)
    assert rec.queries and max(rec.queries) <= CHUNK
    assert violations(rec, INTER) == []


def test_packed_text_positions_of_4_rows_are_documents():
    """Row 0 of ``[4, B, S]`` restarting at each document: HF masks the documents apart, and so does fpdt (before,
    ``apply`` read no documents from 3D positions: the unpacked loss)."""
    if not rope_outside_attention("qwen3_vl"):
        pytest.skip(f"transformers {transformers.__version__}: apply refuses these models")
    ref = vl_model("qwen3_vl")
    packed, plain = _batch(4, packed=True), _batch(4)
    want = train_step(copy.deepcopy(ref), packed)
    assert abs(want[0] - train_step(copy.deepcopy(ref), plain)[0]) > 1e-4  # the documents change the loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert_same_text(want, train_step(model, packed))


def test_text_positions_rule():
    pos = mrope_positions(2, 6, 4)
    assert torch.equal(text_positions(pos), pos[0])
    assert text_positions(mrope_positions(2, 6, 3)) is None
    flat = torch.arange(6).expand(2, 6)
    assert text_positions(flat) is flat and text_positions(None) is None
