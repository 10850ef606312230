"""Sliding windows as a band of blocks, and the attention logit softcap, in the chunked attention.

* The band: with a window W shorter than the sequence, only the blocks that hold a (query, key) pair
  inside the window are fetched and computed, forward and backward: O(S * W / c^2), counted here
  through the kernel calls and the host store's fetches. Output and gradients equal a float64
  reference with the window mask (windows shorter than, equal to and longer than a chunk, and one
  longer than the sequence: plain causal).
* Softcap: ``cap * tanh(s / cap)`` on the scaled scores, exact (forward and backward) against the
  reference, alone and with a window; through HF's registered attention function too.
* Models: Mistral and StarCoder2 with windows shorter than the sequence, Qwen2 with per-layer windows
  (``max_window_layers``), Gemma 2 (softcap, alternating windows, final logit softcap) and Gemma 3
  (per-layer windows from ``layer_types``, q/k norms): one ``apply`` step equals eager and is chunked;
  their KV-cache generation equals eager's.
* Attention chunks (Llama 4's ``attention_chunk_size``): blocks outside a token's chunk are never computed or
  fetched; equal to a float64 reference. Families outside the registry (Llama 4 text's chunks, PhiMoE's window)
  equal eager on the attention-only path and in generation, and Llama 4 text under ``apply`` is a chunked
  training step equal to eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import (
    CONFIG,
    assert_same,
    family_batch,
    family_config,
    family_model,
    recorded_step,
    train_step,
    violations,
)
from standins import reference_attention
from testkit import rel_err, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.block_mask import BlockMask, MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.integrations.registration import fpdt_attention_forward

ATTN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def reference(q, k, v, scale, window=None, softcap=None):
    """float64 attention over the whole sequence with HF's window rule (key u seen by t iff t-W < u <= t)."""
    t, u = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    keep = None if window is None else u > t - window
    return reference_attention(q, k, v, scale, keep=keep, softcap=softcap)


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.fwd = self.bwd = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.fwd += func == ATTN_FWD
        self.bwd += func == ATTN_BWD
        return func(*args, **(kwargs or {}))


class CountingRuntime(FPDTRuntime):
    """Counts the host store's fetches (each fetched k, v, q, o, lse, dO or dq chunk)."""

    fetches = 0

    def store(self, device):
        store = super().store(device)
        runtime = self

        class Counted:
            def __getattr__(self, name):
                return getattr(store, name)

            def fetch(self, slot):
                runtime.fetches += 1
                return store.fetch(slot)

        return Counted()


def _qkv(seq, batch=2, heads=4, kv=2, dim=16):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(batch, seq, h, dim, generator=g, requires_grad=True) for h in (heads, kv, kv)]


def _check_against_reference(seq, chunk, window, softcap=None):
    q, k, v = _qkv(seq)
    rt = CountingRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    counted = Counting()
    with counted:
        out = fpdt_attention(q, k, v, rt, 0.25, MaskSpec(window=window, softcap=softcap))
    dout = torch.randn_like(out)
    with counted:
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference(q, k, v, 0.25, window, softcap)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip((out, *grads), (ref, *want)):
        assert (a.double() - b).abs().max() / b.abs().max() < 1e-5
    return counted, rt


@pytest.mark.parametrize("window", [5, 16, 23, 1000])
def test_window_band_equals_reference_and_skips_blocks(window):
    seq, chunk = 150, 16  # 10 chunks, the last one short
    counted, rt = _check_against_reference(seq, chunk, window)
    pattern = BlockMask(tuple([16] * 9 + [6]), window if window < seq else None)
    blocks = sum(len(pattern.keys(i)) for i in range(10))
    assert counted.fwd == blocks and counted.bwd == blocks  # every block of the band, no other
    if window < seq:
        # O(S * W / c^2): each query chunk meets at most ceil(W / c) + 1 key chunks
        assert blocks <= 10 * (-(-window // chunk) + 1) < 55
    else:
        assert blocks == 55  # plain causal: all 10 * 11 / 2 blocks
    # fetches: forward k, v of each off-diagonal block; backward k, v per outer step and q, o, lse, dO
    # (+ dq once started) per block: nothing of a block outside the band travels
    assert rt.fetches <= 2 * (blocks - 10) + 2 * 10 + 5 * blocks


def test_window_counts_grow_with_s_times_w_not_s_squared():
    def blocks(seq, window, chunk=16):
        n = -(-seq // chunk)
        p = BlockMask(tuple([chunk] * (n - 1) + [seq - chunk * (n - 1)]), window)
        return sum(len(p.keys(i)) for i in range(n))

    # query chunk i meets key chunks i-4..i (its first query sees 63 keys back): 5, fewer for i < 4
    assert blocks(4096, 64) == 256 * 5 - (4 + 3 + 2 + 1)
    assert blocks(8192, 64) == 2 * blocks(4096, 64) + 10  # linear in S
    assert blocks(8192, None) == 512 * 513 // 2  # quadratic without a window


@pytest.mark.parametrize(("window", "softcap"), [(None, 5.0), (23, 2.0)])
def test_softcap_equals_reference(window, softcap):
    _check_against_reference(77, 16, window, softcap)


def test_registered_attention_function_honours_window_and_softcap():
    class Module(torch.nn.Module):
        is_causal = True

    module = hf_fpdt.configure(Module(), FPDTConfig(chunk_size=8, offload=False))
    q, k, v = _qkv(40)
    out, _ = fpdt_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, scaling=0.25,
        sliding_window=11, softcap=3.0,
    )  # fmt: skip
    ref = reference(q, k, v, 0.25, 11, 3.0)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5


MODELS = {
    "mistral-w20": ("mistral", {"sliding_window": 20}),
    "mistral-w7": ("mistral", {"sliding_window": 7}),
    "starcoder2-w20": ("starcoder2", {"sliding_window": 20}),
    "qwen2-layer1": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": 12, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]}),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_windowed_and_softcapped_models_equal_eager(case):
    model_type, overrides = MODELS[case]
    ref = family_model(family_config(model_type, **overrides))
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    batch = family_batch()
    got, rec = recorded_step(model, batch)
    assert_same(train_step(ref, batch), got)
    assert violations(rec, ref.config.intermediate_size) == []


def test_generation_serves_windows_and_softcaps():
    """KV-cache generation (hf_fpdt.attention.cached_attention) runs the window band and the softcap too: the tokens
    equal eager's, for a window longer than the cache (Mistral's default 4096: plain causal), a short one, and Gemma 2's
    softcap (``test_generate.py`` has the left-padded, chunked-prefill and static-cache cases)."""
    prompt = torch.randint(3, 100, (1, 20))
    for model_type, overrides in [
        ("mistral", {}),
        ("mistral", {"sliding_window": 7}),
        ("gemma2", {"attn_logit_softcapping": 2.0}),
    ]:
        ref = family_model(family_config(model_type, **overrides)).eval()
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG).eval()
        want = ref.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), want), (model_type, overrides)


# --- attention chunks (Llama 4's attention_chunk_size), and masks of families outside the registry -------------------


def chunk_reference(q, k, v, scale, size):
    """float64 attention where query t sees key u iff u <= t and both lie in the same chunk of ``size`` tokens."""
    t, u = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    return reference_attention(q, k, v, scale, keep=u // size == t // size)


@pytest.mark.parametrize("size", [8, 20, 24])
def test_attention_chunks_equal_reference_and_skip_blocks(size):
    """A token attends within its attention chunk only: blocks outside it are neither computed nor fetched, forward
    and backward (with chunk 8 and attention chunks of 24, query chunk i meets i % 3 + 1 key chunks)."""
    seq, chunk = 96, 8
    q, k, v = _qkv(seq)
    chunks = (torch.arange(seq) // size).expand(2, seq)
    rt = CountingRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    counted = Counting()
    with counted:
        out = fpdt_attention(q, k, v, rt, 0.25, MaskSpec(chunks=chunks))
    dout = torch.randn_like(out)
    with counted:
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = chunk_reference(q, k, v, 0.25, size)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip((out, *grads), (ref, *want)):
        assert (a.double() - b).abs().max() / b.abs().max() < 1e-5
    # key chunk j is needed by query chunk i iff j <= i and j's last token shares i's first token's attention chunk
    blocks = sum(1 for i in range(12) for j in range(i + 1) if (8 * j + 7) // size >= (8 * i) // size)
    assert counted.fwd == blocks and counted.bwd == blocks < 78  # 78: every causal block
    if size == 24:
        assert blocks == sum(i % 3 + 1 for i in range(12))
    assert rt.fetches <= 2 * (blocks - 12) + 2 * 12 + 5 * blocks


TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
OUTSIDE = {  # model types the registry does not list, whose window or attention chunks HF composes into the mask
    "llama4_text": {"attention_chunk_size": 24, "intermediate_size_mlp": 128, "num_local_experts": 2},
    "phimoe": {"sliding_window": 24, "num_local_experts": 2},
}


def _outside(model_type: str, attn: str, state: dict | None = None, **changes):
    overrides = {**TINY, **OUTSIDE[model_type], **changes}
    return tiny_model(model_type, attn, state=state, vocab_size=256, intermediate_size=128, **overrides)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", list(OUTSIDE))
def test_windows_and_chunks_of_families_outside_the_registry_equal_eager(model_type):
    """The attention-only path computes what HF composed for each layer (a window, attention chunks), though the
    registry does not know the family and the layer passes no window keyword (issue 45: both were dropped)."""
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    ref = _outside(model_type, "eager").eval()
    model = hf_fpdt.configure(_outside(model_type, "fpdt", ref.state_dict()).eval(), FPDTConfig(chunk_size=16))
    want_loss, want = _loss_and_grads(ref, ids)
    loss, got = _loss_and_grads(model, ids)
    assert rel_err(loss, want_loss) < 1e-5
    assert max(rel_err(got[n], g) for n, g in want.items()) < 1e-5
    key = "attention_chunk_size" if "attention_chunk_size" in OUTSIDE[model_type] else "sliding_window"
    no_mask = _outside(model_type, "sdpa", ref.state_dict(), **{key: 1000}).eval()  # what dropping the mask computes
    dropped = no_mask(input_ids=ids, labels=ids, use_cache=False).loss
    assert rel_err(dropped, want_loss) > 1e-5  # the mask matters at this size: the check above can fail


def test_llama4_chunked_attention_under_apply_is_a_chunked_training_step():
    """Llama 4 text under ``apply`` (item 3): chunk 8 < attention chunk 24; the chunked layers compute only the
    blocks inside each token's attention chunk, the NoPE full-attention layer every causal block (its attention
    temperature is HF's code); one training step in fp32 equals eager in the loss and every gradient."""
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(2))
    overrides = {**OUTSIDE["llama4_text"], **TINY, "num_hidden_layers": 4}
    ref = tiny_model("llama4_text", "eager", vocab_size=256, intermediate_size=128, **overrides).train()
    assert ref.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    with pytest.warns(UserWarning, match="only partly supported"):
        model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=8))
    want_loss, want = _loss_and_grads(ref, ids)
    counted = Counting()
    with counted:
        loss, got = _loss_and_grads(model, ids)
    assert rel_err(loss, want_loss) < 1e-5
    assert max(rel_err(got[n], g) for n, g in want.items()) < 1e-5
    chunked = sum(i % 3 + 1 for i in range(10))  # 10 query chunks of 8; attention chunks of 3 blocks
    assert counted.fwd == 3 * chunked + 55 and counted.bwd == 3 * chunked + 55  # 55: the full layer's causal blocks


@pytest.mark.parametrize("model_type", list(OUTSIDE))
def test_generation_of_families_outside_the_registry_equals_eager(model_type):
    """With a KV cache the composed mask is HF's own 4D mask of each step (past the window, across a chunk)."""
    prompt = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    ref = _outside(model_type, "eager").eval()
    model = hf_fpdt.configure(_outside(model_type, "fpdt", ref.state_dict()).eval(), FPDTConfig(chunk_size=16))
    want = ref.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), want)
