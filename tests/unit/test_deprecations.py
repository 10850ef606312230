"""No deprecation reaches a user from hf_fpdt's calls, on whichever transformers is installed.

A user's step (``apply``, a training step with checkpointing and an optimizer, ``generate`` with a dynamic
and a static cache, PEFT LoRA, ``FPDTTrainer``) runs with every ``DeprecationWarning`` and ``FutureWarning``
that hf_fpdt's own call causes raised as an error (:func:`testkit.no_deprecation_from_hf_fpdt`, which walks the
callers: through ``model(...)`` the warning's own attribution lands in torch). transformers 5.24 renames
``past_key_values`` to ``cache``: passing the old name to a 5.24 forward is such a deprecation. The check
itself is tested first, on a deprecated keyword of a stand-in library called through ``nn.Module.__call__``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from testkit import deprecation_caller, no_deprecation_from_hf_fpdt, tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig

# A stand-in library with a deprecated keyword (its warning attributed to its caller, stacklevel=2, as HF's
# deprecate_kwarg does) and a deprecated function behind its own wrapper (as torch 2.13's
# dist.all_gather_into_tensor: typing_extensions.deprecated inside c10d_logger's wrapper), and a stand-in
# hf_fpdt module calling them (the keyword through nn.Module.__call__).
LIBRARY = """
import functools
import warnings

import torch
import typing_extensions

class Layer(torch.nn.Module):
    def forward(self, x, old=None):
        if old is not None:
            warnings.warn("`old` is deprecated, use `new`", FutureWarning, stacklevel=2)
        return x

def logged(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapper

@logged
@typing_extensions.deprecated("`gather` is deprecated, use `gather_single`", category=FutureWarning)
def gather(x):
    return x
"""
CALLER = """
def call(layer, x):
    return layer(x, old=1)

def call_gather(gather, x):
    return gather(x)
"""


def _module(name: str, source: str) -> dict:
    namespace = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


def test_a_deprecated_keyword_passed_by_hf_fpdt_through_a_module_call_raises() -> None:
    layer = _module("fakelib.layers", LIBRARY)["Layer"]()
    call = _module("hf_fpdt.fake_caller", CALLER)["call"]
    x = torch.ones(2)
    with pytest.raises(FutureWarning, match="`old` is deprecated.*from hf_fpdt's call"):
        with no_deprecation_from_hf_fpdt():
            call(layer, x)
    with no_deprecation_from_hf_fpdt() as internal:  # the same call from the user's code: theirs, not raised
        layer(x, old=1)
    assert internal == ["FutureWarning (test_deprecations): `old` is deprecated, use `new`"]


def test_a_deprecated_function_behind_the_librarys_own_wrapper_raises() -> None:
    gather = _module("fakelib.comm", LIBRARY)["gather"]
    call = _module("hf_fpdt.fake_caller", CALLER)["call_gather"]
    with pytest.raises(FutureWarning, match="`gather` is deprecated.*from hf_fpdt's call"):
        with no_deprecation_from_hf_fpdt():
            call(gather, torch.ones(2))
    with no_deprecation_from_hf_fpdt() as internal:
        gather(torch.ones(2))
    assert internal == ["FutureWarning (test_deprecations): `gather` is deprecated, use `gather_single`"]


def test_the_warnings_own_attribution_would_miss_it() -> None:
    """Why the callers are walked: the attribution (what pyproject's ``filterwarnings`` module field matches)
    of a keyword passed through ``module(...)`` is torch's Module.__call__, not the caller."""
    layer = _module("fakelib.layers", LIBRARY)["Layer"]()
    call = _module("hf_fpdt.fake_caller", CALLER)["call"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call(layer, torch.ones(2))
    assert [w.filename.endswith("torch/nn/modules/module.py") for w in seen] == [True]


def test_deprecation_caller_of_a_warning_in_hf_fpdt_is_hf_fpdt() -> None:
    frame = _module("hf_fpdt.fake", "import sys\ndef here():\n    return sys._getframe()\n")["here"]()
    assert deprecation_caller(frame) == "hf_fpdt"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
def test_train_step_and_generate_cause_no_deprecation(preset: str) -> None:
    ref = tiny_model(preset).eval()
    model = copy.deepcopy(ref)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = torch.randint(5, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding, as generation batches are padded
    with no_deprecation_from_hf_fpdt():
        model = hf_fpdt.apply(model, FPDTConfig(chunk_size=16, offload=True))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        model.load_state_dict(ref.state_dict())  # generate from the reference's weights
        model.eval()
        got = {
            cache: model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation=cache
            )
            for cache in ("dynamic", "static")
        }
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    for cache, tokens in got.items():
        assert torch.equal(tokens, want), cache


def test_peft_lora_step_and_generate_cause_no_deprecation() -> None:
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(5, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    with no_deprecation_from_hf_fpdt():
        model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model = hf_fpdt.apply(model, FPDTConfig(chunk_size=16))
        model(input_ids=ids, labels=ids).loss.backward()
        model.eval()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 43)


def test_fpdt_trainer_step_causes_no_deprecation(tmp_path) -> None:
    import datasets
    from transformers import TrainingArguments

    ids = torch.randint(5, 500, (4, 48), generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    with no_deprecation_from_hf_fpdt():
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to="none", save_strategy="no"
        )
        trainer = hf_fpdt.FPDTTrainer(
            model=tiny_model(), args=args, train_dataset=data, fpdt=hf_fpdt.FPDTPlugin(sp_size=1, chunk_size=16)
        )
        result = trainer.train()
    assert result.global_step == 2
