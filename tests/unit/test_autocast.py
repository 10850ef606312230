"""Mixed precision: every fpdt path under ``torch.autocast`` (bf16, fp16) runs, and lands as close to the
float32 result as ``sdpa`` under the same autocast (flash-attention's 2x rule).

sdpa is on autocast's lower-precision list on CPU and CUDA: under autocast it computes in the autocast
dtype whatever mix of dtypes it gets (HF's RoPE hands it float32 ``q, k`` beside a bf16 ``v``) and
returns that dtype. fpdt does the same (:mod:`hf_fpdt.attention.precision`). The error of each result (loss,
every gradient, logits) against the float32 ``sdpa`` run is measured as a relative norm and must be at
most twice sdpa's own under the same autocast, plus a floor of 1% of the dtype's rounding step (a loss
whose sdpa error happens to be 1e-7 by luck must not fail a 5e-6 one).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json

import pytest
import torch
from launch import SCRIPTS, accelerate_launch
from testkit import SCRATCH, tiny_model
from transformers import DynamicCache

import hf_fpdt
from hf_fpdt.attention.precision import autocast_dtype, sdpa_inputs

DTYPES = [torch.bfloat16, torch.float16]


def _floor(dtype: torch.dtype) -> float:
    return 0.01 * torch.finfo(dtype).eps  # bf16: 7.8e-5, fp16: 9.8e-6


def _reference() -> torch.nn.Module:
    return tiny_model("tiny-llama", "sdpa", dtype=None)


def _ids(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 500, (batch, length), generator=torch.Generator().manual_seed(1))


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _train_step(model: torch.nn.Module, dtype: torch.dtype | None, ids: torch.Tensor, **kwargs) -> dict:
    """Loss and every parameter gradient of one step under ``torch.autocast(dtype)`` (None: float32)."""
    model.train()
    with _autocast(dtype):
        out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    assert out.loss.dtype == torch.float32  # HF upcasts the logits for the loss: fp32 under autocast too
    out.loss.backward()
    result = {"loss": out.loss.detach()}
    result.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return result


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_within_twice_sdpa(got: dict, sdpa: dict, ref: dict, dtype: torch.dtype) -> None:
    """Each entry of ``got`` is at most twice as far from ``ref`` (float32) as ``sdpa``'s (same autocast)."""
    assert got.keys() == sdpa.keys() == ref.keys()
    for name in ref:
        err, own = _rel(got[name], ref[name]), _rel(sdpa[name], ref[name])
        assert err <= 2 * own + _floor(dtype), f"{name}: fpdt {err:.3g} vs sdpa {own:.3g} against float32"


def _fpdt(model: torch.nn.Module, **settings) -> torch.nn.Module:
    return hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=16, offload=False, **settings))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_kernel_casts_mixed_inputs_as_sdpa(dtype) -> None:
    """The registered attention alone: float32 q/k and a low-precision v (HF's RoPE output) -> sdpa's dtype."""
    from hf_fpdt.integrations.registration import fpdt_attention_forward

    module = hf_fpdt.configure(torch.nn.Module(), hf_fpdt.FPDTConfig(chunk_size=8, offload=False))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 29, 16, generator=g), torch.randn(2, 2, 29, 16, generator=g)
    v = torch.randn(2, 2, 29, 16, generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.autocast("cpu", dtype=dtype):
        assert autocast_dtype("cpu") == dtype
        assert [t.dtype for t in sdpa_inputs(q, k, v.double())] == [dtype, dtype, torch.float64]
        vl = v.to(dtype)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, vl, is_causal=True, enable_gqa=True)
        out, _ = fpdt_attention_forward(module, q, k, vl, None)
    assert out.dtype == sdpa.dtype == dtype
    assert _rel(out.transpose(1, 2), ref) <= 2 * _rel(sdpa, ref) + _floor(dtype)
    assert autocast_dtype("cpu") is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["attention_alone", "apply", "apply_checkpointing"])
def test_training_step_within_twice_sdpa(dtype, path: str, monkeypatch) -> None:
    ref_model = _reference()
    ids = _ids()
    ref = _train_step(copy.deepcopy(ref_model), None, ids)
    sdpa = _train_step(copy.deepcopy(ref_model), dtype, ids)
    model = copy.deepcopy(ref_model)
    if path == "attention_alone":
        monkeypatch.setenv("FPDT_CHUNK_SIZE", "16")  # the attention's defaults come from the environment
        model.set_attn_implementation("fpdt")
        model.gradient_checkpointing_enable()  # attention alone + checkpointing (the failing case)
    else:
        model = _fpdt(model)
        if path == "apply_checkpointing":
            model.gradient_checkpointing_enable()
    assert_within_twice_sdpa(_train_step(model, dtype, ids), sdpa, ref, dtype)


@pytest.mark.parametrize(
    "settings",
    [{"host_memory": 0}, {"host_memory": None}, {"checkpoint_segments": 2}],
    ids=["recompute", "replay", "segments"],
)
def test_checkpoint_recompute_and_replay_under_autocast(settings: dict) -> None:
    """Attention replayed from stored chunks, computed again (no host budget), and checkpoint segments:
    the recomputation runs under the first forward's autocast state (its chunks match the stored ones)."""
    dtype = torch.bfloat16
    ref_model = _reference()
    ids = _ids()
    ref = _train_step(copy.deepcopy(ref_model), None, ids)
    sdpa = _train_step(copy.deepcopy(ref_model), dtype, ids)
    model = _fpdt(copy.deepcopy(ref_model), **settings)
    model.gradient_checkpointing_enable()
    assert_within_twice_sdpa(_train_step(model, dtype, ids), sdpa, ref, dtype)


def test_lora_under_autocast() -> None:
    from peft import LoraConfig, get_peft_model

    dtype = torch.bfloat16
    ref_model = _reference()
    ids = _ids()

    def lora(model):
        torch.manual_seed(1)
        targets = ["q_proj", "v_proj", "down_proj"]
        config = LoraConfig(r=4, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
        return get_peft_model(model, config)

    ref = _train_step(lora(copy.deepcopy(ref_model)), None, ids)
    sdpa = _train_step(lora(copy.deepcopy(ref_model)), dtype, ids)
    model = lora(_fpdt(copy.deepcopy(ref_model)))
    model.gradient_checkpointing_enable()
    got = _train_step(model, dtype, ids)
    assert any("lora" in n for n in got)
    assert_within_twice_sdpa(got, sdpa, ref, dtype)


def _decode_logits(model: torch.nn.Module, dtype: torch.dtype | None, prompt, mask, steps) -> dict:
    """Prefill a left-padded prompt into a dynamic cache, then decode ``steps`` given tokens one at a time."""
    model.eval()
    out = {}
    with torch.no_grad(), _autocast(dtype):
        cache = DynamicCache(config=model.config)
        res = model(input_ids=prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        out["prefill"] = res.logits[:, -1].float()
        for n, tok in enumerate(steps.unbind(1)):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            cache = res.past_key_values
            res = model(input_ids=tok[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
            out[f"decode{n}"] = res.logits[:, -1].float()
    return out


def test_generation_under_autocast() -> None:
    dtype = torch.bfloat16
    ref_model = _reference()
    prompt = _ids(2, 24)
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0  # left padding
    steps = _ids(2, 3)
    ref = _decode_logits(copy.deepcopy(ref_model), None, prompt, mask, steps)
    sdpa = _decode_logits(copy.deepcopy(ref_model), dtype, prompt, mask, steps)
    model = _fpdt(copy.deepcopy(ref_model))
    assert_within_twice_sdpa(_decode_logits(model, dtype, prompt, mask, steps), sdpa, ref, dtype)
    with torch.autocast("cpu", dtype=dtype):  # and generate() itself runs
        tokens = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert tokens.shape == (2, 27)


@functools.cache
def _trainer_baselines() -> dict:
    """sdpa on one process: each trainer's step losses in float32 and under bf16=True."""
    from amp_loop import trainer_losses
    from sft_loop import sft_losses

    return {
        "trainer": (trainer_losses(f"{SCRATCH}/amp_t32", bf16=False), trainer_losses(f"{SCRATCH}/amp_t16")),
        "sft": (
            sft_losses("plain", f"{SCRATCH}/amp_s32", bf16=False),
            sft_losses("plain", f"{SCRATCH}/amp_s16", bf16=None),
        ),
    }


def _assert_losses(result: dict) -> None:
    for name, (ref, sdpa) in _trainer_baselines().items():
        got = result[name]
        assert len(got) == len(ref) == len(sdpa) == 3
        assert sdpa != ref  # bf16 really ran (its losses differ from float32's)
        for step, (g, s, r) in enumerate(zip(got, sdpa, ref)):
            err, own = abs(g - r) / abs(r), abs(s - r) / abs(r)
            assert err <= 2 * own + _floor(torch.bfloat16), f"{name} step {step}: fpdt {g}, sdpa bf16 {s}, fp32 {r}"


def test_trainers_bf16_sp1(tmp_path) -> None:
    from amp_loop import fpdt_runs

    _assert_losses(fpdt_runs(str(tmp_path), 1))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainers_bf16_sp2(tmp_path) -> None:
    out = tmp_path / "amp.json"
    accelerate_launch(SCRIPTS / "amp_loop.py", 2, str(out), "2")
    _assert_losses(json.loads(out.read_text()))
