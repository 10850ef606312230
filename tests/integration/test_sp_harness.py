"""tests/distributed.py: results come back in rank order, a rank's exception comes back with its type."""

from __future__ import annotations

import os
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


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def _note_after_exit(rank: int, world_size: int) -> str:
    """Rank 0 leaves a note in the world's store and ends; rank 1 reads it once rank 0's process has ended."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("pid", str(os.getpid()))
        store.set("note", "rank 0 raised ValueError")
    dist.barrier()
    if rank == 0:
        return ""
    pid = int(store.get("pid"))
    deadline = time.monotonic() + 60
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(pid), "rank 0's process did not end"
    return store.get("note").decode()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see rank 0's process end")
def test_a_ranks_note_outlives_its_process():
    """The parent hosts the store, as torchrun's agent does: what a failed rank wrote there can be read by its peers
    after its process has ended (a peer's collective fails only when that process ends; when rank 0 hosted the
    store, the note went with it and the peer's SPPeerFailure could not name the error)."""
    assert run_distributed(_note_after_exit, 2, timeout=90) == ["", "rank 0 raised ValueError"]
