"""One call's mask spec, built in one place (``hf_fpdt.integrations.mask_spec``) for the registered attention
function and ``apply``'s patched modules alike: padding masks, packed documents (none under a padding mask,
HF's rule), a window at least as long as the sequence (plain causal), the layer's sparse pattern, the softcap.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_fpdt import FPDTConfig, FPDTRuntime, MaskSpec
from hf_fpdt.attention.block_mask import BlockMask, document_ids
from hf_fpdt.attention.sparse_patterns import local_global
from hf_fpdt.integrations.mask_spec import DOCUMENT_IDS, KEY_MASK, mask_spec

PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 0, 1, 2, 3, 4, 5]])  # two rows of packed documents


def _layer(idx: int | None = 0) -> nn.Module:
    module = nn.Module()
    module.layer_idx = idx
    return module


def _sp_runtime(sp_size: int = 2) -> SimpleNamespace:
    """What the builder reads of a sequence-parallel runtime (its size, its layers' patterns), without a group."""
    return SimpleNamespace(sp_size=sp_size, attention_pattern=lambda layer_idx: None)


@pytest.fixture
def runtime() -> FPDTRuntime:
    return FPDTRuntime(FPDTConfig(chunk_size=4))


def test_restarting_position_ids_are_packed_documents(runtime):
    spec = mask_spec(runtime, _layer(), None, {"position_ids": PACKED}, 8)
    assert torch.equal(spec.docs, document_ids(PACKED))
    assert spec.docs.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert not spec.causal_only and not spec.padded
    plain = mask_spec(runtime, _layer(), None, {"position_ids": torch.arange(8).expand(2, 8)}, 8)
    assert plain.docs is None and plain.causal_only


def test_flattening_collators_boundaries_are_documents_without_position_ids(runtime):
    spec = mask_spec(runtime, _layer(), None, {"cu_seq_lens_q": torch.tensor([0, 3, 8])}, 8)
    assert spec.docs.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("form", ["2d", "4d"])
def test_no_packed_documents_under_a_padding_mask(runtime, form):
    keys = torch.ones(2, 8, dtype=torch.long)
    keys[0, :2] = 0  # left padding: generate's position ids repeat 0 over it, no packing
    mask = keys if form == "2d" else torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    kwargs = {"position_ids": PACKED, "cu_seq_lens_q": torch.tensor([0, 3, 8])}
    spec = mask_spec(runtime, _layer(), mask, kwargs, 8)
    assert spec.docs is None and spec.padded
    if form == "2d":
        assert spec.key_mask.dtype == torch.bool and torch.equal(spec.key_mask, keys.bool())
        assert spec.dense_mask is None
    else:
        assert spec.dense_mask is mask and spec.key_mask is None


def test_a_mask_of_other_dimensions_is_refused(runtime):
    with pytest.raises(ValueError, match="2D padding mask or a 4D mask; got 3"):
        mask_spec(runtime, _layer(), torch.ones(2, 8, 8), {}, 8)


@pytest.mark.parametrize(("window", "kept"), [(3, 3), (7, 7), (8, None), (100, None), (None, None)])
def test_a_window_at_least_as_long_as_the_sequence_is_plain_causal(runtime, window, kept):
    spec = mask_spec(runtime, _layer(), None, {}, 8, window=window)
    assert spec.window == kept
    assert spec.causal_only == (kept is None)


def test_the_window_rule_counts_the_whole_sequence_under_sp():
    # a rank holds 8 of 16 tokens: a window of 12 cuts the sequence, one of 16 does not
    assert mask_spec(_sp_runtime(2), _layer(), None, {}, 8, window=12).window == 12
    assert mask_spec(_sp_runtime(2), _layer(), None, {}, 8, window=16).window is None


def test_softcap_and_the_layers_sparse_pattern_are_carried():
    pattern = local_global(window=4, global_tokens=2)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=4, attention_pattern={1: pattern}))
    spec = mask_spec(runtime, _layer(1), None, {}, 8, softcap=30.0)
    assert spec.sparse is pattern and spec.softcap == 30.0 and not spec.causal_only
    dense = mask_spec(runtime, _layer(0), None, {}, 8)
    assert dense.sparse is None and dense.softcap is None and dense.causal_only


def test_under_sp_documents_and_key_mask_come_from_the_groups_keywords():
    docs = document_ids(PACKED)
    runtime = _sp_runtime(2)
    # a rank's own position ids are pieces of the global order: not read, the input check's ids are
    assert mask_spec(runtime, _layer(), None, {"position_ids": PACKED[:, :4]}, 4).docs is None
    spec = mask_spec(runtime, _layer(), None, {"position_ids": PACKED[:, :4], DOCUMENT_IDS: docs}, 4)
    assert spec.docs is docs
    keys = torch.ones(2, 8, dtype=torch.bool)
    keys[1, 0] = False
    padded = mask_spec(runtime, _layer(), keys[:, :4], {KEY_MASK: keys, DOCUMENT_IDS: docs}, 4)
    assert padded.key_mask is keys and padded.docs is None  # HF's rule holds under SP too


def test_under_sp_a_mask_without_the_groups_mask_is_refused():
    runtime = _sp_runtime(2)
    with pytest.raises(ValueError, match="not a 4D mask"):
        mask_spec(runtime, _layer(), torch.ones(2, 1, 4, 4, dtype=torch.bool), {}, 4)
    with pytest.raises(ValueError, match="without the group's global mask"):
        mask_spec(runtime, _layer(), torch.ones(2, 4, dtype=torch.bool), {}, 4)


def test_the_spec_makes_the_calls_block_pattern():
    docs = document_ids(PACKED)
    keys = torch.ones(2, 8, dtype=torch.bool)
    keys[:, :4] = False  # the first chunk is padding in every row
    spec = MaskSpec(window=3, docs=docs, key_mask=keys)
    blocks = spec.blocks((4, 4))
    reference = BlockMask((4, 4), 3, docs, None, keys, None)
    assert [blocks.keys(i) for i in range(2)] == [reference.keys(i) for i in range(2)] == [[], [1]]
    assert torch.equal(blocks.keep(1, 1, torch.device("cpu")), reference.keep(1, 1, torch.device("cpu")))
    assert MaskSpec().causal_only and not MaskSpec().padded
