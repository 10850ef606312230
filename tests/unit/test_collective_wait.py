"""A dead or stalled peer ends an all-to-all's wait with ``SPPeerFailure`` within the group's timeout, on any backend.

Gloo's ``work.wait()`` blocks the host and raises when the group's timeout passes (the integration tests,
``tests/integration/test_overlapped_exchange.py``, run that). NCCL's returns at once (it only makes the current stream
wait), so without ``TORCH_NCCL_BLOCKING_WAIT`` a missing peer never raises there: the host polls the work instead,
up to a deadline inside the group's timeout. Here, on CPU: fake works that behave like NCCL's (``wait()`` returns
at once, ``is_completed()`` never or only later true, or ``wait()`` raising once the work failed) in a one-process
gloo world whose timeout (as ``FPDTPlugin(sp_timeout=...)`` sets it) is 1 s.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_fpdt.distributed.all_to_all import EXCHANGE, Exchange, _all_to_all
from hf_fpdt.distributed.peers import HOST_WAIT_SHARE, SPPeerFailure, host_polls, wait_collective

TIMEOUT = 1.0  # seconds: the group's timeout


class _NcclLikeWork:
    """``wait()`` returns at once (it would only order a stream); ``is_completed()`` turns true after ``polls``
    calls (``None``: never, a peer that died or stalled); ``error``: what ``wait()`` raises once completed."""

    def __init__(self, polls: int | None = None, error: BaseException | None = None) -> None:
        self.polls, self.error = polls, error
        self.checked = self.waited = 0

    def is_completed(self) -> bool:
        self.checked += 1
        return self.polls is not None and self.checked > self.polls

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


class _GlooLikeWork:
    """No ``is_completed``: the gloo path must not poll. ``wait()`` blocks (here: returns) or raises."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.waited = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture
def world(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _exchange(group, work, poll: bool | None) -> tuple[Exchange, list]:
    unpacked: list = []

    def unpack() -> list[torch.Tensor]:
        unpacked.append(True)
        return [torch.ones(2)]

    return Exchange(group, work, (), unpack, poll=poll), unpacked


def test_the_host_polls_on_every_backend_but_gloo():
    assert not host_polls("gloo")
    assert host_polls("nccl") and host_polls("NCCL") and host_polls("mpi") and host_polls("cpu:gloo,cuda:nccl")


def test_a_stalled_peer_ends_the_wait_within_the_timeout(world):
    work = _NcclLikeWork(polls=None)
    exchange, unpacked = _exchange(world, work, poll=True)
    start = time.monotonic()
    with pytest.raises(SPPeerFailure) as info:
        exchange.wait()
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert HOST_WAIT_SHARE * TIMEOUT - 0.05 <= elapsed < TIMEOUT, elapsed  # the host gave up, inside the timeout
    assert EXCHANGE in msg and f"timeout {TIMEOUT:g} s" in msg, msg  # names the operation and the timeout
    assert "SP rank 0 of 1" in msg and "did not arrive" in msg, msg
    assert isinstance(info.value.__cause__, TimeoutError)
    assert work.checked > 2 and not unpacked  # polled, with a sleep between polls; nothing unpacked


def test_the_deadline_counts_from_the_issue_not_the_wait(world):
    """An overlapped exchange is waited for long after it was issued: NCCL's watchdog times it from the issue."""
    work = _NcclLikeWork(polls=None)
    start = time.monotonic()
    with pytest.raises(SPPeerFailure, match="all_reduce of something"):
        wait_collective(work, world, "all_reduce of something", started=start - TIMEOUT, poll=True)
    assert time.monotonic() - start < 0.2 * TIMEOUT


def test_a_failed_work_raises_the_peer_failure_naming_it(world):
    error = RuntimeError("NCCL communicator was aborted on rank 1")
    work = _NcclLikeWork(polls=0, error=error)
    exchange, unpacked = _exchange(world, work, poll=True)
    with pytest.raises(SPPeerFailure, match="all_to_all of an attention chunk") as info:
        exchange.wait()
    assert info.value.__cause__ is error and "NCCL communicator was aborted on rank 1" in str(info.value)
    assert not unpacked


def test_a_completing_work_passes_and_orders_the_stream_once(world):
    work = _NcclLikeWork(polls=3)
    exchange, unpacked = _exchange(world, work, poll=True)
    first = exchange.wait()
    assert torch.equal(first[0], torch.ones(2)) and unpacked == [True]
    assert work.checked == 4 and work.waited == 1  # polled until complete, then wait() once (stream order, errors)
    assert exchange.wait() is first and work.checked == 4 and work.waited == 1  # waited once, as before


@pytest.mark.parametrize("poll", [False, None])  # None: decided from the group's backend, gloo here
def test_gloo_waits_as_before(world, poll):
    work = _GlooLikeWork()
    exchange, unpacked = _exchange(world, work, poll=poll)
    assert torch.equal(exchange.wait()[0], torch.ones(2)) and work.waited == 1 and unpacked == [True]
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    exchange, unpacked = _exchange(world, _GlooLikeWork(error), poll=poll)
    with pytest.raises(SPPeerFailure, match="all_to_all of an attention chunk") as info:
        exchange.wait()
    assert info.value.__cause__ is error and "closed its connection" in str(info.value) and not unpacked


def test_the_synchronous_all_to_all_still_exchanges(world):
    x = torch.arange(6.0).reshape(1, 2, 3)  # [P = 1, ...]
    assert torch.equal(_all_to_all(x, world), x)
