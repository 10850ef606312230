"""Masks and patterns are read whole, once per call (issue 29, items 1 and 6; hf_fpdt.attention.block_mask).

* A ``mask_mod`` that lets a query see a later key is refused wherever that key is (past a chunk's first 256
  tokens, across a chunk boundary, in the last chunk), naming the first such (q, kv) pair; so is a 4D mask
  with a later key inside a diagonal block.
* A ``mask_mod`` that depends on the head past index 64, or on the batch row, is refused over the call's
  whole range of heads and rows; a random one is named impure, not head-dependent.
* A stateful ``mask_mod`` (its band flips between calls) is called exactly once per block per call: forward,
  a checkpoint's recomputation and backward share that evaluation, so output and gradients equal a float64
  reference with the mask of that evaluation.
* A ``mask_mod`` returning the wrong shape, a Python bool, a number, or failing on broadcast indices gets a
  ``ValueError`` naming the pattern and FlexAttention's contract.
"""

from __future__ import annotations

import pytest
import torch
from standins import reference_attention
from test_sparse_patterns import _Calls
from testkit import rel_err, tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import sparse_patterns as sp
from hf_fpdt.attention.block_mask import BlockMask, MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention


def _attend(mask_mod, seq: int, chunk: int, heads: int = 2, batch: int = 1, name: str = "mine", grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, seq, heads, 4, generator=g, dtype=torch.float64, requires_grad=grad) for _ in range(3)
    )
    pattern = mask_mod if isinstance(mask_mod, sp.SparsePattern) else sp.SparsePattern(mask_mod, name=name)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk))
    return (q, k, v), fpdt_attention(q, k, v, runtime, 0.5, MaskSpec(sparse=pattern))


def _causal_or(extra):
    return lambda b, h, q, kv: (kv <= q) | extra(q, kv)


LATER = {  # mask_mod, tokens, chunk, the first (q, kv) with a later key
    "past the first 256 tokens of a chunk": (_causal_or(lambda q, kv: (q >= 300) & (kv == q + 1)), 700, 512, 300, 301),
    "across a chunk boundary": (_causal_or(lambda q, kv: (q == 15) & (kv == 16)), 40, 16, 15, 16),
    "in the last chunk, far ahead": (_causal_or(lambda q, kv: (q == 3) & (kv == 39)), 40, 16, 3, 39),
    "the first of two, query-major": (
        _causal_or(lambda q, kv: ((q == 21) & (kv == 22)) | ((q == 20) & (kv == 39))),
        40,
        16,
        20,
        39,
    ),
}


@pytest.mark.parametrize("case", list(LATER))
def test_a_later_key_anywhere_is_refused_naming_the_first_pair(case):
    mask_mod, seq, chunk, q, kv = LATER[case]
    with pytest.raises(ValueError, match=rf"'mine' lets query {q} attend to the later key {kv} .*q_idx >= kv_idx"):
        _attend(mask_mod, seq, chunk, heads=1)


def test_a_4d_mask_with_a_later_key_inside_a_diagonal_block_is_refused():
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    mask[1, 0, 20, 21] = True  # inside the diagonal block of chunk 1 (tokens 16-31)
    with pytest.raises(ValueError, match="later key .*row 1, query 20 keeps key 21"):
        BlockMask((16, 16, 8), dense=mask)
    mask[0, 0, 30, 35] = True  # a later key in another chunk is refused too; the first query is named
    with pytest.raises(ValueError, match="row 1, query 20 keeps key 21"):
        BlockMask((16, 16, 8), dense=mask)


def test_a_mask_mod_that_depends_on_the_head_past_64_is_refused():
    def head_70(b, h, q, kv):  # heads 0-69 see the causal past, heads 70+ only themselves
        return (kv <= q) & ((h < 70) | (kv == q))

    with pytest.raises(ValueError, match=r"depends on the head index: mask_mod\(b=0, h=70, q_idx=1, kv_idx=0\)"):
        _attend(head_70, seq=32, chunk=16, heads=80)  # every head of the call is looked at
    pattern = sp.SparsePattern(head_70, name="head_70")
    with pytest.raises(ValueError, match="'head_70' depends on the head index.*batch row or head index"):
        BlockMask((16, 16), sparse=pattern, heads=80)
    assert BlockMask((16, 16), sparse=pattern, heads=70)._kinds[1, 0] == "full"  # heads 0-69 agree


def test_a_mask_mod_that_depends_on_the_batch_row_is_refused():
    def first_rows(b, h, q, kv):
        return (kv <= q) & ((b < 2) | (kv == q))

    with pytest.raises(ValueError, match=r"depends on the batch row: mask_mod\(b=2, h=0, q_idx=1, kv_idx=0\)"):
        _attend(first_rows, seq=32, chunk=16, batch=3)


def test_a_random_mask_mod_is_named_impure():
    def coin(b, h, q, kv):  # a random keep per (b, h, q, kv), the diagonal always kept
        shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
        return (kv <= q) & ((torch.rand(shape) < 0.5) | (kv == q))

    with pytest.raises(ValueError) as err:
        _attend(coin, seq=32, chunk=16, heads=2)
    message = str(err.value)
    assert "returns different values for the same (b, h, q_idx, kv_idx) on two evaluations" in message
    assert "must be a pure function" in message and "depends on" not in message


class Flipping:
    """A stateful mask_mod: a causal band of 7 keys, or 3 on every other call; records what each call kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, torch.Tensor]] = []

    def __call__(self, b, h, q, kv):
        band = 3 if len(self.calls) % 2 else 7
        out = (kv <= q) & (q - kv < band)
        self.calls.append((int(q[0, 0]), int(kv[0, 0]), out))
        return out

    def evaluated(self, s: int) -> torch.Tensor:
        """``[s, s]``: the mask the recorded calls returned, tile by tile."""
        mask = torch.zeros(s, s, dtype=torch.bool)
        for q0, k0, out in self.calls:
            mask[q0 : q0 + out.shape[-2], k0 : k0 + out.shape[-1]] = out
        return mask


def test_a_stateful_mask_mod_is_called_once_per_block_and_backward_reuses_it():
    seq, chunk, n = 50, 16, 4  # chunks of 16, 16, 16, 2 tokens
    flip = Flipping()
    (q, k, v), out = _attend(flip, seq, chunk, heads=2, grad=True)
    assert len(flip.calls) == n * n  # every block of the square, once (each within one tile)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert len(flip.calls) == n * n  # the backward evaluated nothing

    mask = flip.evaluated(seq)
    t = torch.arange(seq)
    for band in (3, 7):  # the state did change within the call: neither band alone is the mask
        assert not torch.equal(mask, (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < band))
    ref = reference_attention(q, k, v, 0.5, causal=False, keep=mask)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip((out, *grads), (ref, *want)):
        assert rel_err(a, b) < 1e-12


def test_a_block_kind_pattern_evaluates_its_diagonal_and_cut_blocks_once():
    seq, chunk, n = 64, 16, 4
    flip = Flipping()
    window = sp.local_global(window=7, global_tokens=0)  # the same block verdicts as a band of 7 (or 3)
    pattern = sp.SparsePattern(flip, block_kind=window.block_kind, name="flipping")
    blocks = BlockMask((chunk,) * n, sparse=pattern)
    cut = sum(blocks._kinds[i, j] == "partial" for i in range(n) for j in range(i))
    assert cut == n - 1 and len(flip.calls) == n + cut  # diagonal blocks and the cut ones, nothing above
    assert set(blocks._masks) == {(i, i) for i in range(n)} | {(i, i - 1) for i in range(1, n)}
    assert not BlockMask((chunk,) * n, sparse=window)._masks  # a pure pattern keeps nothing: evaluated where used

    flip.calls.clear()
    (q, k, v), out = _attend(pattern, seq, chunk, heads=2, grad=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(flip.calls) == n + cut
    ref = reference_attention(q, k, v, 0.5, causal=False, keep=flip.evaluated(seq))
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for a, b in zip((out, *grads), (ref, *want)):
        assert rel_err(a, b) < 1e-12


def test_a_block_kind_that_contradicts_the_diagonal_is_refused():
    liar = sp.SparsePattern(lambda b, h, q, kv: (kv <= q) & (q - kv < 4), lambda *r: "full", name="liar")
    with pytest.raises(ValueError, match=r"'liar': block_kind\(0, 16, 0, 16\) says 'full' but .*query 4's key 0"):
        BlockMask((16, 16), sparse=liar)


def _model_step(host_memory, monkeypatch) -> tuple[Flipping, int, int, torch.Tensor, torch.Tensor]:
    """One training step of a tiny Llama with a Flipping pattern: the pattern, the forward kernel calls, the
    layers, the loss and the gradients."""
    flip = Flipping()
    # a model refuses a mask_mod that changes between calls (issue 38); here the change is the instrument that shows
    # the step's reuse of one evaluation, so the purity check is switched off
    monkeypatch.setattr("hf_fpdt.attention.runtime.check_deterministic", lambda pattern: None)
    model = tiny_model("tiny-llama")
    config = FPDTConfig(chunk_size=16, attention_pattern=flip, host_memory=host_memory)
    model = hf_fpdt.apply(model, config)
    model.gradient_checkpointing_enable()
    model.train()
    calls = _Calls(monkeypatch)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return flip, calls.fwd, model.config.num_hidden_layers, loss.detach(), grads


def test_a_model_step_evaluates_each_layers_mask_mod_once(monkeypatch):
    """Checkpointing on: with replay chunks kept, the recomputation replays the output; with none
    (``host_memory=0``) it computes attention again, with the first forward's blocks. Either way each layer's
    call evaluates its mask_mod once per block, and the two give the same step."""
    n = 3  # 48 tokens, chunks of 16
    kept_run = _model_step("unlimited", monkeypatch)
    again_run = _model_step(0, monkeypatch)
    for flip, _, layers, _, _ in (kept_run, again_run):
        assert len(flip.calls) == layers * n * n
    kept = kept_run[2] * (2 * n - 1)  # per layer: 3 diagonal blocks, and the band reaches one chunk back
    assert kept_run[1] == kept and again_run[1] == 2 * kept  # host_memory=0: attention computed again
    assert torch.equal(kept_run[3], again_run[3]) and torch.equal(kept_run[4], again_run[4])


BAD = {  # mask_mod, what the message says it returned
    "a Python bool": (lambda b, h, q, kv: True, "returned bool True, not a tensor"),
    "a shape that is not [b, h, q, kv]": (
        lambda b, h, q, kv: torch.stack([kv <= q, kv <= q]),
        r"returned a tensor of shape \[2, 16, 16\] for b \[1, 1, 1, 1\], h \[1, 4, 1, 1\]",
    ),
    "a number": (lambda b, h, q, kv: q - kv, "returned a torch.int64 tensor"),
    "an error on broadcast indices": (
        lambda b, h, q, kv: (kv <= q) if h == 0 else (kv < q),
        "raised RuntimeError: Boolean value of Tensor",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_mask_mod_return_names_the_pattern_and_the_contract(case):
    mask_mod, said = BAD[case]
    with pytest.raises(ValueError, match=rf"attention pattern 'bad': mask_mod {said}.*FlexAttention's mask_mod"):
        _attend(mask_mod, seq=32, chunk=16, heads=4, name="bad")
