"""The online softmax's merge: a block's ``(out, lse)`` folded into the running ``(out, lse)`` of the same query
rows, in place, in the stable sigmoid / logsigmoid form (:func:`merge_block`; :func:`merge_rows` where a row may
have seen no key yet). The block kernels that produce the blocks are :mod:`hf_fpdt.attention.kernels`."""

from __future__ import annotations

import torch


def merge_block(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    *,
    take: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's ``(out, lse)`` into the running ``(out, lse)`` of the same query rows, in place.

    ``out`` [B, Sq, H, D] and ``lse`` [B, H, Sq] are the caller's float32 accumulator (float64 stays
    float64): they are updated in place and returned. The first call (``out is None``) starts one from
    the block: a copy, or with ``take=True`` the block's own tensors where they already have the
    accumulator's dtype (for a block nobody else keeps, such as a kernel's fresh output). The
    sigmoid/logsigmoid form never exponentiates a large positive gap; with ``d = lse_b - lse``::

        out <- lerp(out, out_b, sigmoid(d))          (= out - sigmoid(d) * (out - out_b))
        lse <- max(lse, lse_b) - logsigmoid(|d|)     (= lse - logsigmoid(lse - lse_b))

    One pass over ``out`` (``lerp_``), and one temporary of its size only for a block in another dtype
    (bf16 blocks are cast once); the rest is ``[B, H, Sq]``.
    """
    return _merge(out, lse, block_out, block_lse, take, empty_rows=False)


def merge_rows(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    *,
    take: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_block`, where a row that has seen no key yet (``lse = -inf``) takes the block as it is.

    For calls whose rows may see no key in a block (padding masks, a cache's padded keys, a rank's share
    of the keys): :func:`merge_block`'s ``sigmoid(lse_b - lse)`` is NaN for ``-inf - -inf``. Such rows get
    weight 1 (their ``out`` is the kernels' 0 for rows without a key, so ``lerp`` gives ``out_b`` exactly)
    and ``lse_b``. In place, as :func:`merge_block`.
    """
    return _merge(out, lse, block_out, block_lse, take, empty_rows=True)


def _merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    take: bool,
    empty_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.float64 if block_out.dtype == torch.float64 else torch.float32
    if out is None or lse is None:
        if take:
            return block_out.to(acc), block_lse.to(acc)
        return block_out.to(acc, copy=True), block_lse.to(acc, copy=True)
    block_lse = block_lse.to(acc)
    d = block_lse - lse  # [B, H, Sq]
    if empty_rows:  # lse = -inf: weight 1 and lse_b (d is +inf, or NaN when the block has no key either)
        d.masked_fill_(torch.isneginf(lse), float("inf"))
    step = torch.nn.functional.logsigmoid(d.abs())  # log(e^lse + e^lse_b) = max - logsigmoid(|d|)
    torch.maximum(lse, block_lse, out=lse)
    lse.sub_(step)
    weight = d.sigmoid_().transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    out.lerp_(block_out.to(acc), weight)
    return out, lse
