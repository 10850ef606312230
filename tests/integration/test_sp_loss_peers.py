"""The SP loss helpers a user's own loop calls (``global_num_items``, ``global_loss``, ``reduce_gradients``) name
a peer that never comes (``SPPeerFailure``) instead of failing with gloo's error or waiting 30 minutes."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from hf_fpdt.distributed.groups import build_groups
from hf_fpdt.distributed.peers import SPPeerFailure
from hf_fpdt.distributed.sp_loss import global_loss, global_num_items, reduce_gradients

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, world_size: int, helper: str) -> str:
    groups = build_groups(2, timeout=3)
    if rank == 1:
        return "left"  # this peer never calls the helper
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    calls = {
        "global_num_items": lambda: global_num_items(torch.zeros(1, 4, dtype=torch.long), groups.sp),
        "global_loss": lambda: global_loss(torch.ones(()), groups.sp),
        "reduce_gradients": lambda: reduce_gradients([param], groups.sp),
    }
    try:
        calls[helper]()
    except SPPeerFailure as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("helper", ["global_num_items", "global_loss", "reduce_gradients"])
def test_a_missing_peer_is_named(helper: str) -> None:
    message = run_distributed(_worker, 2, helper, timeout=120)[0]
    assert helper in message and "rank 1" in message, message
