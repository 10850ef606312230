"""Registration with transformers, and clear ValueErrors for everything fpdt attention cannot honour."""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.integrations.mask_spec import padding_mask
from hf_fpdt.integrations.registration import NAME, fpdt_attention_forward, fpdt_mask, runtime_of

PRESETS = ["tiny-llama", "tiny-neox"]
S = 40


def _model(preset: str, **overrides):
    model = tiny_model(preset, "fpdt", dtype=None, seed=None, **overrides)
    return hf_fpdt.configure(model, FPDTConfig(chunk_size=16, offload=False))


def _ids(model, batch=2):
    return torch.randint(0, model.config.vocab_size, (batch, S))


def test_import_registers_fpdt():
    assert NAME == "fpdt"
    assert AttentionInterface._global_mapping[NAME] is fpdt_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is fpdt_mask
    hf_fpdt.integrations.registration.register()  # idempotent
    assert AttentionInterface._global_mapping[NAME] is fpdt_attention_forward


@pytest.mark.parametrize("preset", PRESETS)
def test_from_config_uses_fpdt(preset):
    model = _model(preset)
    assert model.config._attn_implementation == NAME
    out = model(input_ids=_ids(model), labels=_ids(model))
    assert torch.isfinite(out.loss)


def test_runtime_defaults_from_env_without_apply(monkeypatch):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "16")
    monkeypatch.setenv("FPDT_OFFLOAD", "0")
    model = tiny_model("tiny-llama", "fpdt", dtype=None, seed=None)
    with torch.no_grad():
        model(input_ids=_ids(model))
    attn = [m for m in model.modules() if hasattr(m, "is_causal")]
    assert attn and all(runtime_of(m).config.chunk_size == 16 for m in attn)
    assert all(runtime_of(m).store("cpu").enabled is False for m in attn)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "mask_row",
    [[0] * 5 + [1] * (S - 5), [1] * 10 + [0] * 3 + [1] * (S - 13), [1] * 30 + [0] * (S - 30)],
    ids=["left-padding", "hole", "right-padding"],
)
def test_padding_masks(preset, mask_row):
    """Every padding runs as under sdpa (logits, pad positions included); test_masks_train.py checks gradients."""
    model = _model(preset)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    mask, ids = torch.tensor([[1] * S, mask_row]), _ids(model)
    got = model(input_ids=ids, attention_mask=mask).logits  # gradients recorded: the training pipeline
    want = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_position_ids_are_documents_as_in_hf(preset):
    """Positions restarting inside a row are packed documents (HF's rule for sdpa without a KV cache)."""
    model = _model(preset)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == NAME
    ids = _ids(model)
    pos = torch.cat([torch.arange(25), torch.arange(S - 25)]).expand(2, S)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # increasing global positions that do not start at 0 are one document (an SP rank's slice)
        model(input_ids=ids, position_ids=torch.arange(100, 100 + S).expand(2, S))


@pytest.mark.parametrize("preset", PRESETS)
def test_attention_dropout_raises_in_training(preset):
    model = _model(preset, attention_dropout=0.1)
    model.eval()  # no dropout in eval: allowed
    with torch.no_grad():
        model(input_ids=_ids(model))
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=_ids(model))


@pytest.mark.parametrize("preset", PRESETS)
def test_non_causal_module_raises(preset):
    model = _model(preset)
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False
    with pytest.raises(ValueError, match="causal"):
        model(input_ids=_ids(model))


def _qkv(sq=8, sk=8):
    return torch.randn(1, 4, sq, 16), torch.randn(1, 2, sk, 16), torch.randn(1, 2, sk, 16)


class _Module(torch.nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        hf_fpdt.configure(self, FPDTConfig(chunk_size=4, offload=False))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"attention_mask": torch.zeros(1, 1, 8, 8)}, "later key"),  # an all-zero float mask is not causal
        ({"attention_mask": torch.full((1, 1, 8, 8), -1.0).tril()}, "additive bias"),
        ({"attention_mask": torch.ones(1, 4, 8, 8, dtype=torch.bool).tril()}, "per head"),
        ({"dropout": 0.1}, "dropout"),
        ({"s_aux": torch.zeros(3)}, r"sinks \(s_aux\) must be .* one logit per query head, \[4\]"),
        ({"is_causal": False}, "causal"),
    ],
)
def test_attention_function_rejects(kwargs, match):
    q, k, v = (
        t.requires_grad_() for t in _qkv()
    )  # a training call (without gradients: hf_fpdt.attention.cached_attention)
    kwargs.setdefault("attention_mask", None)
    with pytest.raises(ValueError, match=match):
        fpdt_attention_forward(_Module(), q, k, v, **kwargs)


def test_attention_function_rejects_a_kv_compressor():
    """DeepSeek-V4's compressed attention extends the keys and the mask inside the module: refused by name, with
    and without gradients."""
    module = _Module()
    module.compressor = torch.nn.Identity()
    for grad in (True, False):
        q, k, v = (t.requires_grad_(grad) for t in _qkv())
        with pytest.raises(ValueError, match="KV compressor"):
            fpdt_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4))


def test_attention_function_rejects_kv_cache_with_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(sq=1, sk=8))
    with pytest.raises(ValueError, match="KV cache"):
        fpdt_attention_forward(_Module(), q, k, v, None)


def test_attention_function_output_layout():
    q, k, v = _qkv()
    out, weights = fpdt_attention_forward(_Module(), q, k, v, None, scaling=0.5)
    assert weights is None and out.shape == (1, 8, 4, 16)  # [B, S, H, D], as HF's sdpa returns
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_mask_function():
    assert fpdt_mask(2, 5, 5) is None
    # a mask that keeps every key: no padding mask, only the marker that one was given (HF's rule: no packing)
    kept = fpdt_mask(2, 5, 5, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert kept.shape == (2, 0) and padding_mask(kept) is None
    right = fpdt_mask(2, 5, 5, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    assert torch.equal(right[0], torch.tensor([True] * 3 + [False] * 2))  # pad queries see what sdpa lets them see
    with pytest.raises(ValueError, match="2D"):
        fpdt_mask(2, 5, 5, attention_mask=torch.ones(2, 1, 5, 5))
    left = fpdt_mask(
        1, 5, 5, attention_mask=torch.tensor([[0, 1, 1, 1, 1]])
    )  # served by hf_fpdt.attention.cached_attention
    assert torch.equal(left, torch.tensor([[False, True, True, True, True]]))


def test_apply_rejects_model_without_attention():
    with pytest.raises(ValueError, match="attention"):
        hf_fpdt.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), FPDTConfig(chunk_size=16))
