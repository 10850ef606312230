"""Masked blocks on cuDNN with an additive bias over query-row slices (issue 44, item 1).

With ``cudnn`` as the backend, a masked block without a softcap that no flash-attn build takes runs on torch's
cuDNN attention op with an additive bias, a slice of query rows at a time
(:mod:`hf_fpdt.attention.cudnn_blocks`), where the runtime found the op takes ``attn_bias`` both ways and a masked
probe block matches ``math``. No GPU here: a float64 stand-in implementing the op's documented semantics (forward with
a broadcast ``[B | 1, H | 1, n, Sk]`` bias -> ``out``, ``lse [B, H, n, 1]``; backward from the supplied ``out`` /
``lse`` with the same bias; a row whose bias is all ``-inf`` gives NaN, as a kernel may) replaces
``cudnn_blocks.CUDNN_OPS``. Checked:

- every masked block kind (padding, a 4D mask, documents with padding, a window, a sparse pattern), the chunk loop's
  blocks routed to ``cudnn``, goes through the stand-in over row slices whose bias fits ``scores_bytes`` (no block's
  whole ``[Sq, Sk]`` bias), nothing on ``math``; output and gradients equal a dense float64 reference to 1e-10;
- rows with no key (left padding) give ``out = 0``, ``lse = -inf``, zero gradients;
- the runtime decides once by the masked probe (one INFO line); a torch whose op lacks ``attn_bias`` and a failing
  probe keep those blocks on ``math``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from standins import CudnnStandIn, dense_attention
from testkit import count_math, rel_err

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import cudnn_blocks, routes
from hf_fpdt.attention.block_keep import BlockKeep
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.cudnn_blocks import CudnnOps, bias_problem
from hf_fpdt.attention.merge import merge_rows
from hf_fpdt.attention.routes import block_backward, block_forward, masked_cudnn
from hf_fpdt.attention.sparse_patterns import local_global

CPU = torch.device("cpu")
REAL = cudnn_blocks.CUDNN_OPS


@pytest.fixture
def stand_in(monkeypatch) -> CudnnStandIn:
    fake = CudnnStandIn()
    monkeypatch.setattr(cudnn_blocks, "CUDNN_OPS", fake.ops)
    return fake


def _count_math(monkeypatch) -> list:
    """The tags (``"fwd"`` / ``"bwd"``) of the blocks ``math`` runs (testkit's recorder of the registry entry)."""
    calls = count_math(monkeypatch)

    class Tags(list):
        def count(self, tag):  # list.count over the recorded tags
            return sum(c[0] == tag for c in calls)

    return Tags()


def on_hopper(monkeypatch) -> None:
    """The runtime's routes resolve ``cudnn`` as the backend (as on a Hopper GPU) with no flash-attn build beside it;
    the masked probe runs for real (on the stand-in op)."""
    monkeypatch.setattr(routes, "resolve_backend", lambda *a, **k: "cudnn")
    monkeypatch.setattr(routes, "masked_backend", lambda *a, **k: None)


S, B, LENGTHS = 48, 2, (16, 16, 16)


def _case(kind: str) -> tuple[MaskSpec, torch.Tensor]:
    """A call's spec and its dense ``[B, S, S]`` keep mask by definition (rows 0-2 of batch row 0 are left padding:
    they see no key at all)."""
    t, u = torch.arange(S)[:, None], torch.arange(S)[None, :]
    causal = (u <= t).expand(B, S, S)
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[0, :3] = False
    keys[1, 40:] = False
    docs = torch.tensor([[0] * 20 + [1] * 28, [0] * 9 + [1] * 30 + [2] * 9])
    if kind == "padding":
        return MaskSpec(key_mask=keys), causal & keys[:, None, :]
    if kind == "mask4d":
        g = torch.Generator().manual_seed(5)
        dense = causal & (torch.rand(B, S, S, generator=g) > 0.3) & keys[:, None, :]
        dense = dense | (torch.eye(S, dtype=torch.bool) & keys[:, None, :])  # each real row keeps itself
        return MaskSpec(dense_mask=dense[:, None]), dense
    if kind == "documents":
        same = docs[:, :, None] == docs[:, None, :]
        return MaskSpec(docs=docs, key_mask=keys), causal & same & keys[:, None, :]
    if kind == "window":
        return MaskSpec(window=11), causal & (u > t - 11)
    pattern = local_global(7, 3)
    return MaskSpec(sparse=pattern), causal & pattern.keep(0, S, 0, S, CPU)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(B, S, 4, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, S, 2, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, dout


def _run_blocks(q, k, v, dout, spec: MaskSpec, scale, scores_bytes, cudnn_bias=True):
    """The chunk loop's blocks in one process, ``cudnn`` as the backend: forward merged per query chunk, then every
    block's backward from the final (out, lse)."""
    pattern = spec.blocks(LENGTHS, B)
    span = [slice(16 * i, 16 * i + 16) for i in range(3)]
    kw = {"scores_bytes": scores_bytes, "cudnn_bias": cudnn_bias}
    outs, lses, cut = [], [], 0
    for i in range(3):
        o = lse = None
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            cut += mask is not None
            bo, bl = block_forward(q[:, span[i]], k[:, span[j]], v[:, span[j]], causal, scale, "cudnn", mask=mask, **kw)
            o, lse = merge_rows(o, lse, bo, bl)
        outs.append(o.to(q.dtype) if o is not None else q.new_zeros(q[:, span[i]].shape))
        lses.append(lse if lse is not None else q.new_full((B, 4, 16), float("-inf")))
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for i in range(3):
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            g = block_backward(
                dout[:, span[i]], q[:, span[i]], k[:, span[j]], v[:, span[j]], outs[i], lses[i], causal, scale,
                "cudnn", mask=mask, **kw,
            )  # fmt: skip
            for acc, part, sl in zip(grads, g, (span[i], span[j], span[j])):
                acc[:, sl] += part
    return torch.cat(outs, 1), torch.cat(lses, 2), *grads, cut


KINDS = ["padding", "mask4d", "documents", "window", "sparse"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_masked_block_kind_runs_on_cudnn_over_row_slices(monkeypatch, stand_in, kind):
    """Every cut block goes to the stand-in, forward and backward, a bias slice of at most ``scores_bytes`` at a time
    (no [16, 16] bias of a block bigger than a slice); nothing runs on ``math``; out, lse, dq, dk, dv equal the dense
    float64 reference."""
    math_calls = _count_math(monkeypatch)
    spec, keep = _case(kind)
    q, k, v, dout = _inputs()
    scores_bytes = 4 * B * 16 * 8  # four rows of a float64 bias [B, 1, rows, 16]: four slices of a 16-row block
    *got, cut = _run_blocks(q, k, v, dout, spec, 0.35, scores_bytes)
    ref = dense_attention(q, k, v, keep, scale=0.35, dout=dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if name == "lse":
            assert torch.equal(torch.isneginf(a), torch.isneginf(b)), name
            a, b = a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0)
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3g}"
    assert cut > 0 and math_calls == []
    biases = [t for t in stand_in.biases if t is not None]
    assert len(biases) == 2 * cut * 4  # forward and backward, four slices per cut block
    for bias in biases:
        assert bias.untyped_storage().nbytes() <= scores_bytes and bias.shape[-2] == 4 and bias.shape[0] == B
        assert bias.shape[1] == 1 and bias.dtype == q.dtype
    assert "fwd" in stand_in.calls and "bwd" in stand_in.calls


def test_rows_with_no_key_give_zero_and_minus_inf(stand_in):
    """A block whose rows see no key (left padding on the diagonal, a window past the block) gives out 0, lse -inf
    and zero gradients for them, though the stand-in returns NaN for an all ``-inf`` bias row; the rest equal the
    dense reference."""
    q, k, v, dout = (t[:, :16] for t in _inputs())
    keys = torch.ones(B, 16, dtype=torch.bool)
    keys[0, :5] = False
    keep = BlockKeep(qs=0, ks=0, sq=16, sk=16, causal=True, window=6, keys=keys)
    whole = keep.rows(0, 16, CPU)
    out, lse = block_forward(q, k, v, False, 0.35, "cudnn", mask=keep, scores_bytes=3 * B * 16 * 8, cudnn_bias=True)
    empty = ~whole.any(-1)  # [B, 16]
    assert empty[0, :5].all() and not empty[1].any()
    assert (out[empty] == 0).all() and torch.isneginf(lse.transpose(1, 2)[empty]).all()
    grads = block_backward(dout, q, k, v, out, lse, False, 0.35, "cudnn", mask=keep, cudnn_bias=True)
    ref = dense_attention(q, k, v, whole, scale=0.35, dout=dout)
    assert rel_err(out, ref[0]) < 1e-10 and all(rel_err(a, b) < 1e-10 for a, b in zip(grads, ref[2:]))
    assert (grads[0][empty] == 0).all() and not any(torch.isnan(g).any() for g in grads)


def test_without_cudnn_bias_the_blocks_stay_on_math(monkeypatch, stand_in):
    """``cudnn_bias=False`` (no probe passed, or an op without a bias): cut blocks run on ``math``, uncut ones on
    cuDNN without a bias."""
    math_calls = _count_math(monkeypatch)
    spec, keep = _case("padding")
    q, k, v, dout = _inputs()
    *got, cut = _run_blocks(q, k, v, dout, spec, 0.35, None, cudnn_bias=False)
    assert math_calls.count("fwd") == cut and math_calls.count("bwd") == cut
    assert all(b is None for b in stand_in.biases)
    assert rel_err(got[0], dense_attention(q, k, v, keep, scale=0.35, dout=dout)[0]) < 1e-10


def test_the_runtime_decides_once_by_the_masked_probe(monkeypatch, stand_in, caplog):
    """``FPDTRuntime.masked_cudnn``: True after the masked probe passes on the stand-in (one INFO line, the probe run
    once), and ``fpdt_attention`` end to end then runs its cut blocks on cuDNN, equal to the reference."""
    math_calls = _count_math(monkeypatch)
    rt = FPDTRuntime(FPDTConfig(chunk_size=16, offload=False, backend="math"))
    on_hopper(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        assert rt.router(CPU, torch.float64, 8).cudnn_bias and rt.router(CPU, torch.float64, 8).cudnn_bias
    assert len([r for r in caplog.records if "additive bias" in r.getMessage()]) == 1
    # the probe's three slices; its float32 reference calls math_blocks directly, not a block route
    assert stand_in.calls.count("fwd") == 3 and math_calls.count("fwd") == 0
    spec, keep = _case("documents")
    q, k, v, dout = _inputs()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fpdt_attention(*inputs, rt, scale=0.35, spec=spec)
    out.backward(dout)
    ref = dense_attention(q, k, v, keep, scale=0.35, dout=dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in inputs)), ref[:1] + ref[2:]):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3g}"
    assert math_calls.count("fwd") == 0 and any(b is not None for b in stand_in.biases[3:])
    assert masked_cudnn("math", CPU, torch.float32, 8) is False  # another backend: no probe


def test_a_failing_masked_probe_keeps_math(monkeypatch, caplog):
    """A kernel that takes the bias but computes it wrong fails the probe: WARNING, masked blocks on ``math``."""
    monkeypatch.setattr(cudnn_blocks, "CUDNN_OPS", CudnnStandIn(wrong=True).ops)
    assert cudnn_blocks.probe_cudnn_bias(CPU, torch.float64, 8) is not None
    with caplog.at_level(logging.DEBUG, logger="hf_fpdt"):
        assert masked_cudnn("cudnn", CPU, torch.float64, 8) is False
    assert [r.levelno for r in caplog.records if "stay on math" in r.getMessage()] == [logging.WARNING]
    raising = CudnnStandIn(raises=RuntimeError("no bias for this layout"))
    monkeypatch.setattr(cudnn_blocks, "CUDNN_OPS", raising.ops)
    assert "raised RuntimeError" in cudnn_blocks.probe_cudnn_bias(CPU, torch.float64, 8)


def test_an_op_without_attn_bias_keeps_math(monkeypatch, caplog):
    """A torch whose cuDNN op takes no ``attn_bias`` (as before 2.5; here torch's CPU flash op's schema, which
    names its mask ``attn_mask``): named by :func:`bias_problem`, no probe block run, masked blocks on ``math``."""
    older = CudnnStandIn(attn_bias=False)
    monkeypatch.setattr(cudnn_blocks, "CUDNN_OPS", older.ops)
    assert "takes no attn_bias" in bias_problem()
    with caplog.at_level(logging.DEBUG, logger="hf_fpdt"):
        assert masked_cudnn("cudnn", CPU, torch.float64, 8) is False
    assert older.calls == [] and "takes no attn_bias" in caplog.text
    assert "no cuDNN attention backward" in bias_problem(CudnnOps(REAL.forward, None))
    rt = FPDTRuntime(FPDTConfig(chunk_size=16, offload=False, backend="math"))
    on_hopper(monkeypatch)
    assert rt.router(CPU, torch.float64, 8).cudnn_bias is False


def test_the_installed_torch_takes_attn_bias_both_ways():
    """The installed torch's ops (2.9 / 2.13 / 2.14 checked) take ``attn_bias`` in forward and backward."""
    assert bias_problem(REAL) is None
    assert masked_cudnn("flash_attn", CPU, torch.bfloat16, 64) is False  # only beside cudnn


def test_slice_heights_are_a_handful_of_powers_of_two():
    """cuDNN builds (and caches, per thread, never evicted) an execution plan per shape: the slices of every block
    length up to 5000 rows under a bound of 700 rows use at most log2(512) + 1 = 10 heights, all powers of two,
    covering each block's rows once in order."""
    heights = set()
    for sq in range(1, 5001):
        slices = cudnn_blocks.slice_rows(sq, 700)
        assert [r for r, _ in slices] == [sum(n for _, n in slices[:i]) for i in range(len(slices))]
        assert sum(n for _, n in slices) == sq
        heights |= {n for _, n in slices}
    assert heights == {1 << i for i in range(10)}
    assert cudnn_blocks.slice_rows(4096, 4096) == [(0, 4096)] and cudnn_blocks.slice_rows(3, 1) == [
        (0, 1),
        (1, 1),
        (2, 1),
    ]
