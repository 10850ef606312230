"""Numerics at a trained model's scale (issue 36): fp32 against float64, never only against another fp32 path.

Two levels. The LM head alone (:func:`realscale.real_scale_head`: logits -27..+45, vocabulary 49,152, half the
tokens near-certain) on grids where fp32 logits are exact, so what is measured is the log-softmax and its
backward: per token, each log-probability within ``eps (1 + |log p|)`` of float64 and each d-hidden row within
the matmul's own rounding; per tensor, within 2x HF's (``F.cross_entropy`` / ``log_softmax`` of the upcast
logits) distance to float64, errors below 2 fp32 ulps (:data:`realscale.FP32_FLOOR`) counting as that floor. The
whole model (:func:`realscale.real_scale_model`: 8 layers, vocabulary 49,152, logits in the tens, labels drawn
from its own distribution): the loss and every gradient of ``hf_fpdt.apply`` and of ``attn_implementation="fpdt"``
alone, in fp32, within 2x HF sdpa-fp32's distance to the same model in float64, per tensor; DPO's log-probability
sums and GRPO's per-token log-probabilities through the tiled token head likewise. ``tests/scripts/
real_scale_numerics.py`` prints the head's table.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from realscale import (
    EPS32,
    FP32_FLOOR,
    ce_logit_grad,
    float64_step,
    lm_loss_grads,
    model_step,
    real_scale_head,
    real_scale_model,
    rel,
    row_grad_excess,
    token_logprob_excess,
    token_logprob_grads,
    within,
)

import hf_fpdt
from hf_fpdt.memory.tiling import tiled_token_logprobs

VOCAB = 49152
SEQ, CHUNK = 256, 64  # four attention chunks: the LSE merge runs
LOGP_BOUND = 2.0
"""Per token, in units of ``eps (1 + |log p|)``: ``z - top`` rounds once at ``|z - top| <= |log p| + log_sum``,
``log1p`` of the other terms once at ``log_sum`` (plus the sum's few ulps), the last subtraction once at ``|log p|``:
about ``eps (1 + |log p|)``; 2 leaves a factor 2 (measured: 0.56 here; ``z_y - logsumexp(z)``: 16.9)."""
ROW_BOUND = 2 * math.log2(VOCAB)
"""Per d-hidden row, in units of eps times the row's condition: ``dz @ W`` sums V terms (pairwise/blocked: ~log2 V
roundings of eps); 2x that (measured: 11 here; ``exp(z - lse) - 1``: 4e6)."""


@pytest.fixture(scope="module")
def head() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return real_scale_head(256, 256, VOCAB, exact=True)


def test_head_inputs_look_trained(head):
    h, w, y = head
    z = h @ w.t()
    assert torch.equal((h.float() @ w.float().t()).double(), z)  # exact fp32 logits: the errors are the loss's
    assert z.max() > 40 and z.min() < -20
    top2 = torch.log_softmax(z, -1).topk(2, -1).values
    assert ((top2[:, 0] - top2[:, 1]) > 10).float().mean() > 0.15  # near-certain tokens: 1 - p(top) below 5e-5
    assert 0.5 < torch.nn.functional.cross_entropy(z, y).item() < 3


def test_tiled_lm_loss_fp32_vs_float64(head):
    h, w, y = head
    ref = lm_loss_grads(h, w, y, "hf")
    hf = lm_loss_grads(h.float(), w.float(), y, "hf")
    for tiles in (1, 4):
        got = lm_loss_grads(h.float(), w.float(), y, "tiled", tiles)
        for name, g, b, r in zip(("loss", "d hidden", "d head weight"), got, hf, ref):
            assert within(rel(g, r), rel(b, r)), f"{name}, {tiles} tiles: {rel(g, r):.2e} vs HF {rel(b, r):.2e}"
        excess = row_grad_excess(got[1], ce_logit_grad(h, w, y), w)
        assert excess <= ROW_BOUND, f"{tiles} tiles: a d-hidden row off by {excess:.3g} eps x its condition"


def test_tiled_token_logprobs_fp32_vs_float64(head):
    h, w, y = head
    ref = token_logprob_grads(h, w, y, "hf")
    hf = token_logprob_grads(h.float(), w.float(), y, "hf")
    got = token_logprob_grads(h.float(), w.float(), y, "tiled", 4)
    for name in ref:
        assert within(rel(got[name], ref[name]), rel(hf[name], ref[name])), (
            f"{name}: {rel(got[name], ref[name]):.2e} vs HF {rel(hf[name], ref[name]):.2e}"
        )
    excess = token_logprob_excess(got["log_probs"], ref["log_probs"])
    assert excess <= LOGP_BOUND, f"a token's log-probability off by {excess:.3g} eps (1 + |log p|)"


def test_tiled_head_bf16_vs_hf_bf16(head):
    """bf16 inputs (the head and hidden state as a bf16 model holds them): the same 2x rule against HF's bf16 path,
    the reference computing on the same bf16 values in float64."""
    h, w, y = head[0].to(torch.bfloat16), head[1].to(torch.bfloat16), head[2]
    ref = lm_loss_grads(h.double(), w.double(), y, "hf")
    hf = lm_loss_grads(h, w, y, "hf")
    got = lm_loss_grads(h, w, y, "tiled", 4)
    for name, g, b, r in zip(("loss", "d hidden", "d head weight"), got, hf, ref):
        assert within(rel(g, r), rel(b, r)), f"bf16 {name}: {rel(g, r):.2e} vs HF {rel(b, r):.2e}"


@pytest.fixture(scope="module")
def trained():
    """The model's weights, a sample and its own labels, and the float64 reference's loss and gradients."""
    from realscale import own_samples

    model = real_scale_model()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    labels = own_samples(model, ids)
    state = model.state_dict()
    ref = float64_step(copy.deepcopy(model).double(), ids, labels)
    return state, ids, labels, ref


def _errors(got: dict, ref: dict) -> dict:
    return {n: rel(got[n], ref[n]) for n in ref}


def _check(errors: dict, base: dict, what: str) -> None:
    bad = {n: f"{e:.2e} vs sdpa {base[n]:.2e}" for n, e in errors.items() if not within(e, base[n])}
    assert not bad, f"{what}: over 2x sdpa's float64 distance (floor {FP32_FLOOR:.1e}): {bad}"


@pytest.mark.slow
def test_model_fp32_vs_float64(trained, monkeypatch):
    """Loss and every gradient: ``hf_fpdt.apply`` (all parts chunked) and the attention-only path."""
    state, ids, labels, ref = trained
    sdpa = _errors(model_step(real_scale_model(), ids, labels), ref)
    assert sdpa["loss"] < 10 * EPS32  # the reference itself is sound: HF's fp32 loss agrees to a few ulps
    applied = hf_fpdt.apply(real_scale_model(), hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    _check(_errors(model_step(applied, ids, labels), ref), sdpa, "hf_fpdt.apply")
    monkeypatch.setenv("FPDT_CHUNK_SIZE", str(CHUNK))  # the attention-only path's chunk comes from the environment
    _check(_errors(model_step(real_scale_model(attn="fpdt"), ids, labels), ref), sdpa, 'attn_implementation="fpdt"')


def _token_logprobs(model, ids, labels, tiled: bool) -> dict:
    """DPO's sum and GRPO's per-token log-probabilities of ``labels`` and the gradients of ``sum_t a_t log p_t``
    (advantages +-1) through the whole model: hf_fpdt's tiled token head, or log_softmax of HF's logits."""
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    targets = labels[0, 1:]
    if tiled:
        logp = tiled_token_logprobs(hidden, model.lm_head, targets, 4, [model.lm_head.weight])[0]
    else:
        logits = model.lm_head(hidden)
        logp = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, -1)
        logp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    adv = torch.randint(0, 2, targets.shape, generator=torch.Generator().manual_seed(5)).to(logp.dtype) * 2 - 1
    (adv * logp).sum().backward()
    return {"sum": logp.detach().sum(), "log_probs": logp.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_dpo_grpo_log_probs_fp32_vs_float64(trained):
    state, ids, labels, _ = trained
    ref = _token_logprobs(real_scale_model().double(), ids, labels, tiled=False)
    base = _errors(_token_logprobs(real_scale_model(), ids, labels, tiled=False), ref)
    applied = hf_fpdt.apply(real_scale_model(), hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    _check(_errors(_token_logprobs(applied, ids, labels, tiled=True), ref), base, "tiled token log-probs")
