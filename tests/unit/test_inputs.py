"""Inputs checked like HF after ``hf_fpdt.apply``: misfit shapes are a ``ValueError`` naming the argument
(they used to be cut to size silently, or fail deep inside with "(8) vs (0)"), fitting ones run as under
sdpa, and ``output_attentions=True`` gets sdpa's notice and sdpa's (empty) attentions."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.integrations.inputs import OUTPUT_ATTENTIONS_NOTICE

B, S = 2, 8


@pytest.fixture(scope="module")
def models():
    ref = tiny_model("tiny-llama", "sdpa", dtype=None)
    return ref, hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=4, offload=False))


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (B, S), generator=torch.Generator().manual_seed(0))


MISFITS = {
    "position_ids longer": ("position_ids", torch.arange(S + 2)[None]),
    "position_ids shorter": ("position_ids", torch.arange(S - 2)[None]),
    "position_ids batch": ("position_ids", torch.arange(S)[None].expand(B + 1, S)),
    "position_ids 1D": ("position_ids", torch.arange(S)),
    "cache_position longer": ("cache_position", torch.arange(S + 2)),
    "attention_mask longer": ("attention_mask", torch.ones(B, S + 2, dtype=torch.long)),
    "attention_mask shorter": ("attention_mask", torch.ones(B, S - 2, dtype=torch.long)),
    "attention_mask batch": ("attention_mask", torch.ones(B + 1, S, dtype=torch.long)),
    "attention_mask 4D queries": ("attention_mask", torch.ones(B, 1, S - 2, S, dtype=torch.bool)),
}


@pytest.mark.parametrize("case", list(MISFITS))
@pytest.mark.parametrize("labels", [False, True], ids=["no_labels", "labels"])
def test_misfit_shapes_name_the_argument(models, case: str, labels: bool) -> None:
    _, model = models
    name, value = MISFITS[case]
    ids = _ids()
    with pytest.raises(ValueError, match=rf"^{name} \(.*\) do(es)? not fit input_ids \({B}, {S}\)"):
        model(input_ids=ids, labels=ids if labels else None, use_cache=False, **{name: value})


@pytest.mark.parametrize(
    "extra",
    [
        {"position_ids": torch.arange(S)[None]},
        {"position_ids": torch.arange(S)[None].expand(B, S)},
        {"cache_position": torch.arange(S)},
        {"attention_mask": torch.ones(B, S, dtype=torch.long)},
    ],
    ids=["positions_1xS", "positions_BxS", "cache_position", "mask"],
)
def test_fitting_shapes_equal_sdpa(models, extra: dict) -> None:
    ref, model = models
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids, use_cache=False, **extra).loss
        got = model(input_ids=ids, labels=ids, use_cache=False, **extra).loss
    assert abs(got - want) <= 1e-5 * abs(want)


def test_generate_passes_the_checks(models) -> None:
    ref, model = models
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: generate's positions, cache positions and growing mask all fit
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_output_attentions_as_sdpa(models, caplog) -> None:
    ref, model = models
    ids = _ids()
    logging.Logger.warning_once.cache_clear()  # transformers' once-only notices, so this test sees its own
    with caplog.at_level(logging.WARNING):
        want = ref(input_ids=ids, output_attentions=True, use_cache=False)
        got = model(input_ids=ids, output_attentions=True, use_cache=False)
        model(input_ids=ids, labels=ids, output_attentions=True, use_cache=False)
    assert caplog.text.count(OUTPUT_ATTENTIONS_NOTICE) == 1  # once, as sdpa's
    assert got.attentions == want.attentions == ()
    assert torch.allclose(got.logits, want.logits, atol=1e-5)


def test_output_attentions_notice_without_apply(caplog) -> None:
    model = tiny_model("tiny-llama", "fpdt", dtype=None)
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        out = model(input_ids=_ids(), output_attentions=True, use_cache=False)
    assert OUTPUT_ATTENTIONS_NOTICE in caplog.text
    assert out.attentions == ()
