"""hf_fpdt.distributed.sp_loss in one process: per-rank shares of sharded logits add up to HF's one-process loss."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_fpdt.data.layout import IGNORE_INDEX, pad_sequence, shard_batch
from hf_fpdt.distributed.sp_loss import (
    ddp_loss_scale,
    global_loss,
    global_num_items,
    reduce_gradients,
    sp_loss,
)
from hf_fpdt.memory.tiling import tiled_lm_loss

B, S, V, CHUNK = 2, 45, 11, 8


def _logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :10] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("via_hf", [False, True])
def test_shares_sum_to_one_process_loss_and_grads(sp, via_hf):
    logits, labels = _logits_and_labels()
    full = logits.clone().requires_grad_()
    if via_hf:  # HF's mean over valid shifted targets (it computes in fp32)
        ref = ForCausalLMLoss(full, labels, V)
    else:  # fp64 throughout
        ref = torch.nn.functional.cross_entropy(full[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    ref.backward()
    ids = torch.zeros_like(labels)
    total = 0.0
    sharded = logits.clone().requires_grad_()
    for rank in range(sp):
        shard = shard_batch(ids, labels, rank=rank, sp_size=sp, chunk_size=CHUNK)
        local = pad_sequence(sharded, sp * shard.index.numel(), 0)[:, shard.index]  # this rank's logits
        if via_hf:  # what SPShard.model_kwargs() makes an HF model compute
            kw = shard.model_kwargs()
            share = ForCausalLMLoss(local, kw["labels"], V, kw["num_items_in_batch"], shift_labels=kw["shift_labels"])
        else:  # what the package computes: the tiled head's token-loss sum (the logits given: an identity
            # head), this rank's share of it (tiles computed in fp32, like HF's)
            local_sum, _ = tiled_lm_loss(local, lambda logits: logits, shard.shift_labels, 3)
            share = sp_loss(local_sum, shard.num_items_in_batch)
        share.backward()  # each rank's backward; the gradients add up like the SP gradient sum
        total = total + share.detach()
    tol = {"rtol": 1e-6, "atol": 1e-9}  # both compute the cross-entropy in fp32
    torch.testing.assert_close(total.to(ref.dtype), ref.detach(), **tol)
    torch.testing.assert_close(sharded.grad, full.grad, **tol)


def test_sp_loss_with_no_valid_targets_is_nan_as_one_process():
    """Issue 29: every label ignored gives NaN, as one process (HF's mean over no target) does; it was 0.0."""
    zero = torch.tensor(0.0, requires_grad=True)
    assert sp_loss(zero, torch.tensor(0)).isnan()
    assert sp_loss(zero, 0).isnan()
    assert sp_loss(torch.tensor(6.0), 4).item() == 1.5
    assert sp_loss(torch.tensor(6.0), torch.tensor(4)).item() == 1.5


def test_one_process_group_none_is_identity():
    labels = torch.tensor([[1, -100, 2, -100]])
    assert global_num_items(labels, None).item() == 2
    assert global_num_items(labels, None, ignore_index=2).item() == 3
    loss = torch.tensor(2.5, requires_grad=True)
    logged = global_loss(loss, None, None)
    assert logged.item() == 2.5 and not logged.requires_grad
    assert ddp_loss_scale(None) == 1
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    reduce_gradients([p], None, None)
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
