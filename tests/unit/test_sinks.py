"""Attention sinks (HF's ``s_aux``: one learned logit per query head in every row's softmax denominator, no value).

* The chunk pipeline (:func:`hf_fpdt.attention.chunked.fpdt_attention`): output and the gradients of q, k, v and the
  sinks equal a float64 reference (eager's rule: the sink as one more score column, softmaxed, dropped), plain
  causal, windowed (window longer and shorter than a chunk), GQA, with a key padding mask whose padding rows see no
  key (out 0, as eager's sink column takes every row's whole mass), softcapped.
* The cached attention (generate): prefill in query chunks and decode steps, a window and left padding, equal to the
  reference.
* Models: gpt-oss and Granite SWA (``attn_implementation="fpdt"``) equal eager in a training step, sinks' gradients
  included; gpt-oss under ``apply`` with activation checkpointing (the recomputation replays the stored
  sink-inclusive output); greedy generation of gpt-oss (alternating windows shorter than the prompt, left padding)
  equals eager's tokens, attention-only and under ``apply``; a ``torch.compile(fullgraph=True)`` inference forward
  (the traced cached attention) equals eager's logits. The ``apply`` training step of gpt-oss itself is
  ``test_families.py``'s (chunked for real); two SP processes: ``tests/integration/test_sinks_sp.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import CONFIG, assert_same, family_batch, family_config, family_model, train_step
from testkit import rel_err, tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.cached_attention import cached_attention
from hf_fpdt.attention.chunked import fpdt_attention

TOL = 1e-5


def sink_reference(q, k, v, sinks, scale, window=None, keys=None, softcap=None, offset=0):
    """float64 eager attention with sinks: query t (at cache index ``offset + t``) sees key u iff
    ``u <= offset + t`` (and ``offset + t - W < u``, and ``keys[b, u]``); the sink is one more score column."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    t = torch.arange(q.shape[1]).unsqueeze(1) + offset
    u = torch.arange(k.shape[1]).unsqueeze(0)
    keep = (u <= t) & ((u > t - window) if window is not None else True)
    keep = keep[None, None] & (keys[:, None, None, :] if keys is not None else True)
    s = s.masked_fill(~keep, float("-inf"))
    col = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.cat([s, col], -1).softmax(-1)[..., :-1]
    return (p @ vh).transpose(1, 2)


def _qkv(b=2, s=45, h=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (h, hkv, hkv))
    sinks = torch.randn(h, generator=g) * 2
    return q, k, v, sinks


CASES = {  # name: (chunk, window, left padding of row 1, softcap)
    "causal": (16, None, 0, None),
    "window-longer-than-chunk": (8, 20, 0, None),
    "window-shorter-than-chunk": (16, 5, 0, None),
    "padding": (8, None, 19, None),  # row 1: two whole chunks of padding and more (its padding rows see no key)
    "window-padding": (8, 12, 11, None),
    "softcap": (16, 20, 0, 3.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_pipeline_with_sinks_equals_reference(name):
    chunk, window, pad, softcap = CASES[name]
    q, k, v, sinks = _qkv()
    keys = None
    if pad:
        keys = torch.ones(q.shape[:2], dtype=torch.bool)
        keys[1, :pad] = False
    tensors = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    spec = MaskSpec(window=window, softcap=softcap, key_mask=keys)
    out = fpdt_attention(*tensors[:3], FPDTRuntime(FPDTConfig(chunk_size=chunk)), 0.3, spec, tensors[3])
    ref_in = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want = sink_reference(*ref_in, 0.3, window, keys, softcap)
    assert rel_err(out, want) < TOL
    if pad:
        assert out[1, :pad].abs().max() == 0  # rows that see no key: the sink takes their whole mass
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    want.backward(dout.double())
    for name_, got, ref in zip("qkvs", tensors, ref_in):
        assert rel_err(got.grad, ref.grad) < TOL, (name_, rel_err(got.grad, ref.grad))
    assert tensors[3].grad.abs().min() > 0  # every head's sink shapes the rows


def test_sinks_of_the_wrong_shape_are_refused():
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match=r"one logit per query head, \[4\]"):
        fpdt_attention(q, k, v, FPDTRuntime(FPDTConfig(chunk_size=16)), None, None, sinks[:2])


@pytest.mark.parametrize("window", [None, 9])
def test_cached_attention_with_sinks_equals_reference(window):
    """A prefill over query chunks and then decode steps (one query against the cache), left padding."""
    q, k, v, sinks = _qkv(s=37)
    keys = torch.ones(q.shape[:2], dtype=torch.bool)
    keys[1, :13] = False
    out = cached_attention(q, k, v, 0.3, 8, keys, window=window, sinks=sinks)
    assert rel_err(out, sink_reference(q, k, v, sinks, 0.3, window, keys)) < TOL
    for t in (30, 36):  # decode: the query at cache index t against keys 0..t
        qt, kt, vt, keys_t = q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], keys[:, : t + 1]
        got = cached_attention(qt, kt, vt, 0.3, 8, keys_t, window=window, sinks=sinks)
        want = sink_reference(qt, kt, vt, sinks, 0.3, window, keys_t, offset=t)
        assert rel_err(got, want) < TOL


# ----------------------------------------------------------------------------------------------------------- models

SINK_FAMILIES = {  # model_type: config beyond families.COMMON (windows shorter than the 45 tokens, chunk 16)
    "gpt_oss": {},  # families.FAMILIES: alternating windows of 20, YaRN, MoE
    "granite_swa": {"sliding_window": 20, "layer_types": ["sliding_attention", "full_attention"]},
}


def _sink_family(model_type: str, attn: str, state=None):
    cfg = family_config(model_type, **SINK_FAMILIES[model_type])
    if attn == "eager":
        return family_model(cfg)  # sinks drawn N(0, 1)
    return tiny_model(cfg, attn, state=state).train()


@pytest.mark.parametrize("model_type", list(SINK_FAMILIES))
def test_attention_only_step_with_sinks_equals_eager(model_type):
    ref = _sink_family(model_type, "eager")
    model = hf_fpdt.configure(_sink_family(model_type, "fpdt", ref.state_dict()), CONFIG)
    batch = family_batch()
    want, got = train_step(ref, batch), train_step(model, batch)
    assert_same(want, got)
    sinks = [n for n in want[1] if n.endswith(".sinks")]
    assert len(sinks) == ref.config.num_hidden_layers and all(want[1][n].abs().max() > 0 for n in sinks)


def test_apply_step_with_checkpointing_equals_eager():
    """gpt-oss under ``apply`` with HF's gradient checkpointing: the recomputation rebuilds each layer's attention
    output from the sink-inclusive chunks its first forward stored; loss and every gradient equal eager's."""
    ref = family_model(family_config("gpt_oss"))
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    model.gradient_checkpointing_enable()
    batch = family_batch()
    assert_same(train_step(ref, batch), train_step(model, batch))


def _prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 112, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("path", ["attention-only", "apply"])
def test_generation_with_sinks_equals_eager(path):
    """Greedy tokens of gpt-oss (sliding layers of window 20 < the 30-token prompt + 12 new tokens, left padding):
    the prefill and every decode step fold the sinks (hf_fpdt.attention.cached_attention)."""
    ref = family_model(family_config("gpt_oss", output_router_logits=False)).eval()
    if path == "apply":
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG).eval()
    else:
        model = tiny_model(ref.config, "fpdt", state=ref.state_dict()).eval()
        hf_fpdt.configure(model, FPDTConfig(chunk_size=8))
    ids, mask = _prompts()
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    want = ref.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), want)


@pytest.mark.slow
def test_compiled_inference_with_sinks_equals_eager():
    """``torch.compile(fullgraph=True)`` of a no-grad forward (Granite SWA: sinks, a window of 20 < 30 tokens, left
    padding): the traced cached attention folds the sinks too; eager's logits."""
    ref = _sink_family("granite_swa", "eager").eval()
    model = hf_fpdt.configure(_sink_family("granite_swa", "fpdt", ref.state_dict()).eval(), CONFIG)
    ids, mask = _prompts()
    torch._dynamo.reset()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # the real tokens' logits (padding positions are nobody's prediction)
    assert rel_err(got[keep], want[keep]) < TOL
