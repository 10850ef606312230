"""Block-sparse attention patterns in the chunk pipeline (FPDT paper §5.6; hf_fpdt.attention.sparse_patterns).

* Each ready-made pattern's ``block_kind`` agrees with its ``mask_mod`` (never "full" or "none" where the
  mask says otherwise; exact on blocks below the diagonal).
* The attention alone, with offload through a store that copies (as the CUDA store does), equals a
  float64 reference with the same boolean mask, forward and backward, at a length no chunk divides; the
  kernel calls are exactly the kept blocks (partial ones on the masked path), and the fetches only theirs.
* Whole models: a tiny Llama ``apply``-ed with a different pattern per layer equals HF running sdpa with
  an explicit mask built from the same ``mask_mod`` (loss and every gradient, checkpointing on), in one
  process and at SP 2 and SP 4 (gloo).
* Refusals: masks that see later keys or not themselves, patterns that depend on the row or head,
  generate() with a pattern, bad settings.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_distributed
from standins import reference_attention
from test_offload import SnapshotStore
from testkit import tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import sparse_patterns as sp
from hf_fpdt.attention.block_mask import BlockMask, MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.routes import Router
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch

PATTERNS = {
    "local_global": sp.local_global(window=20, global_tokens=5),
    "strided": sp.strided(stride=24, window=8),
    "chunked": sp.chunked(40),
    "block_random": sp.block_random(0.4, block=16, seed=3),
    "mask_mod": sp.SparsePattern(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 5 != 2), name="mask_mod"),
}
REF = "fpdt_test_sparse_ref"  # the reference attention registered with transformers by these tests


def dense_mask(pattern: sp.SparsePattern, s: int) -> torch.Tensor:
    t = torch.arange(s)
    return pattern.mask_mod(torch.tensor(0), torch.tensor(0), t[:, None], t[None, :])


@pytest.mark.parametrize("name", [n for n in PATTERNS if PATTERNS[n].block_kind is not None])
def test_block_kind_agrees_with_mask_mod(name):
    pattern, s = PATTERNS[name], 200
    mask = dense_mask(pattern, s)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        qs, qe = sorted(torch.randint(0, s + 1, (2,), generator=g).tolist())
        ks, ke = sorted(torch.randint(0, s + 1, (2,), generator=g).tolist())
        if qe == qs or ke == ks or ks > qe - 1:
            continue
        t, u = torch.arange(qs, qe)[:, None], torch.arange(ks, ke)[None, :]
        causal = u <= t
        kept = mask[qs:qe, ks:ke][causal]
        kind = pattern.block_kind(qs, qe, ks, ke)
        if kind == "full":
            assert bool(kept.all()), (qs, qe, ks, ke)
        elif kind == "none":
            assert not bool(kept.any()), (qs, qe, ks, ke)
        if ke <= qs:  # below the diagonal: exact
            truth = "full" if bool(kept.all()) else "none" if not bool(kept.any()) else "partial"
            assert kind == truth, (qs, qe, ks, ke)


class _Calls:
    """Counts the block kernel calls of the pipeline, and those on the masked path."""

    def __init__(self, monkeypatch):
        self.fwd = self.bwd = self.fwd_masked = self.bwd_masked = 0
        fwd, bwd = Router.forward, Router.backward  # every block of the pipeline goes through its router

        def counted_forward(router, *args, mask=None, **kwargs):
            self.fwd += 1
            self.fwd_masked += mask is not None
            return fwd(router, *args, mask=mask, **kwargs)

        def counted_backward(router, *args, mask=None, **kwargs):
            self.bwd += 1
            self.bwd_masked += mask is not None
            return bwd(router, *args, mask=mask, **kwargs)

        monkeypatch.setattr(Router, "forward", counted_forward)
        monkeypatch.setattr(Router, "backward", counted_backward)


class _CountingStore(SnapshotStore):
    """Copies on fetch (the CUDA store's asynchrony on CPU) and counts fetches and their bytes."""

    def __init__(self, device):
        super().__init__(device)
        self.fetches = self.fetched_bytes = 0

    def fetch(self, slot):
        self.fetches += 1
        if slot.host is not None:
            self.fetched_bytes += slot.host.numel() * slot.host.element_size()
        return super().fetch(slot)


def _run_attention(pattern, monkeypatch, seq=150, chunk=16):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, seq, n, 16, generator=g, requires_grad=True) for n in (4, 2, 2))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    store = runtime._stores["cpu"] = _CountingStore(torch.device("cpu"))
    calls = _Calls(monkeypatch)
    out = fpdt_attention(q, k, v, runtime, 0.25, MaskSpec(sparse=pattern))
    forward_fetches = store.fetches
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return (q, k, v), out, grads, dout, calls, store, forward_fetches


@pytest.mark.parametrize("name", list(PATTERNS))
def test_attention_equals_masked_reference_and_computes_kept_blocks_only(name, monkeypatch):
    pattern, seq, chunk = PATTERNS[name], 150, 16  # 10 chunks, the last one 6 tokens
    (q, k, v), out, grads, dout, calls, store, forward_fetches = _run_attention(pattern, monkeypatch, seq, chunk)
    mask = dense_mask(pattern, seq)
    ref = reference_attention(q, k, v, 0.25, causal=False, keep=mask)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip((out, *grads), (ref, *want)):
        assert (a.double() - b).abs().max() / b.abs().max() < 1e-5
    blocks = BlockMask(tuple([chunk] * 9 + [6]), sparse=pattern)
    n = 10
    kept = sum(len(blocks.keys(i)) for i in range(n))
    partial = sum(blocks.keep(i, j, torch.device("cpu")) is not None for i in range(n) for j in blocks.keys(i))
    assert calls.fwd == calls.bwd == kept  # one kernel call per kept block, each way
    assert calls.fwd_masked == calls.bwd_masked == partial  # only cut blocks take the masked path
    # blocks that hold no kept pair of the dense mask are never computed
    for i in range(n):
        for j in range(i + 1):
            has_pair = bool(mask[i * chunk : (i + 1) * chunk, j * chunk : (j + 1) * chunk].any())
            assert (j in blocks.keys(i)) == has_pair, (i, j)
    assert forward_fetches == 2 * (kept - n)  # k, v of every kept block off the diagonal, nothing else
    assert store.fetches <= forward_fetches + 2 * n + 5 * kept  # backward: k, v per row; q, o, lse, dO, dq


def test_fetches_and_bytes_fall_with_density(monkeypatch):
    rows = []
    for density in (1.0, 0.5, 0.25):
        pattern = sp.block_random(density, block=16, seed=0)  # block = chunk: whole chunk blocks drop
        *_, calls, store, forward_fetches = _run_attention(pattern, monkeypatch, seq=320, chunk=16)
        rows.append((calls.fwd, forward_fetches, store.fetched_bytes))
    (k1, f1, b1), (k2, f2, b2), (k3, f3, b3) = rows
    n = 20
    assert k1 == n * (n + 1) // 2  # density 1: every causal block
    assert k1 > k2 > k3 > n
    assert f1 > f2 > f3
    assert b1 > b2 > b3
    # forward fetches are exactly the kept off-diagonal blocks' k, v
    assert (f1, f2, f3) == (2 * (k1 - n), 2 * (k2 - n), 2 * (k3 - n))


# --- whole models ---------------------------------------------------------------------------------------

LAYER_PATTERNS = {0: PATTERNS["local_global"], 1: PATTERNS["block_random"]}
SEQ, CHUNK = 150, 32


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The float64 reference under the dense mask of the layer's pattern (the model's causal mask replaced by it)."""
    pattern = LAYER_PATTERNS.get(module.layer_idx)
    s = query.shape[2]
    mask = dense_mask(pattern, s) if pattern is not None else torch.ones(s, s, dtype=torch.bool).tril()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return reference_attention(q, k, v, scaling, causal=False, keep=mask).to(query.dtype), None


def _register_reference() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(REF, _reference_attention)
    AttentionMaskInterface.register(REF, lambda *args, **kwargs: None)


def _model(attn: str, state: dict | None = None):

    _register_reference()
    return tiny_model("tiny-llama", attn, state=state)


def _data():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[1, -9:] = IGNORE_INDEX
    return ids, labels


def _fpdt_step(model, group=None, rank=0, sp_size=1):
    ids, labels = _data()
    model = hf_fpdt.apply(model, FPDTConfig(chunk_size=CHUNK, attention_pattern=LAYER_PATTERNS), group=group)
    model.gradient_checkpointing_enable()  # non-reentrant: the recomputation replays the stored attention
    model.train()
    if sp_size == 1:
        loss = model(input_ids=ids, labels=labels).loss
    else:
        shard = shard_batch(ids, labels, rank=rank, sp_size=sp_size, chunk_size=CHUNK)
        loss = model(**shard.model_kwargs()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _reference_step(state):
    ids, labels = _data()
    model = _model(REF, state)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert (g - ref_grads[n]).abs().max() <= 1e-5 * ref_grads[n].abs().max() + 1e-8, n


@pytest.fixture(scope="module")
def state():
    return _model("sdpa").state_dict()


def test_model_with_per_layer_patterns_equals_masked_sdpa(state):
    want = _reference_step(state)
    dense = _model("sdpa", state)
    dense_loss = dense(input_ids=_data()[0], labels=_data()[1]).loss.detach()
    assert not torch.allclose(want[0], dense_loss, rtol=1e-4)  # the patterns change the result
    _assert_same(_fpdt_step(_model("sdpa", state)), want)


def _sp_worker(rank, world_size, state):
    from hf_fpdt.distributed.groups import build_groups
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    groups = build_groups(world_size)
    model = _model("sdpa", state)
    loss, _ = _fpdt_step(model, groups.sp, groups.sp_rank, world_size)
    reduce_gradients(model.parameters(), groups.sp, groups.dp)
    return global_loss(loss, groups.sp, groups.dp), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp_size", [2, 4])
def test_sequence_parallel_patterns_equal_one_process(state, sp_size):
    want = _reference_step(state)
    results = run_distributed(_sp_worker, sp_size, state)
    for got in results:
        _assert_same(got, want)


# --- refusals --------------------------------------------------------------------------------------------


def _attend(pattern, seq=40):
    q, k, v = (torch.randn(1, seq, 2, 8) for _ in range(3))
    return fpdt_attention(q, k, v, FPDTRuntime(FPDTConfig(chunk_size=16)), spec=MaskSpec(sparse=pattern))


def test_refuses_masks_that_are_not_causal_or_skip_the_diagonal():
    prefix_lm = sp.SparsePattern(lambda b, h, q, kv: (kv <= q) | (kv < 8), name="prefix_lm")
    with pytest.raises(ValueError, match="later key.*q_idx >= kv_idx"):
        _attend(prefix_lm)
    no_self = sp.SparsePattern(lambda b, h, q, kv: kv < q, name="no_self")
    with pytest.raises(ValueError, match="attend to itself"):
        _attend(no_self)


def test_refuses_row_or_head_dependent_masks_and_bad_settings():
    with pytest.raises(ValueError, match="batch row or head"):  # checked at the call, over its heads
        _attend(sp.as_pattern(lambda b, h, q, kv: (kv <= q) & (h == 0)))
    with pytest.raises(ValueError, match="attention_pattern=3"):
        FPDTConfig(attention_pattern=3)
    with pytest.raises(ValueError, match="density in"):
        sp.block_random(1.5, block=8)


def test_generate_with_a_pattern_is_refused_with_the_reason(state):
    model = hf_fpdt.apply(_model("sdpa", state), FPDTConfig(chunk_size=CHUNK, attention_pattern=PATTERNS["chunked"]))
    model.eval()
    ids = _data()[0][:1, :20]
    with pytest.raises(ValueError, match="block-sparse attention_pattern.*KV cache"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # a full-sequence forward without a cache runs the pattern
        logits = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(logits).all()


def test_copy_of_config_keeps_patterns():
    config = FPDTConfig(chunk_size=16, attention_pattern=LAYER_PATTERNS)
    runtime = FPDTRuntime(copy.copy(config))
    assert runtime.attention_pattern(0) is LAYER_PATTERNS[0]
    assert runtime.attention_pattern(5) is None  # layers not named stay dense


def test_bench_speed_sparsity_columns_fall_with_density(capsys, tmp_path):
    import json

    from test_bench import _run_speed

    argv = ["--model", "tiny-llama", "--seq-lens", "160", "--chunk-size", "16", "--offload", "on", "--no-baseline"]
    argv += ["--sparsity", "0.5,0.2", "--steps", "1", "--warmup", "0", "--device", "cpu", "--peak-tflops", "1"]
    argv += ["--no-memory", "--json", str(tmp_path / "s.json")]
    assert _run_speed(argv) == 0
    out = capsys.readouterr().out
    assert "density" in out and "blocks" in out and "fetched" in out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["density"] for r in rows] == [None, 0.5, 0.2]
    kept = [int(r["blocks"].split("/")[0]) for r in rows]
    assert kept[0] == 55 and kept[0] > kept[1] > kept[2] >= 10  # 10 chunks: 55 causal blocks
    fetched = [r["fetched_bytes"] for r in rows]
    assert fetched[0] > fetched[1] > fetched[2] > 0


def test_pattern_combines_with_window_and_documents():
    seq, chunk, window = 150, 16, 30
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, seq, n, 16, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    docs = torch.zeros(2, seq, dtype=torch.long)
    docs[0, 70:] = 1  # row 0: two documents; row 1: one
    pattern = PATTERNS["block_random"]
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk))
    out = fpdt_attention(q, k, v, runtime, 0.25, MaskSpec(window=window, docs=docs, sparse=pattern))
    t, u = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    mask = dense_mask(pattern, seq) & (u > t - window) & (docs[:, :, None] == docs[:, None, :])  # [B, S, S]
    ref = reference_attention(q, k, v, 0.25, causal=False, keep=mask)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip((out, *got), (ref, *want)):
        assert (a - b).abs().max() < 1e-10
