"""Packed documents: several documents in one row are attended independently, block by block.

HF's rule (sdpa/eager without a KV cache, ``DataCollatorWithFlattening``, TRL padding-free): a new
document starts wherever ``position_ids`` do not grow by 1; the flattening collator may also pass
``cu_seq_lens_q``. In the chunk loop, blocks that lie across a document boundary are skipped (never
fetched, never computed) and blocks that hold a boundary are masked.
"""

from __future__ import annotations

import copy

import torch
from families import CONFIG, assert_same, family_config, family_model, recorded_step, violations
from test_windows import Counting, CountingRuntime
from transformers import DataCollatorWithFlattening

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.attention.block_mask import BlockMask, MaskSpec, document_ids
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.integrations.registration import fpdt_attention_forward

DOCS = [37, 5, 50, 27]  # 119 tokens, 8 chunks of 16: boundaries inside chunks, a document under a chunk


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def _per_document(q, k, v, lengths, scale):
    """Causal sdpa on each document alone, in float64."""
    outs, a = [], 0
    for n in lengths:
        s = slice(a, a + n)
        qd, kd, vd = (t[:, s].double().transpose(1, 2) for t in (q, k, v))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True
            ).transpose(1, 2)
        )
        a += n
    return torch.cat(outs, dim=1)


def _qkv(seq):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(1, seq, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2)]


def test_packed_documents_equal_each_document_alone_and_skip_blocks():
    q, k, v = _qkv(sum(DOCS))
    docs = document_ids(_positions(DOCS))
    rt = CountingRuntime(FPDTConfig(chunk_size=16, offload=True))
    counted = Counting()
    with counted:
        out = fpdt_attention(q, k, v, rt, 0.25, MaskSpec(docs=docs))
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _per_document(q, k, v, DOCS, 0.25)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip((out, *grads), (ref, *want)):
        assert (a.double() - b).abs().max() / b.abs().max() < 1e-5
    pattern = BlockMask((16,) * 7 + (7,), None, docs)
    blocks = sum(len(pattern.keys(i)) for i in range(8))
    assert counted.fwd == blocks and counted.bwd == blocks
    # key chunks per query chunk: 1, 2, 3 (documents 0-2 meet in chunk 2), then 2, 3, 4 (document 2 spans
    # chunks 2-5), then 2, 3 (document 3): 20 of the 36 causal blocks
    assert blocks == 20


def test_cu_seq_lens_of_the_flattening_collator():
    """The registered function reads document boundaries from ``cu_seq_lens_q`` when no positions come."""

    class Module(torch.nn.Module):
        is_causal = True

    module = hf_fpdt.configure(Module(), FPDTConfig(chunk_size=16, offload=False))
    q, k, v = _qkv(sum(DOCS))
    cu = torch.tensor([0, 37, 42, 92, 119], dtype=torch.int32)
    out, _ = fpdt_attention_forward(
        module, *(t.transpose(1, 2) for t in (q, k, v)), None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu
    )
    ref = _per_document(q, k, v, DOCS, 0.25)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_flattening_collator_batch_through_apply_equals_eager():
    """``DataCollatorWithFlattening``'s batch (one row, restarting positions, -100 at document starts)."""
    ref = family_model(family_config("qwen2"))
    model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    g = torch.Generator().manual_seed(2)
    examples = [{"input_ids": torch.randint(3, 112, (n,), generator=g).tolist()} for n in DOCS]
    # HF reads packed documents only without a KV cache (its default use_cache=True makes one): both calls
    # pass use_cache=False, as TRL's SFTTrainer does (tests/unit/test_sdpa_edges.py: with the cache, one sequence)
    batch = {**DataCollatorWithFlattening(return_tensors="pt")(examples), "use_cache": False}
    assert batch["position_ids"].shape == (1, sum(DOCS))
    got, rec = recorded_step(model, batch)
    out = ref(**batch)
    out.loss.backward()
    want = (out.loss.detach(), {n: p.grad for n, p in ref.named_parameters()})
    assert_same(want, got)
    assert violations(rec, ref.config.intermediate_size, seq=sum(DOCS), batch=1) == []
