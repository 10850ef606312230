"""Masked and softcapped blocks on the ``math`` path: exact against float64, and never O(chunk^2) in fp32.

The ``math`` kernel runs a block over query-row slices, ``scores_bytes`` of fp32 scores at a time, with GQA folded
into the rows (K/V never repeated per query head). Here: its results against an independent float64 reference
(masks of one or every batch row, documents, windows, softcap, rows that see no key, slices of one row and a
ragged last slice), the bound on the largest tensor it allocates (a dispatch recorder, block level and through
the chunked pipeline with the device's default bound), and the cut-block masks' packing (bit table per device).
"""

from __future__ import annotations

import pytest
import torch
from standins import dense_attention
from testkit import rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import block_mask
from hf_fpdt.attention.block_mask import MaskSpec, PackedMasks
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.math_blocks import math_scores_bytes
from hf_fpdt.attention.routes import block_backward, block_forward


@pytest.fixture(autouse=True)
def _one_thread():
    """Many small slices: one thread, so a busy machine's thread wake-ups do not dominate the time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _keep(kind, b, sq, sk, gen):
    """A block's mask (the kernel's form) and its ``[B | 1, 1, Sq, Sk]`` broadcast for the reference."""
    t, u = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    if kind == "causal":
        return None, (u <= t)[None, None]
    if kind == "window":  # a diagonal block cut by a window of 9
        m = (u <= t) & (u > t - 9)
        return m, m[None, None]
    if kind == "documents":  # per row: document boundaries inside the block, and one row of one document
        docs = torch.stack([torch.randint(0, 3, (max(sq, sk),), generator=gen).sort().values for _ in range(b)])
        docs[0] = 0
        m = (docs[:, :sq, None] == docs[:, None, :sk]) & (u <= t)
        return m, m[:, None]
    if kind == "padding":  # left padding of row 1: its first rows see no key (lse -inf, out 0)
        keys = torch.ones(b, sk, dtype=torch.bool)
        keys[-1, : sk // 3] = False
        m = keys[:, None, :] & (u <= t)
        return m, m[:, None]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["causal", "window", "documents", "padding"])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("scores_bytes", [1, 3000, None], ids=["row", "ragged", "default"])
def test_sliced_math_block_equals_float64(kind, softcap, scores_bytes):
    gen = torch.Generator().manual_seed(3)
    b, sq, sk, h, hkv, d = 2, 37, 37, 6, 2, 16
    q, dout = (torch.randn(b, sq, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, d, generator=gen) for _ in range(2))
    mask, keep = _keep(kind, b, sq, sk, gen)
    scale = 0.41
    out, lse = block_forward(
        q, k, v, mask is None, scale, "math", mask=mask, softcap=softcap, scores_bytes=scores_bytes
    )
    ref = dense_attention(q, k, v, keep, scale=scale, softcap=softcap, dout=dout)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))  # rows with no key: -inf, as the reference
    finite = ~torch.isneginf(ref[1])
    assert rel_err(lse[finite], ref[1][finite]) < 1e-6
    assert rel_err(out, ref[0]) < 1e-6
    # the chunk pipeline's form of the final lse for rows that see no key: +inf (exp(s - inf) = 0)
    lse_in = lse.masked_fill(torch.isneginf(lse), float("inf"))
    grads = block_backward(
        dout, q, k, v, out, lse_in, mask is None, scale, "math", mask=mask, softcap=softcap, scores_bytes=scores_bytes
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert got.shape == want.shape and rel_err(got, want) < 1e-6, name


class _Largest(TorchDispatchMode):
    """The largest tensor any op produces (bytes), and the op that produced it."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.op = t.numel() * t.element_size(), str(func)
        return out


@pytest.mark.parametrize("kind", ["causal", "window", "documents", "padding"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_math_block_working_set_is_bounded(kind, softcap):
    """At chunk 256, 4 heads: a block's fp32 scores are 1 MiB; with a 64 KiB bound no op makes more than that."""
    gen = torch.Generator().manual_seed(0)
    b, c, h, hkv, d = 1, 256, 4, 2, 8
    q, dout = (torch.randn(b, c, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, c, hkv, d, generator=gen) for _ in range(2))
    mask, _ = _keep(kind, b, c, c, gen)
    bound = 64 << 10
    assert b * h * c * c * 4 >= 16 * bound  # what one unsliced scores tensor would be
    with _Largest() as rec:
        out, lse = block_forward(q, k, v, mask is None, 0.25, "math", mask=mask, softcap=softcap, scores_bytes=bound)
        block_backward(
            dout, q, k, v, out, lse, mask is None, 0.25, "math", mask=mask, softcap=softcap, scores_bytes=bound
        )
    assert rec.bytes <= bound, (rec.bytes, rec.op)


def _spec(kind: str, s: int) -> MaskSpec:
    if kind == "window":
        return MaskSpec(window=300)
    if kind == "softcap":
        return MaskSpec(softcap=30.0)
    if kind == "documents":
        return MaskSpec(docs=(torch.arange(s) * 7 // s).unsqueeze(0))
    if kind == "padding":
        keys = torch.ones(1, s, dtype=torch.bool)
        keys[:, : s // 10] = False
        return MaskSpec(key_mask=keys)
    return MaskSpec()


@pytest.mark.parametrize("kind", ["causal", "window", "softcap", "documents", "padding"])
def test_chunked_math_path_never_forms_a_whole_block(kind):
    """The chunk pipeline with ``backend="math"`` at chunk 1024, 8 heads: a whole block's fp32 scores would be
    32 MiB; forward and backward stay within the default slice bound (16 MiB here)."""
    s, c, h, hkv, d = 2048, 1024, 8, 4, 8
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, s, h, d, generator=gen).requires_grad_()
    k, v = (torch.randn(1, s, hkv, d, generator=gen).requires_grad_() for _ in range(2))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=c, offload=False, backend="math"))
    bound = math_scores_bytes(q[:, :c])
    assert h * c * c * 4 >= 2 * bound
    with _Largest() as rec:
        out = fpdt_attention(q, k, v, runtime, spec=_spec(kind, s))
        out.backward(torch.randn(out.shape, generator=gen))
    assert rec.bytes <= bound, (rec.bytes, rec.op)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_packed_masks_round_trip_with_one_bit_table_per_device():
    gen = torch.Generator().manual_seed(0)
    masks = PackedMasks()
    blocks = {(0, 0): torch.rand(13, 13, generator=gen) > 0.5, (1, 0): torch.rand(2, 13, 7, generator=gen) > 0.3}
    for key, keep in blocks.items():
        masks.put(key, keep)
    assert set(masks) == set(blocks) and len(masks) == 2 and (1, 0) in masks and (1, 1) not in masks
    for key, keep in blocks.items():
        assert torch.equal(masks.unpack(key, tuple(keep.shape), torch.device("cpu")), keep)
    assert masks.bits(torch.device("cpu")) is masks.bits(torch.device("cpu"))  # made once per device
    assert not hasattr(block_mask, "_BIT")  # no module-level bit table


def test_slice_bound_follows_the_chunk_not_its_square():
    """The default bound is a quarter of the block's fp32 queries (within 16-256 MiB): a chunk 4x longer gets slices
    4x larger (O(chunk)), not 16x (O(chunk^2)), and the bound never depends on the keys."""
    small, large = torch.empty(1, 4096, 32, 128, device="meta"), torch.empty(1, 16384, 32, 128, device="meta")
    assert math_scores_bytes(torch.empty(1, 4096, 8, 32, device="meta")) == 1 << 24  # the floor
    assert math_scores_bytes(small) == 4096 * 32 * 128 and math_scores_bytes(large) == 4 * math_scores_bytes(small)
    assert math_scores_bytes(torch.empty(1, 65536, 32, 128, device="meta")) == 1 << 28  # the ceiling


class _Sizes(TorchDispatchMode):
    """The most elements of any tensor an op produces, and of any bool one (with the ops that produced them)."""

    def __init__(self):
        super().__init__()
        self.numel = self.bool_numel = 0
        self.op = self.bool_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
            if t.dtype == torch.bool and t.numel() > self.bool_numel:
                self.bool_numel, self.bool_op = t.numel(), str(func)
        return out


def _cut_block(kind: str, c: int, b: int) -> tuple[MaskSpec, int, int]:
    """A spec over two chunks of ``c`` tokens whose block (1, i) is cut, and that block."""
    s = 2 * c
    if kind == "window":
        return MaskSpec(window=c // 3), 1, 1
    if kind == "documents":
        docs = torch.stack([(torch.arange(s) + 17 * r) * 5 // s for r in range(b)])
        return MaskSpec(docs=docs), 1, 0
    keys = torch.ones(b, s, dtype=torch.bool)
    keys[-1, : c + c // 3] = False
    return MaskSpec(key_mask=keys), 1, 1


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
@pytest.mark.parametrize("kind", ["window", "documents", "padding"])
def test_masked_block_builds_its_mask_a_slice_at_a_time(backend, kind):
    """A cut block's mask comes as a BlockKeep: with the byte bound set small (16 rows of math's float64 scores, 32
    rows of cpu_flash's float64 additive mask), no op of forward or backward makes a tensor of more than an eighth of
    the block's whole mask ``[B, Sq, Sk]`` (numel; bool or float), and the results are the whole mask's in float64
    (math: bit for bit at the same slices; both: to 1e-12 against one slice)."""
    gen = torch.Generator().manual_seed(5)
    b, c, h, hkv, d = 2, 256, 2, 1, 8  # q, k, v, out, dq, dk, dv hold fewer than c * c / 8 elements
    q, dout = (torch.randn(b, c, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, c, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    spec, i, j = _cut_block(kind, c, b)
    blocks = spec.blocks((c, c), batch=b)
    bound = 16 * b * h * c * 8 if backend == "math" else 32 * b * c * 8  # 16 / 32 rows per slice
    limit = b * c * c // 8
    with _Sizes() as rec:
        causal, lazy = blocks.block(i, j, q.device)  # what the chunk pipeline hands the kernels
        out, lse = block_forward(q, k, v, causal, 0.3, backend, mask=lazy, scores_bytes=bound)
        lse_in = lse.masked_fill(torch.isneginf(lse), float("inf"))
        grads = block_backward(dout, q, k, v, out, lse_in, causal, 0.3, backend, mask=lazy, scores_bytes=bound)
    assert rec.numel <= limit, (rec.numel, rec.op)
    assert rec.bool_numel <= limit, (rec.bool_numel, rec.bool_op)
    with _Sizes() as whole_rec:  # the probe sees a whole mask where one is made
        whole = blocks.keep(i, j, q.device)
    assert lazy is not None and whole.shape in ((b, c, c), (c, c)) and whole_rec.bool_numel >= c * c
    ref_out, ref_lse = block_forward(q, k, v, causal, 0.3, backend, mask=whole)
    ref_grads = block_backward(dout, q, k, v, ref_out, lse_in, causal, 0.3, backend, mask=whole)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = ~torch.isneginf(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-12 and rel_err(out, ref_out) < 1e-12
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == want.dtype and got.shape == want.shape and rel_err(got, want) < 1e-12, name
    if backend == "math":  # the same slices over the whole mask: the same numbers
        same = block_forward(q, k, v, causal, 0.3, backend, mask=whole, scores_bytes=bound)
        assert torch.equal(same[0], out) and torch.equal(same[1], lse)


@pytest.mark.parametrize("kind", ["window", "documents", "padding"])
def test_chunked_masked_blocks_form_no_whole_mask(kind):
    """The chunk pipeline at chunk 2048, 8 heads, ``backend="math"``: math's default slices are 256 rows, so no bool
    tensor of forward or backward reaches an eighth of a block's ``[c, c]`` mask (before: the whole mask per block)."""
    s, c, h, hkv, d = 4096, 2048, 8, 4, 8
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, s, h, d, generator=gen).requires_grad_()
    k, v = (torch.randn(1, s, hkv, d, generator=gen).requires_grad_() for _ in range(2))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=c, offload=False, backend="math"))
    spec = _spec(kind, s) if kind != "window" else MaskSpec(window=1500)
    with _Sizes() as rec:
        out = fpdt_attention(q, k, v, runtime, spec=spec)
        out.backward(torch.randn(out.shape, generator=gen))
    assert rec.bool_numel <= c * c // 8, (rec.bool_numel, rec.bool_op)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


class _Allocated(TorchDispatchMode):
    """The most elements of any tensor an op allocates (an output sharing no storage with the op's inputs: views of
    the caller's mask are no allocation), bool or not."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _dense_verdicts(mask: torch.Tensor, lengths: tuple[int, ...]) -> dict:
    """Per block j <= i of a 4D mask, from its whole ``[B, Sq, Sk]`` block: (keeps some pair, keeps every causal
    pair), the brute-force form of ``BlockMask._scan_dense``."""
    keep = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    out = {}
    for i, (qs, nq) in enumerate(zip(starts, lengths)):
        for j, (ks, nk) in enumerate(zip(starts[: i + 1], lengths)):
            block = keep[:, qs : qs + nq, ks : ks + nk]
            ahead = torch.arange(ks, ks + nk)[None, :] > torch.arange(qs, qs + nq)[:, None]
            out[i, j] = (bool(block.any()), bool((block | ahead).all()))
    return out


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_dense_mask_scan_reads_row_slices_not_blocks(dtype):
    """A user's 4D mask is scanned a slice of query rows at a time (7 rows here, slices straddling the chunks of
    uneven lengths): every block's verdict equals the whole block's (blocks kept whole, cut, dropped, in both batch
    rows), and no op allocates a tensor of a block's ``[Sq, Sk]`` (the smallest chunk's square: before, the scan formed
    ``[B, c, c]`` temporaries per block, and ``[B, c, S]`` ones for a float mask) or beyond one slice ``[B, 7, S]``."""
    lengths, b, rows = (200, 256, 184), 2, 7
    s = sum(lengths)
    gen = torch.Generator().manual_seed(3)
    keep = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    keep[1, :, :, 200:300] = False  # row 1: keys of chunk 1 dropped in part, block (2, 1) cut, (1, 1) too
    keep[0, :, 456:, :200] = False  # row 0: block (2, 0) dropped in row 0 only
    keep[:, :, 210:220] &= torch.rand(b, 1, 10, s, generator=gen) > 0.5  # holes in a few rows of chunk 1
    keep[:, :, range(s), range(s)] = True
    keep[:, :, 456:, :200] = False  # block (2, 0) dropped in every row: not needed
    mask = keep if dtype == torch.bool else torch.zeros(b, 1, s, s).masked_fill(~keep, torch.finfo(dtype).min)
    scan_bytes = 5 * b * s * rows
    with _Allocated() as rec:
        blocks = block_mask.BlockMask(lengths, dense=mask, scan_bytes=scan_bytes)
    want = _dense_verdicts(mask, lengths)
    assert blocks._dense_flags == want
    assert not blocks.needed(2, 0) and blocks.needed(2, 1) and blocks.cut(2, 2, torch.device("cpu")) is None
    assert blocks.cut(1, 1, torch.device("cpu")) is not None and blocks.cut(1, 0, torch.device("cpu")) is not None
    assert rec.numel <= b * rows * s < min(lengths) ** 2, (rec.numel, rec.op)
    whole = block_mask.BlockMask(lengths, dense=mask, scan_bytes=1 << 30)  # one slice of every row
    assert whole._dense_flags == want


def test_dense_mask_scan_refuses_from_any_slice():
    """The refusals read every slice: a later key or an additive bias in the last rows only is refused, naming the
    first later key."""
    s, rows = 96, 5
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).tril()
    mask[0, 0, 93, 95] = True
    with pytest.raises(ValueError, match="row 0, query 93 keeps key 95"):
        block_mask.BlockMask((32, 32, 32), dense=mask, scan_bytes=5 * s * rows)
    bias = torch.zeros(1, 1, s, s).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    bias[0, 0, 95, 3] = -0.5
    with pytest.raises(ValueError, match="additive bias"):
        block_mask.BlockMask((32, 32, 32), dense=bias, scan_bytes=5 * s * rows)
