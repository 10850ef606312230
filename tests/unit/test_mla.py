"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3, GLM-4 MoE lite) through ``hf_fpdt.apply``.

q/k heads of ``qk_nope_head_dim + qk_rope_head_dim`` = 12 and v heads of ``v_head_dim`` = 8 (different through
chunked attention, the projection's backward and the generation cache); the q LoRA (``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``) or a plain ``q_proj``, and the compressed KV projection (``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``) run per chunk inside the pipeline; the MoE (router over the sequence, routed
experts and the shared expert tiled) and the dense first layer tiled. One training step (fp32, chunk 16 < 45
tokens) equals HF eager in loss and every gradient, and no tensor holds the full sequence with a wide dimension.
Two sequence-parallel ranks: ``tests/integration/test_mla_hybrids_sp.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from families import CHUNK, CONFIG, assert_same, family_batch, recorded_step, train_step, violations
from mla_hybrids import MLA, MLA_CASES, mla_model

import hf_fpdt


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_step_equals_eager_and_is_chunked(name):
    model_type, overrides = MLA_CASES[name]
    ref = mla_model(model_type, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a registered family: no partial-support warning
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    assert model.fpdt.whole == ()
    batch = family_batch()
    got, rec = recorded_step(model, batch)
    assert_same(train_step(ref, batch), got)
    assert rec.queries and max(rec.queries) <= CHUNK
    assert violations(rec, MLA["intermediate_size"]) == []
    attn = ref.model.layers[0].self_attn
    if overrides.get("q_lora_rank", 1) is not None:
        assert attn.q_a_proj.weight.grad is not None  # the q LoRA is in the compared gradients
    assert attn.qk_head_dim != attn.v_head_dim


def test_mla_generation_equals_eager():
    """The generation cache (HF's compressed-latent cache; fpdt's cached attention with v narrower than q/k)."""
    ref = mla_model("deepseek_v3").eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    prompt = family_batch()["input_ids"][:, :30]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))
    with torch.no_grad():
        assert torch.allclose(model(prompt).logits, ref(prompt).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("masked", [False, True])
def test_block_kernels_with_v_narrower_than_q(backend, masked):
    """One block's forward and backward with v's head dim (8) below q/k's (12): the float64 reference's."""
    from standins import reference_attention

    from hf_fpdt.attention.routes import block_backward, block_forward

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 16, 4, 12, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if masked else None
    out, lse = block_forward(q, k, v, not masked, 0.3, backend, mask=mask)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, 0.3)
    assert out.shape == v.shape and torch.allclose(out, ref, atol=1e-10)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)
    grads = block_backward(dout, q, k, v, out, lse, not masked, 0.3, backend, mask=mask)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-10)


def test_mla_left_padded_step_equals_sdpa():
    """A padding mask whose first chunk of row 0 is all padding: the chunk's empty output rows are v-wide. Against
    sdpa (eager fills a row without keys with the dtype's minimum, not -inf: its padding rows, and through the
    layers the loss, differ by about 3e-5)."""
    ref = mla_model("deepseek_v3", "sdpa")
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    batch = family_batch()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, :20] = 0
    labels = batch["labels"].masked_fill(mask == 0, -100)
    batch = {**batch, "attention_mask": mask, "labels": labels}
    assert_same(train_step(ref, batch), train_step(model, batch))


@pytest.mark.parametrize("model_type", ["deepseek_v2", "glm4_moe_lite"])
def test_mla_attention_only_equals_eager(model_type):
    """``attn_implementation="fpdt"`` alone (HF's projection, fpdt's chunked attention) with v narrower than q/k (the
    sweep's MLA config has equal widths)."""
    ref = mla_model(model_type)
    model = hf_fpdt.configure(mla_model(model_type, "fpdt", state=ref.state_dict()), CONFIG)
    batch = family_batch()
    assert_same(train_step(ref, batch), train_step(model, batch))


def test_plan_shape_counts_mla_heads_at_their_width():
    """The planner's shape of an MLA model: q/k's width per head (the config's ``head_dim`` is RoPE's), one k/v
    per query head, so the host budget holds what the attention stores (v, narrower, is counted at q/k's width)."""
    from hf_fpdt.memory.plan_types import ModelShape

    shape = ModelShape.from_config(mla_model("deepseek_v3").config)
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 4, MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"])


def test_checkpointed_mla_step_equals_eager():
    """Under HF's non-reentrant activation checkpointing (the recomputation replays the stored attention output)."""
    ref = mla_model("deepseek_v3")
    batch = family_batch()
    want = train_step(copy.deepcopy(ref), batch)
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(want, train_step(hf_fpdt.apply(model, CONFIG), batch))
