"""A trained checkpoint, not only trained-looking numbers: SmolLM2-135M-Instruct (:func:`realscale.smollm2`, 30
layers, vocabulary 49,152) on real English text (this repository's LICENSE), fp32 against the same weights in
float64. The loss and every gradient of ``hf_fpdt.apply`` (attention, projections, MLP, LM head and loss chunked)
stay within 2x HF sdpa-fp32's distance to float64, per tensor (errors below 2 fp32 ulps counting as that floor),
as in ``test_real_scale.py``; and the text is text the model knows (its loss a few nats, logits in the tens)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from realscale import FP32_FLOOR, float64_step, model_step, rel, smollm2, within

import hf_fpdt

SEQ, CHUNK = 384, 128  # three attention chunks per sequence: the LSE merge and the nested backward run
LICENSE = Path(__file__).resolve().parents[2] / "LICENSE"


@pytest.mark.slow
def test_smollm2_fp32_vs_float64() -> None:
    model, tokenizer = smollm2()
    ids = tokenizer(LICENSE.read_text(), return_tensors="pt").input_ids[:, :SEQ]
    assert ids.shape[1] == SEQ
    labels = ids.clone()  # HF shifts: the model predicts the text
    ref = float64_step(copy.deepcopy(model).double(), ids, labels)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert 1.0 < ref["loss"].item() < 5.0, ref["loss"]  # English it knows (random weights: ~10.8 = log 49152)
    assert logits.abs().max() > 20, logits.abs().max()  # a trained head's magnitudes
    sdpa = {n: rel(g, ref[n]) for n, g in model_step(copy.deepcopy(model), ids, labels).items()}
    applied = hf_fpdt.apply(copy.deepcopy(model), hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    got = {n: rel(g, ref[n]) for n, g in model_step(applied, ids, labels).items()}
    assert got.keys() == sdpa.keys() and len(got) > 100
    bad = {n: f"{e:.2e} vs sdpa {sdpa[n]:.2e}" for n, e in got.items() if not within(e, sdpa[n])}
    assert not bad, f"over 2x sdpa's float64 distance (floor {FP32_FLOOR:.1e}): {bad}"
