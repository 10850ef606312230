"""sdpa's semantics at the edges (issue 29, items 2 and 6), one process, as a user hits them: a tiny Llama's HF
forward with labels on both ways in (``attn_implementation="fpdt"`` alone, configured to several chunks, and
``hf_fpdt.apply``) against the same model with ``sdpa``. Each case ends as sdpa does, or in a clear error:

* a 2D ``attention_mask`` shorter than the tokens: with the model's default ``use_cache=True`` HF makes a cache
  first and pads the mask with 0 against its length (the missing keys are masked): sdpa's loss and gradients;
  without a cache (``use_cache=False``, gradient checkpointing in training) sdpa fails, fpdt raises the same
  ``ValueError`` on both paths;
* a float 4D mask holding NaN: the loss is NaN (fpdt used to read NaN as "masked");
* restarting or reversed ``position_ids``: packed documents only without a cache and without a mask, as HF
  decides (HF's cache, made by the default ``use_cache=True``, makes the row one sequence): sdpa's gradients,
  and one notice naming ``use_cache=False`` and the flattening collator's ``cu_seq_lens_q``;
* every label ignored: loss NaN and zero gradients, as sdpa;
* labels out of the vocabulary, negative, or of a float dtype: a ``ValueError`` naming labels, the value and
  the vocabulary size (or the dtype) on ``apply``'s tiled loss; HF's own error on the attention-only path;
* ``torch.compile(fullgraph=True)`` with an ``attention_pattern``: an error naming the pattern and the fix.

Sequence parallelism (2 gloo ranks): ``tests/integration/test_sdpa_edges_sp.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from testkit import max_err, rel_err, tiny_model

import hf_fpdt
from hf_fpdt.attention.sparse_patterns import local_global
from hf_fpdt.integrations.mask_spec import CACHE_NOTICE

S, CHUNK, VOCAB = 50, 16, 512  # 4 chunks, the last one short
PATHS = ("attention", "apply")
RTOL = 1e-5


def _model(path: str, checkpointing: bool = False, **config) -> torch.nn.Module:
    """The tiny Llama on one way into fpdt (the same weights as :func:`_sdpa`)."""
    cfg = hf_fpdt.FPDTConfig(chunk_size=CHUNK, **config)
    if path == "apply":
        model = hf_fpdt.apply(tiny_model("tiny-llama", "sdpa"), cfg)
    else:
        model = hf_fpdt.configure(tiny_model("tiny-llama", "fpdt"), cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _sdpa(checkpointing: bool = False) -> torch.nn.Module:
    model = tiny_model("tiny-llama", "sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, S), generator=torch.Generator().manual_seed(3))


def _step(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict]:
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(got: tuple, want: tuple) -> None:
    """Loss and every gradient within ``RTOL`` of the reference's largest value (1e-9 absolute for gradients that
    are 0 but for rounding: q and k of one-token documents, whose attention is their own value)."""
    assert rel_err(got[0], want[0]) < RTOL, (got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        assert got[1][name] is not None, name
        assert max_err(got[1][name], g) <= max(RTOL * g.abs().max().item(), 1e-9), (name, rel_err(got[1][name], g))


# ------------------------------------------------------------------ a 2D mask shorter than the tokens


def _short_mask() -> torch.Tensor:
    mask = torch.ones(2, S - 3, dtype=torch.long)  # 47 columns for 50 tokens
    mask[1, :5] = 0  # and left padding in row 1
    return mask


@pytest.mark.parametrize("path", PATHS)
def test_short_mask_with_the_default_cache_is_padded_as_sdpa(path):
    """HF's default ``use_cache=True`` makes a cache, whose length the mask is padded to with 0 (keys 47-49 masked)."""
    ids, mask = _ids(), _short_mask()
    want = _step(_sdpa(), input_ids=ids, attention_mask=mask, labels=ids)
    got = _step(_model(path), input_ids=ids, attention_mask=mask, labels=ids)
    _assert_same(got, want)
    with torch.no_grad():  # evaluation (the inference path): sdpa's logits
        want = _sdpa().eval()(input_ids=ids, attention_mask=mask).logits
        got = _model(path).eval()(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("checkpointing", [False, True], ids=["use_cache=False", "checkpointing"])
def test_short_mask_without_a_cache_is_sdpas_error_on_both_paths(checkpointing):
    """No cache (``use_cache=False``, or gradient checkpointing in training, where HF turns it off): sdpa fails
    on the mask's size; both fpdt paths raise one ValueError naming the mask, the tokens and the fix."""
    ids, mask = _ids(), _short_mask()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    if not checkpointing:
        kwargs["use_cache"] = False
    with pytest.raises(RuntimeError, match="must match the size"):
        _sdpa(checkpointing)(**kwargs)
    messages = []
    for path in PATHS:
        with pytest.raises(ValueError, match=r"attention_mask \(2, 47\) does not fit .* no KV cache") as err:
            _model(path, checkpointing)(**kwargs)
        assert "Pass a mask of shape [2, 50]" in str(err.value)
        messages.append(str(err.value).split(":", 1)[1])  # after "does not fit <what>"
    assert messages[0] == messages[1]


# ------------------------------------------------------------------ NaN in a float 4D mask


@pytest.mark.parametrize("path", PATHS)
def test_nan_in_a_float_4d_mask_gives_a_nan_loss_as_sdpa(path):
    ids = _ids()
    above = ~torch.ones(S, S, dtype=torch.bool).tril()
    mask = torch.zeros(2, 1, S, S).masked_fill(above, torch.finfo(torch.float32).min)  # HF's causal float form
    mask[1, 0, 30, 5] = float("nan")  # one pair of one row
    want = _step(_sdpa(), input_ids=ids, attention_mask=mask, labels=ids)
    got = _step(_model(path), input_ids=ids, attention_mask=mask, labels=ids)
    assert want[0].isnan() and got[0].isnan()  # fpdt read NaN as "masked": a finite loss
    assert not torch.isfinite(got[1]["model.embed_tokens.weight"]).all()
    with torch.no_grad():  # the inference path: the query row holding NaN is NaN at the first layer's output
        out = _model(path).eval()(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    first = out.hidden_states[1]
    assert first[1, 30].isnan().all() and torch.isfinite(first[0]).all() and torch.isfinite(first[1, :30]).all()
    clean = mask.clone()
    clean[1, 0, 30, 5] = 0.0  # the same mask without the NaN: sdpa's result
    _assert_same(
        _step(_model(path), input_ids=ids, attention_mask=clean, labels=ids),
        _step(_sdpa(), input_ids=ids, attention_mask=clean, labels=ids),
    )


# ------------------------------------------------------------------ restarting or reversed position_ids


def _restarting() -> torch.Tensor:
    return torch.cat([torch.arange(20), torch.arange(S - 20)]).expand(2, S)


POSITIONS = {"restarting": _restarting, "reversed": lambda: torch.arange(S - 1, -1, -1).expand(2, S)}


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("path", PATHS)
def test_packed_positions_with_the_default_cache_are_one_sequence_as_in_hf(path, positions, caplog):
    """HF makes its cache (default ``use_cache=True``) before the mask, and then reads no packed documents: one
    sequence, logged once with the way to document masking. ``use_cache=False``: documents, as HF's."""
    ids, pos = _ids(), POSITIONS[positions]()
    logging.Logger.warning_once.cache_clear()  # transformers' once-only notices, so this test sees its own
    with caplog.at_level(logging.WARNING, logger="hf_fpdt"):
        want = _step(_sdpa(), input_ids=ids, position_ids=pos, labels=ids)
        got = _step(_model(path), input_ids=ids, position_ids=pos, labels=ids)
        _step(_model(path), input_ids=ids, position_ids=pos, labels=ids)
    _assert_same(got, want)
    assert caplog.text.count(CACHE_NOTICE) == 1
    assert "use_cache=False" in CACHE_NOTICE and "cu_seq_lens_q" in CACHE_NOTICE
    documents = _step(_sdpa(), input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    assert rel_err(documents[0], want[0]) > 1e-4  # the two readings differ: the test tells them apart
    _assert_same(_step(_model(path), input_ids=ids, position_ids=pos, labels=ids, use_cache=False), documents)


@pytest.mark.parametrize("path", PATHS)
def test_packed_positions_follow_hfs_rule_under_checkpointing_and_with_a_mask(path):
    """Gradient checkpointing in training turns HF's cache off (documents); a 2D mask, all ones too, turns
    packing off (one sequence)."""
    ids, pos = _ids(), _restarting()
    want = _step(_sdpa(checkpointing=True), input_ids=ids, position_ids=pos, labels=ids)
    _assert_same(_step(_model(path, checkpointing=True), input_ids=ids, position_ids=pos, labels=ids), want)
    ones = torch.ones(2, S, dtype=torch.long)
    kwargs = {"input_ids": ids, "position_ids": pos, "attention_mask": ones, "labels": ids, "use_cache": False}
    _assert_same(_step(_model(path), **kwargs), _step(_sdpa(), **kwargs))


@pytest.mark.parametrize("path", PATHS)
def test_cu_seq_lens_are_documents_with_a_cache(path):
    """The flattening collator's boundaries are documents whatever the cache (the notice's second way)."""
    ids, pos = _ids(1), _restarting()[:1]
    cu = torch.tensor([0, 20, S], dtype=torch.int32)
    want = _step(_sdpa(), input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 30, "max_length_k": 30}
    got = _step(_model(path), input_ids=ids, position_ids=pos, labels=ids, **extra)
    _assert_same(got, want)


# ------------------------------------------------------------------ labels


@pytest.mark.parametrize("num_items", [None, 0], ids=["mean", "num_items_in_batch=0"])
def test_all_labels_ignored_gives_nan_and_zero_gradients_as_sdpa(num_items):
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
    if num_items is not None:
        kwargs["num_items_in_batch"] = torch.tensor(num_items)
    want = _step(_sdpa(), **kwargs)
    got = _step(_model("apply"), **kwargs)
    assert want[0].isnan() and got[0].isnan()
    assert all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in want[1].values())
    assert all(got[1][n] is not None and torch.equal(got[1][n], g) for n, g in want[1].items())


BAD_LABELS = {"above the vocabulary": 600, "the vocabulary size": VOCAB, "negative": -5}


@pytest.mark.parametrize("case", list(BAD_LABELS))
def test_labels_out_of_the_vocabulary_name_labels_the_value_and_the_vocabulary(case):
    ids = _ids()
    labels = ids.clone()
    labels[1, 40] = value = BAD_LABELS[case]
    with pytest.raises(IndexError, match=f"Target {value} is out of bounds"):  # HF's loss, sdpa or fpdt attention
        _model("attention")(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match=rf"^labels hold {value}, outside the vocabulary of {VOCAB} tokens"):
        _model("apply")(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match=f"labels hold {value}"):  # shift_labels (the SP form) alike
        _model("apply")(input_ids=ids, labels=labels, shift_labels=labels)


def test_float_labels_name_the_dtype():
    ids = _ids()
    with pytest.raises(RuntimeError, match="expected target dtype"):
        _sdpa()(input_ids=ids, labels=ids.float())
    with pytest.raises(ValueError, match=r"^labels must be integer token ids \(torch.long\), got dtype torch.float32"):
        _model("apply")(input_ids=ids, labels=ids.float())


# ------------------------------------------------------------------ an attention_pattern under fullgraph compile


@pytest.mark.parametrize("path", PATHS)
def test_a_pattern_under_fullgraph_compile_is_named_with_the_fix(path):
    pattern = local_global(window=16, global_tokens=4)
    model = _model(path, attention_pattern={0: pattern}).eval()
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="attention_pattern") as err:
        torch.compile(model, fullgraph=True)(input_ids=_ids())
    message = str(err.value)
    assert pattern.name in message and "without fullgraph=True" in message and "without attention_pattern" in message


def test_a_pattern_under_compile_without_fullgraph_equals_eager():
    """The pattern layer's graph break (the fullgraph message's) lets a plain compile run it eagerly."""
    model = _model("attention", attention_pattern={0: local_global(window=16, global_tokens=4)}).eval()
    ids = _ids()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = torch.compile(model)(input_ids=ids).logits
    assert rel_err(got, want) < RTOL
