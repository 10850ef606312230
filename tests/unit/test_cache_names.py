"""The KV cache's name (:mod:`hf_fpdt.integrations.cache_names`) on whichever transformers is installed: read
under any name, passed and returned under the installed one (``cache`` from 5.24, ``past_key_values`` before)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from testkit import tiny_model
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from hf_fpdt.integrations.cache_names import (
    CACHE_NAMES,
    OUTPUT_CACHE_FIELD,
    cache_from,
    cache_keyword,
    output_cache,
    pop_cache,
    with_cache,
)


def test_the_installed_name_is_the_forwards_and_the_outputs() -> None:
    model = tiny_model()
    assert OUTPUT_CACHE_FIELD in inspect.signature(model.forward).parameters
    assert OUTPUT_CACHE_FIELD in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    assert cache_keyword(model.forward) == cache_keyword(model.model.forward) == OUTPUT_CACHE_FIELD
    assert cache_keyword(lambda x, **kwargs: x) == OUTPUT_CACHE_FIELD  # a forward that names neither
    assert cache_keyword(lambda x, past_key_values=None: x) == "past_key_values"  # remote code on 5.24


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_a_cache_is_read_under_any_name(name: str) -> None:
    cache = DynamicCache()
    assert cache_from({name: cache, "use_cache": True}) is cache
    assert cache_from({name: None}) is None
    kwargs = {name: cache, "use_cache": True}
    assert pop_cache(kwargs) is cache and kwargs == {"use_cache": True}
    given = DynamicCache()
    assert pop_cache({name: cache}, given) is given  # the positional one wins


def test_outputs_hold_the_cache_in_their_own_field() -> None:
    cache, logits = DynamicCache(), torch.zeros(1, 2, 3)
    out = with_cache(CausalLMOutputWithPast, cache, logits=logits)
    assert output_cache(out) is cache and getattr(out, OUTPUT_CACHE_FIELD) is cache and out.logits is logits
    assert output_cache(with_cache(MoeCausalLMOutputWithPast, cache, aux_loss=None)) is cache
    assert output_cache(BaseModelOutput(last_hidden_state=logits)) is None  # no cache field
    with pytest.raises(TypeError, match="BaseModelOutput has no cache field"):
        with_cache(BaseModelOutput, cache)


def test_an_applied_models_output_carries_the_cache_it_was_given() -> None:
    import hf_fpdt

    model = hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=16)).eval()
    ids = torch.randint(5, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    for name in ("past_key_values", "cache"):  # either keyword, on either transformers
        cache = DynamicCache()
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, **{name: cache})
        assert output_cache(out) is cache and cache.get_seq_length() == 20
