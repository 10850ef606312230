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
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    t = torch.arange(q.shape[1]).unsqueeze(1)
    u = torch.arange(k.shape[1]).unsqueeze(0)
    keep = (u <= t) & ((u > t - window) if window is not None else True)
    return (s.masked_fill(~keep, float("-inf")).softmax(-1) @ vh).transpose(1, 2)


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
