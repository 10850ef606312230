"""Window-cut blocks through flash-attn's ``window_size`` (issue 44, item 1).

A block cut by its window alone is a band: :meth:`BlockKeep.window_only` gives the rectangle of rows and keys that
see anything and flash-attn's bottom-right aligned ``(left, right)`` inside it. Checked here without a GPU:

- the band, read with flash-attn's documented semantics (:func:`standins.flash_keep`: query row i of an
  ``n x m`` call keeps keys ``[i + m - n - left, i + m - n + right]``, a negative bound unbounded), is exactly the
  block's keep mask (``BlockKeep.rows(0, Sq)``, and the definition ``t - W < u <= t``) for every block of every
  config: windows shorter than a chunk, ``k * chunk`` and ``k * chunk +- 1``, longer than several chunks, a last
  chunk shorter, uneven chunks; and every row of the rectangle keeps a key (flash-attn gives such a row ``+inf``);
- with stand-in flash-attn modules computing that semantics in float64 (the FA2 ``window_size=(l, r)`` and FA3
  ``window_size_left/right`` signatures), the dispatch calls the build with the band's window and rectangle in
  forward and backward, and the merged result equals a dense float64 sliding-window reference; a build without a
  window (or without the softcap a block needs), and blocks also cut by documents or padding, run on ``math``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from standins import dense_attention, flash_keep, install_flash
from testkit import count_math, rel_err

from hf_fpdt.attention.block_keep import BlockKeep
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.flash_builds import flash_calls
from hf_fpdt.attention.merge import merge_block, merge_rows
from hf_fpdt.attention.routes import block_backward, block_forward

CPU = torch.device("cpu")


def band_mask(keep: BlockKeep) -> torch.Tensor:
    """The ``[Sq, Sk]`` mask :meth:`BlockKeep.window_only`'s band stands for under :func:`flash_keep`, checking the
    band's own promises (left >= 0, right >= -1, no empty row inside the rectangle, the rectangle tight)."""
    band = keep.window_only()
    whole = torch.zeros(keep.sq, keep.sk, dtype=torch.bool)
    if band.r1 == band.r0:
        return whole
    assert 0 <= band.r0 < band.r1 <= keep.sq and 0 <= band.c0 < band.c1 <= keep.sk
    assert band.left >= 0 and band.right >= -1, band
    sub = flash_keep(band.r1 - band.r0, band.c1 - band.c0, False, band.left, band.right)
    assert sub.any(-1).all(), f"a row of the rectangle keeps no key: {band}"
    assert sub[:, 0].any() and sub[:, -1].any(), f"the rectangle's first or last key is kept by no row: {band}"
    whole[band.r0 : band.r1, band.c0 : band.c1] = sub
    return whole


def _definition(keep: BlockKeep) -> torch.Tensor:
    t = torch.arange(keep.qs, keep.qs + keep.sq)[:, None]
    u = torch.arange(keep.ks, keep.ks + keep.sk)[None, :]
    inside = u > t - keep.window
    return inside & (u <= t) if keep.causal else inside


# (chunk lengths, window): windows shorter than a chunk, k * chunk and k * chunk +- 1, longer than several chunks;
# a last chunk shorter; uneven chunks; a window of one token.
CONFIGS = (
    [((16, 16, 16, 16), w) for w in (1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63)]
    + [((16, 16, 16, 7), w) for w in (3, 7, 8, 16, 17, 23, 24, 40)]
    + [((13, 16, 9, 16, 5), w) for w in (4, 9, 14, 30)]
)


@pytest.mark.parametrize("lengths,window", CONFIGS, ids=lambda x: str(x))
def test_the_band_is_the_block_mask_for_every_block(lengths, window):
    """Every cut block of the call: the band under flash-attn's semantics equals ``rows(0, Sq)`` and the
    definition, whole blocks compared (not sampled); uncut blocks are whole or the causal triangle."""
    pattern = MaskSpec(window=window).blocks(lengths)
    cut_blocks = 0
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            keep = pattern.cut(i, j, CPU)
            if keep is None:
                continue
            cut_blocks += 1
            rows = keep.rows(0, keep.sq, CPU)
            assert torch.equal(rows, _definition(keep)), (i, j)
            assert torch.equal(band_mask(keep), rows), (i, j, keep.window_only())
    assert cut_blocks > 0 or window >= sum(lengths)


def test_the_band_for_every_small_block_geometry():
    """Every block geometry of a small grid, not only the pipeline's: query and key chunks of any lengths
    (``Sq != Sk``), before, at or after each other, causal or not, windows from one token to past the block."""
    checked = 0
    for qs, ks, sq, sk, w, causal in itertools.product(
        range(0, 25, 3), range(0, 25, 4), (1, 2, 5, 8, 11), (1, 3, 7, 10), range(1, 24, 2), (False, True)
    ):
        keep = BlockKeep(qs, ks, sq, sk, causal=causal, window=w)
        assert torch.equal(band_mask(keep), keep.rows(0, sq, CPU)), (qs, ks, sq, sk, w, causal, keep.window_only())
        checked += 1
    assert checked == 9 * 7 * 5 * 4 * 12 * 2


def test_only_a_window_alone_is_a_band():
    docs = torch.zeros(1, 8, dtype=torch.long)
    keys = torch.ones(1, 8, dtype=torch.bool)
    assert BlockKeep(8, 0, 8, 8, window=4).window_only() is not None
    assert BlockKeep(8, 0, 8, 8).window_only() is None  # no window
    assert BlockKeep(8, 0, 8, 8, window=4, docs_q=docs, docs_k=docs).window_only() is None
    assert BlockKeep(8, 0, 8, 8, window=4, keys=keys).window_only() is None
    assert BlockKeep(8, 0, 8, 8, window=4, dense=torch.ones(1, 8, 8, dtype=torch.bool)).window_only() is None


# ---- stand-in flash-attn builds (tests/standins.py) with flash-attn's window semantics, in float64 ----

STYLES = {"fa2": ("2.6", "flash_attn"), "fa2_no_softcap": ("2.5", "flash_attn"), "fa2_no_window": ("2.2", "flash_attn")}


def _install(monkeypatch, style: str) -> tuple[str, list]:
    """A stand-in build of ``style`` in ``sys.modules`` (no varlen entry points); returns its backend name and the
    calls it records: ``("fwd" | "bwd", (left, right), causal, Sq, Sk)``.

    fa2: FA2 2.6's ``flash_attn_func(..., window_size=(-1, -1), softcap=0.0, ...)`` and backward with ``window_size``;
    fa2_no_softcap: FA2 2.3-2.5 (a window, no softcap); fa2_no_window: FA2 before 2.3; fa3: the positional-only
    FA3 build with ``window_size_left`` / ``window_size_right``."""
    version = "fa3-2025" if style == "fa3" else STYLES[style][0]
    return install_flash(monkeypatch, version, varlen=False, record=lambda c: (c.op, c.window, c.causal, c.sq, c.sk))


def _dense_reference(q, k, v, dout, spec: MaskSpec, scale: float):
    """float64 attention of the whole sequence under ``spec`` and its gradients: ``(out, dq, dk, dv)``."""
    ref = dense_attention(q, k, v, spec, scale=scale, dout=dout)
    return ref.out, ref.dq, ref.dk, ref.dv


def _run_blocks(q, k, v, dout, spec: MaskSpec, lengths, scale, backend):
    """The chunk pipeline's block loop in one process: every needed block's forward merged per query chunk, then
    every block's backward from the final ``(out, lse)``; returns ``(out, dq, dk, dv)`` in float64."""
    pattern = spec.blocks(tuple(lengths), q.shape[0])
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    span = [slice(a, a + n) for a, n in zip(starts, lengths)]
    merge = merge_rows if pattern.may_empty_rows else merge_block
    outs, lses = [], []
    for i in range(len(lengths)):
        o = lse = None
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            bo, bl = block_forward(
                q[:, span[i]], k[:, span[j]], v[:, span[j]], causal, scale, backend, mask=mask, softcap=spec.softcap
            )
            o, lse = merge(o, lse, bo, bl)
        outs.append(o.to(q.dtype))
        lses.append(lse)
    out = torch.cat(outs, 1)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            lse = lses[i].masked_fill(torch.isneginf(lses[i]), float("inf")) if pattern.may_empty_rows else lses[i]
            g = block_backward(
                dout[:, span[i]], q[:, span[i]], k[:, span[j]], v[:, span[j]], outs[i], lse, causal, scale,
                backend, mask=mask, softcap=spec.softcap,
            )  # fmt: skip
            dq[:, span[i]] += g[0].double()
            dk[:, span[j]] += g[1].double()
            dv[:, span[j]] += g[2].double()
    return out.double(), dq, dk, dv


LENGTHS = (16, 16, 16, 16, 7)  # a last chunk shorter


def _inputs(batch: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    s = sum(LENGTHS)
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(batch, s, heads, dim, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, s, kv_heads, dim, generator=g) for _ in range(2))
    return q, k, v, dout


def _window_calls(pattern, lengths) -> list:
    """``(i, j, band)`` of every needed block the window alone cuts."""
    out = []
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            keep = pattern.cut(i, j, CPU)
            if keep is not None and keep.window_only() is not None:
                out.append((i, j, keep.window_only()))
    return out


@pytest.mark.parametrize("style", ["fa2", "fa3"])
@pytest.mark.parametrize("window", [5, 16, 17, 33, 40])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_window_blocks_run_on_the_build_with_their_band(monkeypatch, style, window, softcap):
    """Each window-cut block goes to the build, once forward and once backward, with its band's ``window_size`` and
    rectangle (no ``math`` block at all); the merged output and the gradients equal the dense float64 reference."""
    backend, seen = _install(monkeypatch, style)
    assert flash_calls(backend).window
    math_calls = count_math(monkeypatch)
    spec = MaskSpec(window=window, softcap=softcap)
    q, k, v, dout = _inputs()
    got = _run_blocks(q, k, v, dout, spec, LENGTHS, 0.35, backend)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.3g}"
    assert math_calls == []
    pattern = spec.blocks(LENGTHS, q.shape[0])
    cut = _window_calls(pattern, LENGTHS)
    assert cut, "the config has window-cut blocks"
    windowed = [c for c in seen if c[1] != (-1, -1)]
    want = [(band.window_size, False, band.r1 - band.r0, band.c1 - band.c0) for _, _, band in cut if band.r1 > band.r0]
    assert sorted(c[1:] for c in windowed if c[0] == "fwd") == sorted(want)
    assert sorted(c[1:] for c in windowed if c[0] == "bwd") == sorted(want)
    blocks = sum(len(pattern.keys(i)) for i in range(len(LENGTHS)))
    assert len(seen) == 2 * blocks  # the uncut blocks too, with no window


def test_a_band_rectangle_inside_the_block_is_placed_right(monkeypatch):
    """A block whose band is a strict rectangle (rows that see nothing, keys nobody sees): forward's rows outside
    get ``out = 0``, ``lse = -inf``, backward's rows and keys outside get zero gradients; equal to ``math``."""
    backend, seen = _install(monkeypatch, "fa2")
    keep = BlockKeep(16, 0, 16, 16, window=6)  # rows 0..4 see keys 11..15; rows 5.. see nothing
    band = keep.window_only()
    assert (band.r0, band.r1, band.c0, band.c1, band.left, band.right) == (0, 5, 11, 16, 0, -1)
    q, k, v, dout = (t[:, :16] for t in _inputs())
    out, lse = block_forward(q, k, v, False, 0.3, backend, mask=keep)
    ref_out, ref_lse = block_forward(q, k, v, False, 0.3, "math", mask=keep)
    assert seen == [("fwd", (0, -1), False, 5, 5)]
    assert torch.isneginf(lse[:, :, 5:]).all() and (out[:, 5:] == 0).all()
    assert rel_err(out, ref_out) < 1e-6 and torch.allclose(lse[:, :, :5], ref_lse[:, :, :5], atol=1e-6)
    final_lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    grads = block_backward(dout, q, k, v, out, final_lse, False, 0.3, backend, mask=keep)
    ref = block_backward(dout, q, k, v, ref_out, final_lse, False, 0.3, "math", mask=keep)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert rel_err(a, b) < 1e-6, name
    assert (grads[0][:, 5:] == 0).all() and (grads[1][:, :11] == 0).all() and (grads[2][:, :11] == 0).all()


@pytest.mark.parametrize(
    "style,softcap", [("fa2_no_window", None), ("fa2_no_softcap", 2.5)], ids=["no-window", "window-no-softcap"]
)
def test_a_build_that_cannot_take_the_block_leaves_it_to_math(monkeypatch, style, softcap):
    """A build without a window (FA2 < 2.3), or with a window but no softcap for a softcapped call: every cut block
    runs on ``math``, never on the build; the result is still the reference's."""
    backend, seen = _install(monkeypatch, style)
    math_calls = count_math(monkeypatch)
    assert flash_calls(backend).window == (style != "fa2_no_window")
    spec = MaskSpec(window=17, softcap=softcap)
    q, k, v, dout = _inputs()
    got = _run_blocks(q, k, v, dout, spec, LENGTHS, 0.35, backend)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.3g}"
    pattern = spec.blocks(LENGTHS, q.shape[0])
    cut = len(_window_calls(pattern, LENGTHS))
    assert all(c[1] in (None, (-1, -1)) for c in seen)
    if softcap is None:  # uncut blocks on the build, the window-cut ones on math
        assert len([c for c in math_calls if c[0] == "fwd"]) == cut > 0
    else:  # a softcap the build cannot take: every block on math
        assert seen == [] and len(math_calls) == 2 * sum(len(pattern.keys(i)) for i in range(len(LENGTHS)))


@pytest.mark.parametrize(
    "style,cut_by", [("fa2", "documents"), ("fa2", "padding"), ("fa3", "padding")], ids=lambda x: str(x)
)
def test_blocks_cut_by_documents_or_padding_stay_on_math(monkeypatch, style, cut_by):
    """With a window and documents (or a key mask), a block the documents (padding) cut too runs on ``math``; the
    blocks the window alone cuts still go to the build with their band; the result is the reference's. Documents:
    on a build without varlen entry points (this FA2 stand-in has no ``flash_attn_varlen_func``; FA3's take
    ``cu_seqlens``: tests/unit/test_flash_varlen_blocks.py)."""
    backend, seen = _install(monkeypatch, style)
    math_calls = count_math(monkeypatch)
    s = sum(LENGTHS)
    q, k, v, dout = _inputs()
    if cut_by == "documents":
        docs = torch.zeros(2, s, dtype=torch.long)
        docs[0, 40:], docs[1, 9:], docs[1, 50:] = 1, 1, 2  # boundaries inside chunks 2, 0 and 3
        spec = MaskSpec(window=17, docs=docs)
    else:
        keys = torch.ones(2, s, dtype=torch.bool)
        keys[1, :20] = False  # left padding of row 1, through chunk 1
        spec = MaskSpec(window=17, key_mask=keys)
    got = _run_blocks(q, k, v, dout, spec, LENGTHS, 0.35, backend)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.3g}"
    pattern = spec.blocks(LENGTHS, q.shape[0])
    other = [
        (i, j)
        for i in range(len(LENGTHS))
        for j in pattern.keys(i)
        if (c := pattern.cut(i, j, CPU)) is not None and c.window_only() is None
    ]
    assert other, "the config has blocks cut by more than the window"
    assert sorted(ks for d, ks in math_calls if d == "fwd") == sorted(sum(LENGTHS[:j]) for _, j in other)
    bands = _window_calls(pattern, LENGTHS)
    assert len([c for c in seen if c[0] == "fwd" and c[1] != (-1, -1)]) == len([b for *_, b in bands if b.r1 > b.r0])


def test_a_materialised_mask_stays_on_math(monkeypatch):
    """A bool tensor mask (not a :class:`BlockKeep`) carries no structure: ``math``, even on a build with a window."""
    backend, seen = _install(monkeypatch, "fa2")
    math_calls = count_math(monkeypatch)
    keep = BlockKeep(16, 0, 16, 16, window=6)
    q, k, v, _ = (t[:, :16] for t in _inputs())
    block_forward(q, k, v, False, 0.3, backend, mask=keep.whole(CPU))
    assert seen == [] and math_calls == [("fwd", None)]
