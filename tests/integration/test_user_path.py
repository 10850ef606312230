"""The user's path without reading the docs: HF defaults after ``hf_fpdt.apply``.

* ``apply`` keeps HF's forward signature (Trainer's ``remove_unused_columns=True`` default, PEFT and
  ``inspect.signature`` see the real parameters), so ``Trainer`` with default ``TrainingArguments``
  trains an applied model, plain and with PEFT LoRA, to the losses of the same model under ``sdpa``;
* ``apply`` gives the model its own config: models built from the same config object, before or after,
  keep their attention.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import datasets
import pytest
import torch
from testkit import tiny_model
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_fpdt
from hf_fpdt.models.presets import preset_config


def _dataset(n: int = 8, length: int = 40) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (n, length), generator=g).tolist()
    # "text" is a column the model's forward does not take: Trainer must drop it (default_data_collator
    # cannot batch strings), which only works when it sees HF's signature.
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "text": ["x"] * n})


def _train(model, tmp_path, name: str) -> tuple[float, dict]:
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=2)  # every other argument: HF's default
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    result = trainer.train()
    assert trainer.state.global_step == 2
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return result.training_loss, params


def _lora(model, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # the same LoRA weights for the fpdt model and its reference
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))


@pytest.mark.parametrize("peft", ["none", "lora_then_apply", "apply_then_lora"])
def test_default_training_arguments_train_an_applied_model(tmp_path, peft: str) -> None:
    ref = tiny_model("tiny-llama", "sdpa", dtype=None)
    model = copy.deepcopy(ref)
    config = hf_fpdt.FPDTConfig(chunk_size=16, offload=False)
    if peft != "none":
        ref = _lora(ref, seed=1)
    if peft == "lora_then_apply":
        model = hf_fpdt.apply(_lora(model, seed=1), config)
    elif peft == "apply_then_lora":
        model = _lora(hf_fpdt.apply(model, config), seed=1)
    else:
        model = hf_fpdt.apply(model, config)
    base = model.get_base_model() if peft != "none" else model
    want = inspect.signature(type(base).forward).parameters
    got = inspect.signature(base.forward).parameters
    assert list(got) == [p for p in want if p != "self"]  # the bound method's parameters
    assert base.config._attn_implementation == "fpdt"

    loss, params = _train(model, tmp_path, "fpdt")
    ref_loss, ref_params = _train(ref, tmp_path, "sdpa")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert params.keys() == ref_params.keys()
    # AdamW's default steps move every trained weight by about lr = 5e-5 per step; a wrong gradient moves
    # some by that much the other way (Adam normalises), the same gradient to rounding.
    for name, p in params.items():
        assert (p - ref_params[name]).abs().max() <= 1e-6, name


def test_models_built_from_the_same_config_keep_their_attention() -> None:
    config = preset_config("tiny-llama")
    config._attn_implementation = "sdpa"
    before = LlamaForCausalLM(config)  # shares the config object (HF keeps the one it was given)
    applied = LlamaForCausalLM(config)
    assert before.config is config and applied.config is config
    hf_fpdt.apply(applied, hf_fpdt.FPDTConfig(chunk_size=16))
    after = LlamaForCausalLM(config)
    assert config._attn_implementation == "sdpa"
    for model in (before, after):
        assert model.config._attn_implementation == "sdpa"
        assert all(m.config._attn_implementation == "sdpa" for m in model.modules() if "config" in m.__dict__)
    assert applied.config is not config and applied.config._attn_implementation == "fpdt"
    shared = [m.config for m in applied.modules() if "config" in m.__dict__]
    assert shared and all(c is applied.config for c in shared)  # one copy, shared like the original was
    hf_fpdt.apply(applied, hf_fpdt.FPDTConfig(chunk_size=32))  # re-applying keeps the same copy
    assert applied.config is shared[0]


def test_labels_on_padding_count_as_in_hf() -> None:
    """Padding is masked as sdpa masks it, so labels on padding (pad ids as targets) give HF's loss, no warning."""
    ref = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None)
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=16))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0  # right padding on the first row
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = model(input_ids=ids, attention_mask=mask, labels=ids).loss  # the pad ids are labels too
    want = ref(input_ids=ids, attention_mask=mask, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not [w for w in seen if "padded positions" in str(w.message)]
