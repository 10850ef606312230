"""The chunked q/k/v projection (ProjectedSource) equals HF's attention module (fp32, CPU).

One attention module of tiny Llama (GQA, head_dim chosen so q/k/v widths differ from the hidden size)
and of tiny GPT-NeoX (fused per-head interleaved ``query_key_value``, partial rotary, biases), patched
by ``patch_attention`` exactly as ``hf_fpdt.apply`` does, against the same module on ``sdpa``; also
with PEFT LoRA adapters on q/k/v/o, with LoRA dropout (recompute must replay it), and with a frozen
base whose input needs no gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.data.chunks import local_chunk_sizes
from hf_fpdt.integrations.patches import patch_attention
from hf_fpdt.models import parts
from hf_fpdt.models.presets import preset_config
from hf_fpdt.models.registry import FAMILIES

RTOL = 1e-5
SEQ, BATCH, CHUNK = 43, 2, 16  # 3 chunks, the last one short


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _case(family: str):
    """(HF module on sdpa, rotary tables, registry family) for one attention layer."""
    torch.manual_seed(0)
    if family == "llama":
        cfg = preset_config("tiny-llama", head_dim=24)  # q: 4 x 24 = 96 wide, k/v: 2 x 24 = 48, hidden 64
        cfg._attn_implementation = "sdpa"
        module, rope, spec = LlamaAttention(cfg, 0), LlamaRotaryEmbedding(cfg), FAMILIES["llama"]
    else:
        cfg = preset_config("tiny-neox", attention_bias=True)
        cfg._attn_implementation = "sdpa"
        module, rope, spec = GPTNeoXAttention(cfg, 0), GPTNeoXRotaryEmbedding(cfg), FAMILIES["gpt_neox"]
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return module, (cos, sin), spec


def _patched(module: nn.Module, spec, chunk: int = CHUNK) -> nn.Module:
    patched = copy.deepcopy(module)
    patch_attention(patched, spec, FPDTRuntime(FPDTConfig(chunk_size=chunk)))
    return patched


def _run(module: nn.Module, hidden: torch.Tensor, emb, dout: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out, _ = module(hidden, position_embeddings=emb, attention_mask=None)
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    wrt = ([hidden] if hidden.requires_grad else []) + list(trained.values())
    grads = torch.autograd.grad(out, wrt, dout)
    names = (["hidden"] if hidden.requires_grad else []) + list(trained)
    return out, dict(zip(names, grads))


def _compare(ref: tuple, got: tuple) -> None:
    assert _rel(got[0], ref[0]) < RTOL
    assert ref[1].keys() == got[1].keys() and ref[1]
    for name, g in ref[1].items():
        assert _rel(got[1][name], g) < RTOL, f"{name}: {_rel(got[1][name], g)}"


@pytest.mark.parametrize("family", ["llama", "neox"])
@pytest.mark.parametrize("chunk", [CHUNK, 1000])
def test_projected_attention_equals_hf(family, chunk):
    module, emb, spec = _case(family)
    hidden = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    dout = torch.randn(BATCH, SEQ, 64)
    _compare(_run(module, hidden, emb, dout), _run(_patched(module, spec, chunk), hidden, emb, dout))


def _lora(module: nn.Module, family: str, dropout: float = 0.0) -> nn.Module:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if family == "llama" else ["query_key_value", "dense"]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, init_lora_weights=False)
    module = inject_adapter_in_model(cfg, copy.deepcopy(module))
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
    return module


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_projected_attention_with_lora_adapters(family):
    module, emb, spec = _case(family)
    module = _lora(module, family)
    hidden = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    dout = torch.randn(BATCH, SEQ, 64)
    ref, got = _run(module, hidden, emb, dout), _run(_patched(module, spec), hidden, emb, dout)
    assert any("lora_A" in n for n in got[1]) and not any("base_layer" in n for n in got[1])
    _compare(ref, got)
    # a frozen base model's first layer: the input needs no gradient, only the adapters do
    frozen = hidden.detach()
    _compare(_run(module, frozen, emb, dout), _run(_patched(module, spec), frozen, emb, dout))


def test_projected_attention_replays_lora_dropout():
    """With LoRA dropout the chunked forward draws per chunk; backward must rebuild the same masks.

    Reference: the same per-chunk projection (same RNG order) with plain autograd, then HF's sdpa path.
    """
    module, emb, spec = _case("llama")
    module = _lora(module, "llama", dropout=0.3).train()
    hidden = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    dout = torch.randn(BATCH, SEQ, 64)
    patched = _patched(module, spec)

    torch.manual_seed(7)
    sizes = local_chunk_sizes(SEQ, CHUNK)
    qkv, a = [], 0
    for size in sizes:
        s = slice(a, a + size)
        qkv.append(parts.project(spec, module, hidden[:, s], emb[0][:, s], emb[1][:, s]))
        a += size
    q, k, v = (torch.cat(t, dim=1).transpose(1, 2) for t in zip(*qkv))
    att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_out = module.o_proj(att.transpose(1, 2).reshape(BATCH, SEQ, -1))
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    ref = (ref_out, dict(zip(["hidden", *trained], torch.autograd.grad(ref_out, [hidden, *trained.values()], dout))))

    torch.manual_seed(7)
    out, _ = patched(hidden, position_embeddings=emb, attention_mask=None)
    ptrained = {n: p for n, p in patched.named_parameters() if p.requires_grad}
    torch.manual_seed(12345)  # backward must not depend on the RNG state it finds
    got = (out, dict(zip(["hidden", *ptrained], torch.autograd.grad(out, [hidden, *ptrained.values()], dout))))
    _compare(ref, got)
    # the o_proj adapter's dropout runs once, outside the chunk loop: consumed after all chunks in both


def test_projection_parameters_get_grads_through_autograd_once():
    """Parameters are Function inputs: autograd's accumulation (and DDP's hooks on it) sees one grad each."""
    module, emb, spec = _case("llama")
    patched = _patched(module, spec)
    calls = {n: 0 for n, _ in patched.named_parameters()}
    for n, p in patched.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls[n] + 1))
    out, _ = patched(torch.randn(BATCH, SEQ, 64), position_embeddings=emb, attention_mask=None)
    out.sum().backward()
    assert all(c == 1 for c in calls.values()), calls


def test_patched_attention_hands_masks_to_hf_and_rejects_dropout():
    module, emb, spec = _case("llama")
    patched = _patched(module, spec)
    hidden = torch.randn(BATCH, SEQ, 64)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(BATCH, 1, SEQ, SEQ)
    with torch.no_grad():  # a mask (generation, left padding): the module's own forward, which then calls
        got, _ = patched(hidden, position_embeddings=emb, attention_mask=mask)  # its attention function
        want, _ = module(hidden, position_embeddings=emb, attention_mask=mask)
    assert torch.equal(got, want)
    patched.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout"):
        patched.train()(hidden, position_embeddings=emb, attention_mask=None)
