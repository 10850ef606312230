"""One call's mask spec, built in one place (``hf_fpdt.integrations.mask_spec``) for the registered attention
function and ``apply``'s patched modules alike: padding masks, packed documents (none under a padding mask,
HF's rule), a window at least as long as the sequence (plain causal), the layer's sparse pattern, the softcap;
and what HF composed for the layer (``hf_fpdt.integrations.composed_mask``): each of transformers' mask pieces
read as structure, a window or attention chunks reaching the spec, other terms a pattern, refusals by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_fpdt import FPDTConfig, FPDTRuntime, MaskSpec
from hf_fpdt.attention.block_mask import BlockMask, document_ids
from hf_fpdt.attention.sparse_patterns import local_global
from hf_fpdt.integrations.composed_mask import read
from hf_fpdt.integrations.mask_spec import DOCUMENT_IDS, KEY_MASK, mask_spec
from hf_fpdt.integrations.registration import fpdt_mask

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


# --- what HF composes for a layer (hf_fpdt.integrations.composed_mask) ---------------------------------------------


def _custom(b, h, q, kv):  # a model's own term: drops every third key behind the query (keeps the diagonal)
    return (q - kv) % 3 != 2


def test_each_piece_of_hfs_mask_functions_is_read_as_structure():
    """The installed transformers' pieces are recognised (a renamed closure would fall to evaluation, and fail
    here): causal, window, chunks with their left padding, packed documents and positions, other terms, refusals."""
    from transformers import masking_utils as mu

    assert read(mu.causal_mask_function, "m", False).plain
    window = read(mu.sliding_window_causal_mask_function(24), "m", False)
    assert window.window == 24 and window.window_only and window.rest == ()
    pad = torch.tensor([0, 3])
    chunked = read(mu.chunked_causal_mask_function(24, pad), "m", True)
    assert chunked.chunk == 24 and chunked.left_padding is pad and chunked.given and not chunked.window_only
    positions, docs = PACKED, document_ids(PACKED)
    packed = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.chunked_causal_mask_function(4, torch.zeros(2)), positions),
        mu.packed_sequence_mask_function(docs),
    )
    read_packed = read(packed, "m", False)
    assert read_packed.chunk == 4 and read_packed.positions is positions and read_packed.documents is docs
    extra = read(mu.and_masks(mu.causal_mask_function, _custom), "m", False)
    assert extra.rest == (_custom,) and extra.causal and "_custom" in extra.features
    union = mu.or_masks(mu.causal_mask_function, _custom)  # an or: evaluated whole, no causality assumed
    assert read(union, "m", False).rest == (union,) and not read(union, "m", False).causal
    bidirectional = read(mu.bidirectional_mask_function, "bert", False)
    with pytest.raises(ValueError, match="model type 'bert'.*bidirectional attention"):
        bidirectional.check()


def test_attention_chunk_ids_follow_left_padding_and_packed_positions():
    from transformers import masking_utils as mu

    chunked = read(mu.chunked_causal_mask_function(3, torch.tensor([0, 2])), "llama4_text", True)
    assert chunked.chunk_ids(2, 8, torch.device("cpu")).tolist() == [
        [0, 0, 0, 1, 1, 1, 2, 2],
        [-1, -1, 0, 0, 0, 1, 1, 1],  # HF's chunks start after the left padding
    ]
    keys = torch.tensor([[True] * 8, [False, True] + [True] * 6])  # under SP: the group's mask's left padding
    assert chunked.chunk_ids(2, 8, torch.device("cpu"), keys)[1].tolist() == [-1, 0, 0, 0, 1, 1, 1, 2]
    packed = mu.remap_positions_for_packed_sequence(mu.chunked_causal_mask_function(3, torch.zeros(2)), PACKED)
    assert read(packed, "m", False).chunk_ids(2, 8, torch.device("cpu")).tolist() == [
        [0, 0, 0, 1, 0, 0, 0, 0],  # chunks of each document's positions (documents separate them further)
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]
    assert read(mu.chunked_causal_mask_function(8, torch.zeros(1)), "m", False).chunk_ids(1, 8, "cpu") is None


def _composed_spec(runtime, mask_function, length=16, attention_mask=None, sp=False, **kwargs):
    carried = fpdt_mask(1, length, length, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    return mask_spec(_sp_runtime(2) if sp else runtime, _layer(), carried, {}, length)


def test_the_layers_composed_mask_reaches_the_spec(runtime):
    from transformers import masking_utils as mu

    config = SimpleNamespace(model_type="phimoe")
    assert fpdt_mask(1, 16, 16, mask_function=mu.causal_mask_function, config=config) is None  # causal: as before
    window = _composed_spec(runtime, mu.sliding_window_causal_mask_function(6), config=config)
    assert window.window == 6 and window.chunks is None  # HF's window, though the call passes no keyword
    chunked = _composed_spec(runtime, mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)))
    assert chunked.chunks.tolist() == [[i // 4 for i in range(16)]] and not chunked.causal_only
    assert chunked.docs is None and chunked.key_mask is None  # the marker is no padding and no given mask
    custom = _composed_spec(runtime, mu.and_masks(mu.causal_mask_function, _custom), config=config)
    assert "phimoe" in custom.sparse.name and custom.sparse.block_kind is None
    keys = torch.ones(1, 16, dtype=torch.long)
    keys[0, :2] = 0
    padded = _composed_spec(runtime, mu.chunked_causal_mask_function(4, torch.tensor([2])), attention_mask=keys)
    assert padded.key_mask.tolist() == keys.bool().tolist() and padded.chunks[0, :3].tolist() == [-1, -1, 0]


def test_a_mask_the_pipeline_cannot_compute_is_refused_by_name(runtime):
    from transformers import masking_utils as mu

    config = SimpleNamespace(model_type="bert")
    with pytest.raises(ValueError, match="model type 'bert'.*bidirectional"):
        _composed_spec(runtime, mu.bidirectional_mask_function, config=config)
    config = SimpleNamespace(model_type="m")
    with pytest.raises(ValueError, match="model type 'm' masks attention with mask function _custom.*sequence par"):
        _composed_spec(runtime, mu.and_masks(mu.causal_mask_function, _custom), sp=True, config=config)
    later = _composed_spec(runtime, mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv == q + 1))
    with pytest.raises(ValueError, match="lets query 0 attend to the later key 1"):
        later.blocks((8, 8))


def test_a_mask_against_a_cache_is_hfs_own_4d_mask():
    from transformers import masking_utils as mu

    fn = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    got = fpdt_mask(1, 1, 7, q_offset=6, kv_offset=0, mask_function=fn)  # a decode step at position 6
    assert got.shape == (1, 1, 1, 7) and got[0, 0, 0].tolist() == [False] * 4 + [True] * 3
    plain = fpdt_mask(1, 1, 7, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function)
    assert plain is None  # causal: the key padding mask path as before


def test_models_computing_attention_outside_hfs_interface_and_unknown_tensor_keywords_are_refused():
    """Either would compute something else than eager without a word: a model whose own attention code reads the
    mask fpdt returns (none for causal attention), a tensor keyword fpdt does not compute with (a score bias)."""
    from transformers import AutoConfig

    from hf_fpdt.integrations.composed_mask import outside_interface
    from hf_fpdt.integrations.registration import fpdt_attention_forward

    assert outside_interface(AutoConfig.for_model("bloom")) == "BloomModel"
    assert outside_interface(AutoConfig.for_model("trocr")) == "TrOCRForCausalLM"  # no base model: the causal LM's
    assert outside_interface(AutoConfig.for_model("llama")) is None
    with pytest.raises(ValueError, match="model type 'bloom' \\(BloomModel\\) computes attention in its own code"):
        fpdt_mask(1, 8, 8, config=AutoConfig.for_model("bloom"))

    class Module(nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"Module passes the attention the tensor keyword\(s\) \['position_bias'\]"):
        fpdt_attention_forward(Module(), q, q, q, None, position_bias=torch.zeros(1, 2, 8, 8), position_ids=None)
