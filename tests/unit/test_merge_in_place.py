"""The online-softmax merge (``merge_block`` / ``merge_rows``) in place, against a float64 logsumexp reference.

The merge updates the caller's accumulator in place (one ``lerp_`` over ``out``): these tests pin that the
numbers are the reference's, that rows without a key (``lse = -inf``) are handled, that the first call copies
unless told it may take the block, and that a bf16 block leaves its own tensor alone.
"""

from __future__ import annotations

import pytest
import torch

from hf_fpdt.attention.merge import merge_block, merge_rows


def _blocks(n, b=2, s=9, h=3, d=8, dtype=torch.float64, empty=None):
    """``n`` blocks of ``(out, lse)``; ``empty[i]`` is a bool [B, H, S] of rows with no key in block i."""
    g = torch.Generator().manual_seed(n)
    blocks = []
    for i in range(n):
        o = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
        lse = 4 * torch.randn(b, h, s, generator=g, dtype=torch.float64)
        if empty is not None:
            lse = lse.masked_fill(empty[i], float("-inf"))
            o = o.masked_fill(empty[i].transpose(1, 2).unsqueeze(-1), 0.0)  # the kernels' rows without a key
        blocks.append((o.to(dtype), lse.to(torch.float32 if dtype != torch.float64 else dtype)))
    return blocks


def _reference(blocks):
    """``sum_b exp(lse_b - lse) o_b`` and ``lse = logsumexp_b lse_b`` in float64; rows with no key: 0, -inf."""
    lses = torch.stack([lse.double() for _, lse in blocks])  # [n, B, H, S]
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - lse.masked_fill(torch.isneginf(lse), 0.0)).nan_to_num(0.0)
    out = sum(wi.transpose(1, 2).unsqueeze(-1) * o.double() for wi, (o, _) in zip(w, blocks))
    return out, lse


def _fold(merge, blocks, take):
    out = lse = None
    for o, m in blocks:
        out, lse = merge(out, lse, o, m, take=take)
    return out, lse


@pytest.mark.parametrize("merge", [merge_block, merge_rows])
def test_merge_equals_logsumexp_reference_in_float64(merge):
    blocks = _blocks(5)
    out, lse = _fold(merge, blocks, take=False)
    ref_out, ref_lse = _reference(blocks)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-13)


def test_merge_rows_handles_rows_without_keys():
    # rows with no key in the first blocks (a padding mask), in every block (a padding query), in the last only
    b, s, h = 2, 9, 3
    g = torch.Generator().manual_seed(0)
    empty = [torch.rand(b, h, s, generator=g) < 0.4 for _ in range(4)]
    never = torch.zeros(b, h, s, dtype=torch.bool)
    never[0, 1, :3] = True
    empty = [e | never for e in empty]
    empty[0][1, 2] = True  # row set seen only from block 1 on
    blocks = _blocks(4, b=b, s=s, h=h, empty=empty)
    out, lse = _fold(merge_rows, blocks, take=False)
    ref_out, ref_lse = _reference(blocks)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.isneginf(lse[never]).all() and (out[never.transpose(1, 2)] == 0).all()
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_merge_in_low_precision_accumulates_in_float32(dtype, tol):
    blocks = _blocks(4, dtype=dtype)
    kept = [(o.clone(), m.clone()) for o, m in blocks]
    out, lse = _fold(merge_block, blocks, take=False)
    assert out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = _reference(blocks)
    assert (out.double() - ref_out).abs().max() <= tol * ref_out.abs().max()
    assert (lse.double() - ref_lse).abs().max() <= 1e-6 * ref_lse.abs().max()
    for (o, m), (ko, km) in zip(blocks, kept):  # no block was written into
        assert torch.equal(o, ko) and torch.equal(m, km)


def test_merge_updates_the_accumulator_in_place_and_copies_unless_taking():
    (o1, l1), (o2, l2) = _blocks(2, dtype=torch.float32)
    o1_before, l1_before = o1.clone(), l1.clone()
    out, lse = merge_block(None, None, o1, l1)  # default: a copy, o1 is the caller's
    assert out.data_ptr() != o1.data_ptr() and lse.data_ptr() != l1.data_ptr()
    out2, lse2 = merge_block(out, lse, o2, l2)
    assert out2 is out and lse2 is lse  # the accumulator itself, updated in place
    assert torch.equal(o1, o1_before) and torch.equal(l1, l1_before)
    taken, taken_lse = merge_rows(None, None, o1, l1, take=True)  # a fresh block may become the accumulator
    assert taken.data_ptr() == o1.data_ptr() and taken_lse.data_ptr() == l1.data_ptr()
    bf = o1.bfloat16()
    started, _ = merge_block(None, None, bf, l1, take=True)  # another dtype: a new float32 tensor anyway
    assert started.dtype == torch.float32 and started.data_ptr() != bf.data_ptr()
