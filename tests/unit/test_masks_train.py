"""Masks with gradients equal sdpa: left padding, holes, fully padded rows, 4D bool and float masks (issue 20).

Tiny Llama (GQA), ``hf_fpdt.apply`` with non-reentrant checkpointing (so the recomputation replays the masked
attention), 2 rows of 48 tokens, chunk 16: the left padding covers the whole first key chunk in both rows
(the diagonal block (0, 0) is skipped) and leaves padding queries that see no key at all. Loss and every
gradient equal sdpa's at sp 1 and sp 2 (gloo processes, one launch); the logits equal sdpa's at every
position, padding included, except where a float 4D mask leaves a row with no key (sdpa averages every value
there, fpdt gives 0 as sdpa does for a bool mask; loss and gradients are the same). A right-padded
``generate`` with the default dynamic cache gives sdpa's first-token scores.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.config import IGNORE_INDEX
from hf_fpdt.data.collate import SPCollator

B, S, CHUNK = 2, 48, 16
RTOL = 1e-5


def _base() -> torch.nn.Module:
    return tiny_model("tiny-llama", "sdpa", dtype=None)


def _masks() -> dict[str, torch.Tensor]:
    left = torch.ones(B, S, dtype=torch.long)
    left[0, :18], left[1, :33] = 0, 0  # chunk 0 is padding in both rows: its diagonal block is skipped
    holes = torch.ones(B, S, dtype=torch.long)
    holes[0, 3:9], holes[1, 20:37] = 0, 0  # a hole over a whole chunk of row 1
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(4)
    bool4d = causal[None, None] & holes.bool()[:, None, None, :] & (torch.rand(B, 1, S, S, generator=g) > 0.3)
    bool4d |= torch.eye(S, dtype=torch.bool)  # every row keeps its own key
    keep = causal[None, None] & left.bool()[:, None, None, :]
    float4d = torch.zeros(B, 1, S, S).masked_fill(~keep, torch.finfo(torch.float32).min)  # HF's additive form
    return {"left": left, "holes": holes, "bool4d": bool4d, "float4d": float4d}


def _batch(name: str) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (B, S), generator=g)
    mask = _masks()[name]
    labels = ids.clone()
    if mask.dim() == 2:
        labels[mask == 0] = IGNORE_INDEX
    else:  # rows that keep no key (a float mask's padding rows: where sdpa and fpdt differ, see above)
        empty = ~(mask if mask.dtype == torch.bool else mask == 0).any(-1)[:, 0]
        labels[empty] = IGNORE_INDEX
        labels[:, 1:][empty[:, :-1]] = IGNORE_INDEX  # the token an empty row's logits predict
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _step(model, **batch) -> dict:
    model.train()
    out = model(**batch)
    out.loss.backward()
    return {"loss": out.loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _assert_same(got: dict, want: dict) -> None:
    assert _rel(got["loss"], want["loss"]) < RTOL
    for n, g in want["grads"].items():
        assert _rel(got["grads"][n], g) < RTOL, n


@pytest.mark.parametrize("name", ["left", "holes", "bool4d", "float4d"])
def test_masks_with_gradients_equal_sdpa(name):
    ref = _base()
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    model.gradient_checkpointing_enable()
    batch = _batch(name)
    _assert_same(_step(model, **batch), _step(ref, **batch))
    # logits at every position (padding included): the registered attention alone, gradients recorded
    alone = copy.deepcopy(ref)
    alone.set_attn_implementation("fpdt")
    hf_fpdt.configure(alone, hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    got, want = alone(**inputs).logits, ref(**inputs).logits
    assert torch.isfinite(got).all()
    if name == "float4d":  # rows with no key: sdpa averages every value under a float mask, fpdt gives 0
        empty = (batch["attention_mask"][:, 0] != 0).all(-1)  # [B, S]
        got, want = got[~empty], want[~empty]
        assert bool(empty.any())
    assert _rel(got, want) < RTOL


def _sp_worker(rank: int, world_size: int, names: list[str], state: dict) -> dict:
    results = {}
    for name in names:
        model = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None)
        model.load_state_dict(state)
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=dist.group.WORLD)
        model.gradient_checkpointing_enable()
        shard = SPCollator(rank, world_size, CHUNK, inner=lambda f: f[0])([_batch(name)])
        assert "attention_mask" in shard
        items = (shard["shift_labels"] != IGNORE_INDEX).sum()
        dist.all_reduce(items)
        res = _step(model, **shard, num_items_in_batch=items)
        dist.all_reduce(res["loss"])
        for g in res["grads"].values():
            dist.all_reduce(g)
        results[name] = res
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_masks_with_gradients_equal_sdpa_sp2():
    """Left padding (a skipped diagonal block, rows with no key) and holes, sharded by the SP collator and
    gathered by apply's input check: the group's loss and gradients equal one process's sdpa."""
    ref = _base()
    names = ["left", "holes"]
    got = run_distributed(_sp_worker, 2, names, ref.state_dict(), timeout=300)[0]
    for name in names:
        want = _step(copy.deepcopy(ref), **_batch(name))
        _assert_same(got[name], want)


def test_right_padded_generate_equals_sdpa():
    """The padded row's last position is padding: it attends the real tokens only, as in sdpa."""
    ref = _base().eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=CHUNK)).eval()
    batch = _batch("left")
    mask = torch.ones(B, 30, dtype=torch.long)
    mask[1, 21:] = 0  # right padding over a chunk boundary
    kwargs = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    got = model.generate(input_ids=batch["input_ids"][:, :30], attention_mask=mask, **kwargs)
    want = ref.generate(input_ids=batch["input_ids"][:, :30], attention_mask=mask, **kwargs)
    assert _rel(got.scores[0], want.scores[0]) < RTOL
    assert torch.equal(got.sequences, want.sequences)


def test_gradient_through_a_filled_cache_is_refused():
    from transformers import DynamicCache

    model = _base()
    model.set_attn_implementation("fpdt")
    ids = _batch("left")["input_ids"]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :20], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="already holds earlier tokens .* torch.no_grad"):
        model(input_ids=ids[:, 20:], past_key_values=cache, use_cache=True)


def test_key_mask_skips_padding_blocks_and_masks_only_cut_blocks(monkeypatch):
    """Left padding over whole key chunks skips those blocks (no kernel call, no fetch, each way); blocks whose
    keys are all real run unmasked; only the blocks padding cuts take the masked path; output and gradients
    equal a float64 reference with the same mask (rows with no key give 0)."""
    from standins import reference_attention
    from test_sparse_patterns import _Calls, _CountingStore

    from hf_fpdt.attention.block_mask import MaskSpec
    from hf_fpdt.attention.chunked import fpdt_attention
    from hf_fpdt.attention.runtime import FPDTRuntime
    from hf_fpdt.config import FPDTConfig

    seq, chunk = 150, 16  # 10 chunks, the last one 6 tokens
    keys = torch.ones(2, seq, dtype=torch.bool)
    keys[0, :40] = False  # chunks 0-1 all padding, chunk 2 cut
    keys[1, :35], keys[1, 70:75] = False, False  # chunks 0-1 padding in both rows; a hole cutting chunk 4
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, seq, n, 16, generator=g, requires_grad=True) for n in (4, 2, 2))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    store = runtime._stores["cpu"] = _CountingStore(torch.device("cpu"))
    calls = _Calls(monkeypatch)
    out = fpdt_attention(q, k, v, runtime, 0.25, MaskSpec(key_mask=keys))
    fetched = store.fetches
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :]
    ref = reference_attention(q, k, v, 0.25, causal=False, keep=mask)  # rows with no key: 0
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip((out, *grads), (ref, *want)):
        assert (a.double() - b).abs().max() / b.abs().max() < 1e-5

    bounds = [(s, min(s + chunk, seq)) for s in range(0, seq, chunk)]
    kept = masked = diagonals = 0
    for i in range(len(bounds)):
        for j in range(i + 1):
            allowed = keys[:, bounds[j][0] : bounds[j][1]]
            if not bool(allowed.any()):  # padding in every row: skipped
                continue
            kept, diagonals = kept + 1, diagonals + (i == j)
            masked += not bool(allowed.all())  # cut by padding (the diagonal's causal triangle is a flag)
    assert calls.fwd == calls.bwd == kept  # no call for the skipped blocks
    assert calls.fwd_masked == calls.bwd_masked == masked
    assert kept < len(bounds) * (len(bounds) + 1) // 2  # some blocks are skipped
    assert fetched == 2 * (kept - diagonals)  # k and v of the computed off-diagonal blocks
