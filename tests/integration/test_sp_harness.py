"""tests/distributed.py: results come back in rank order, a rank's exception comes back with its type."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import RemoteTraceback, run_distributed

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _sum_and_fail(rank: int, world_size: int, fail_rank: int | None) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == fail_rank:
        raise ValueError(f"rank {rank} was told to fail")
    if fail_rank is not None:
        dist.all_reduce(t)  # blocks: the failed rank never joins
    return {"rank": rank, "world": world_size, "sum": t, "threads": torch.get_num_threads()}


def test_results_in_rank_order():
    results = run_distributed(_sum_and_fail, 2, None)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["threads"] == 1 and r["sum"].item() == 3.0 for r in results)


def test_worker_exception_is_reraised_with_its_type():
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 was told to fail") as info:
        run_distributed(_sum_and_fail, 2, 1, grace=2.0, timeout=60)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "rank 1 of 2" in str(info.value.__cause__) and "_sum_and_fail" in str(info.value.__cause__)
    assert time.monotonic() - start < 50  # the rank stuck in all_reduce was not waited for until the timeout
