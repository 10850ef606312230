"""A cut block's mask built a slice of query rows at a time (hf_fpdt.attention.block_keep.BlockKeep).

Every cut block of a call's :class:`~hf_fpdt.attention.block_mask.BlockMask` (windows, packed documents, key
padding, 4D masks bool and additive, sparse patterns pure and evaluated, and all of them at once) is compared with
an independent reference: the call's whole ``[B, S, S]`` keep mask, built from the definitions, cut to the block.
Its rows, a ragged slice at a time, are the same as the whole mask; the blocks it leaves whole are whole in the
reference too. The packed bits of an evaluated pattern unpack row slices at any bit offset.
"""

from __future__ import annotations

import pytest
import torch

from hf_fpdt.attention import sparse_patterns as sp
from hf_fpdt.attention.block_keep import BlockKeep, mask_rows, unpack_rows
from hf_fpdt.attention.block_mask import MaskSpec, PackedMasks

S, LENGTHS, B = 45, (16, 13, 16), 2  # uneven chunks: row slices at odd bit offsets of the packed masks
CPU = torch.device("cpu")


def _docs() -> torch.Tensor:
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 10:], docs[0, 30:] = 1, 2  # boundaries inside chunks 0 and 1
    docs[1, 20:] = 1
    return docs


def _keys() -> torch.Tensor:
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[1, :7] = False  # left padding of row 1
    keys[0, 22] = False  # a hole
    return keys


def _dense(additive: bool) -> torch.Tensor:
    t, u = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = ((u <= t) & ((t + u) % 7 != 3)).expand(B, 1, S, S).clone()
    keep[1, 0, :, :5] = False
    if not additive:
        return keep
    return torch.zeros(B, 1, S, S).masked_fill_(~keep, torch.finfo(torch.float32).min)


_PURE = sp.local_global(window=6, global_tokens=3)
_EVALUATED = sp.SparsePattern(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 5 != 2), name="evaluated")

SPECS = {
    "window": lambda: MaskSpec(window=9),
    "documents": lambda: MaskSpec(docs=_docs()),
    "padding": lambda: MaskSpec(key_mask=_keys()),
    "dense-bool": lambda: MaskSpec(dense_mask=_dense(False)),
    "dense-additive": lambda: MaskSpec(dense_mask=_dense(True)),
    "sparse-pure": lambda: MaskSpec(sparse=_PURE),
    "sparse-evaluated": lambda: MaskSpec(sparse=_EVALUATED),
    "all": lambda: MaskSpec(window=20, docs=_docs(), key_mask=_keys(), sparse=_EVALUATED),
}


def _reference(spec: MaskSpec) -> torch.Tensor:
    """``[B, S, S]`` bool: the call's whole keep mask from the definitions (block_mask's module doc)."""
    t, u = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = (u <= t).expand(B, S, S).clone()
    if spec.window is not None:
        keep &= u > t - spec.window
    if spec.docs is not None:
        keep &= spec.docs[:, :, None] == spec.docs[:, None, :]
    if spec.key_mask is not None:
        keep &= spec.key_mask[:, None, :]
    if spec.dense_mask is not None:
        d = spec.dense_mask[:, 0]
        keep &= d if d.dtype == torch.bool else d == 0
    if spec.sparse is not None:
        keep &= spec.sparse.mask_mod(torch.tensor(0), torch.tensor(0), t, u)
    return keep


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_cut_blocks_rows_are_its_mask(kind):
    spec = SPECS[kind]()
    blocks = spec.blocks(LENGTHS, batch=B)
    ref = _reference(spec)
    starts = [0, 16, 29]
    cut = 0
    for i in range(len(LENGTHS)):
        for j in range(i + 1):
            (qs, qe), (ks, ke) = (starts[i], starts[i] + LENGTHS[i]), (starts[j], starts[j] + LENGTHS[j])
            want = ref[:, qs:qe, ks:ke]
            if not blocks.needed(i, j):
                assert not want.any(), (i, j)
                continue
            causal, lazy = blocks.block(i, j, CPU)
            assert causal == (i == j)
            if lazy is None:  # whole, or exactly the causal triangle
                whole = torch.ones_like(want[0])
                assert torch.equal(want, (whole.tril() if i == j else whole).expand_as(want)), (i, j)
                continue
            cut += 1
            assert isinstance(lazy, BlockKeep) and lazy.shape[-2:] == (qe - qs, ke - ks)
            got = lazy.whole(CPU)
            assert got.dtype == torch.bool and got.shape == lazy.shape and got.dim() == lazy.dim()
            assert torch.equal(got.expand_as(want), want), (i, j)
            assert torch.equal(blocks.keep(i, j, CPU), got)  # keep() is the whole of block()'s mask
            for n in (1, 3, 7):  # ragged slices
                rows = torch.cat([mask_rows(lazy, r, min(n, qe - qs - r), CPU) for r in range(0, qe - qs, n)], -2)
                assert torch.equal(rows, got), (i, j, n)
    assert cut > 0  # the case cuts some block


def test_a_materialised_mask_is_sliced_as_it_is():
    mask = torch.rand(2, 9, 5) > 0.5
    assert torch.equal(mask_rows(mask, 3, 4, CPU), mask[:, 3:7])


@pytest.mark.parametrize("sk", [8, 13, 1])
def test_packed_rows_unpack_at_any_bit_offset(sk):
    gen = torch.Generator().manual_seed(sk)
    keep = torch.rand(11, sk, generator=gen) > 0.5
    masks = PackedMasks()
    masks.put((0, 0), keep)
    packed, bits = masks.on_device((0, 0), CPU), masks.bits(CPU)
    assert packed.numel() == (11 * sk + 7) // 8  # 8 to a byte on the device too
    for r in range(11):
        for n in range(1, 12 - r):
            assert torch.equal(unpack_rows(packed, bits, sk, r, n), keep[r : r + n]), (r, n)
