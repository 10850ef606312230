"""``hf_fpdt.unapply``: after apply + unapply a model computes as HF's ``sdpa`` model again, exactly.

Also: everything ``apply`` keeps is in one state object (``model.fpdt``, not an ``nn.Module``), so nothing
named fpdt is left on any module, no hook and no instance forward stays, ``state_dict`` never changes, a
deep copy of an applied model is applied on its own, and ``save_pretrained`` works on an applied model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import rel_err, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

import hf_fpdt
from hf_fpdt.integrations.state import FPDTState, installed_forwards

S = 45
CONFIG = hf_fpdt.FPDTConfig(chunk_size=16, offload=True, checkpoint_segments=2)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, lora)


def _mixtral() -> torch.nn.Module:
    cfg = AutoConfig.for_model(
        "mixtral", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    return tiny_model(cfg, "sdpa")


MODELS = {
    "llama": lambda: tiny_model("tiny-llama", num_hidden_layers=3),
    "neox": lambda: tiny_model("tiny-neox", num_hidden_layers=3),
    "mixtral": _mixtral,
    "llama+lora": lambda: _lora(tiny_model("tiny-llama", num_hidden_layers=3)),
}


def _checkpointing(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.detach(), **grads}


def _fpdt_names(model: torch.nn.Module) -> list[str]:
    return [f"{type(m).__name__}.{k}" for m in model.modules() for k in vars(m) if "fpdt" in k.lower()]


def _trace(model: torch.nn.Module) -> dict:
    """What a model carries beside its weights: instance forwards, hooks, attention implementation."""
    return {
        "forwards": [name for name, m in model.named_modules() if "forward" in vars(m)],
        "hooks": [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()],
        "attn": model.config._attn_implementation,
    }


def _ids(model: torch.nn.Module) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (2, S), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("name", list(MODELS))
def test_unapply_gives_back_the_sdpa_model_exactly(name, checkpointing):
    ref = _checkpointing(MODELS[name](), checkpointing)
    ids = _ids(ref)
    want = _step(ref, ids)
    model = copy.deepcopy(ref)
    keys, before = list(model.state_dict()), _trace(model)
    hf_fpdt.apply(model, CONFIG)
    assert isinstance(model.fpdt, FPDTState) and not isinstance(model.fpdt, torch.nn.Module)
    assert list(model.state_dict()) == keys
    assert _trace(model) != before
    applied = _step(model, ids)
    for key, value in want.items():
        assert rel_err(applied[key], value) < 1e-5, key
    assert hf_fpdt.unapply(model) is model
    assert _fpdt_names(model) == []
    assert _trace(model) == before  # no instance forward, hook or attention implementation of fpdt's left
    assert list(model.state_dict()) == keys
    got = _step(model, ids)
    for key, value in want.items():
        assert (got[key] - value).abs().max() <= 1e-6 * max(1.0, float(value.abs().max())), key
    hf_fpdt.apply(model, CONFIG)  # again after unapply
    again = _step(model, ids)
    for key, value in applied.items():
        assert rel_err(again[key], value) < 1e-5, key


def test_apply_again_replaces_the_state_and_unapply_needs_one():
    model = tiny_model("tiny-llama")
    before = _trace(model)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=8))
    first = model.fpdt
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=16))  # starts from HF's model: one set of wrappers
    assert model.fpdt is not first and model.fpdt.runtime.config.chunk_size == 16
    layer = model.model.layers[0]
    assert [w.kind for w in installed_forwards(layer)] == ["recompute_marker", "offload_inputs"]
    assert len(model._forward_pre_hooks) == len(model.fpdt.hooks)
    hf_fpdt.unapply(model)
    assert _trace(model) == before
    with pytest.raises(ValueError, match="holds no hf_fpdt state"):
        hf_fpdt.unapply(model)


def test_unapply_refuses_to_drop_a_later_wrapper():
    model = hf_fpdt.apply(tiny_model("tiny-llama"), hf_fpdt.FPDTConfig(chunk_size=8))
    mlp = model.model.layers[0].mlp
    inner = mlp.forward

    def theirs(*args, **kwargs):
        return inner(*args, **kwargs)

    theirs.__wrapped__ = inner  # as functools.wraps leaves it
    mlp.forward = theirs
    with pytest.raises(ValueError, match="LlamaMLP was wrapped by another library"):
        hf_fpdt.unapply(model)
    assert isinstance(model.fpdt, FPDTState)  # nothing was taken off


def test_deepcopy_of_an_applied_model_is_applied_on_its_own():
    ref = _checkpointing(tiny_model("tiny-llama"), True)
    ids = _ids(ref)
    want = _step(ref, ids)
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    twin = copy.deepcopy(model)
    assert twin.fpdt is not model.fpdt and twin.fpdt.runtime is not model.fpdt.runtime
    assert twin.model.layers[0].self_attn.fpdt is twin.fpdt  # one state per model, its modules refer to it
    hf_fpdt.unapply(twin)  # the copy's hooks and forwards only
    assert _fpdt_names(twin) == [] and isinstance(model.fpdt, FPDTState)
    assert len(model._forward_pre_hooks) == len(model.fpdt.hooks) > 0 and len(twin._forward_pre_hooks) == 0
    for m in (model, twin):
        got = _step(m, ids)
        for key, value in want.items():
            assert rel_err(got[key], value) < 1e-5, key
    assert model.fpdt.runtime.store(ids.device).host_bytes > 0  # the original still offloads: still applied


def test_save_pretrained_of_an_applied_model(tmp_path):
    ref = tiny_model("tiny-llama")
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    state = ref.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


def test_lora_added_after_apply_and_unapply_through_the_peft_wrapper():
    base = _checkpointing(tiny_model("tiny-llama", num_hidden_layers=3), True)
    ref = _lora(copy.deepcopy(base))
    ids = _ids(base)
    want = _step(ref, ids)
    model = _lora(hf_fpdt.apply(copy.deepcopy(base), CONFIG))  # PEFT wraps the applied model
    assert model.fpdt is model.get_base_model().fpdt  # reached through the wrapper
    applied = _step(model, ids)
    for key, value in want.items():
        assert rel_err(applied[key], value) < 1e-5, key
    hf_fpdt.unapply(model)
    assert _fpdt_names(model) == [] and _trace(model.get_base_model()) == _trace(ref.get_base_model())
    got = _step(model, ids)
    for key, value in want.items():
        assert (got[key] - value).abs().max() <= 1e-6 * max(1.0, float(value.abs().max())), key
