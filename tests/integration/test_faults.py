"""A late or killed rank ends every rank within ``sp_timeout`` with an error naming the peer, the collective
and the timeout, in the README's Accelerate loop and in ``FPDTTrainer`` (issue 21, item 3).

Two CPU processes (gloo) run :mod:`fault_script` (the documented script shapes), each started with
torchrun's environment but no agent, so that every rank's own exit code and time are seen. World rank 1
is late by ``DELAY`` seconds, or kills itself, at step 2; ``sp_timeout`` is ``TIMEOUT``. Before this
item the peer waited the whole delay in DDP's pre-forward sync or the token count (the world kept its
30-minute timeout), and printed gloo's "Connection closed by peer" when rank 1 died.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import fault_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TIMEOUT, DELAY, MARGIN = 4.0, 15.0, 6.0


def _run(tmp_path: Path, shape: str, fault: str, where: str) -> list[dict]:
    return fault_ranks(tmp_path / f"{shape}_{fault}_{where}", shape, fault, where, TIMEOUT, DELAY)


def _check_survivor(rank: dict, collective: str, within: float) -> None:
    assert rank["rc"] == 1, rank["out"][-3000:]
    assert rank["type"] == "SPPeerFailure", rank.get("error")
    error = rank["error"]
    assert "world rank 0 of 2" in error and "world rank 1 (" in error, error  # who reports, who is missing
    assert collective in error and f"timeout {TIMEOUT:g} s" in error, error
    assert rank["done"] - rank["entered"] < within, (rank["done"] - rank["entered"], error)
    assert rank["end"] - rank["entered"] < within + MARGIN, rank["end"] - rank["entered"]  # the process ended too


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,where,collective",
    [
        ("loop", "forward", "DDP forward"),  # late after the token count: the peer waits before DDP's buffer sync
        ("trainer", "step", "training step"),  # late in a callback: the peer waits in DDP's forward
    ],
)
def test_straggler_ends_every_rank(tmp_path: Path, shape: str, where: str, collective: str) -> None:
    survivor, late = _run(tmp_path, shape, "late", where)
    _check_survivor(survivor, collective, TIMEOUT + MARGIN)  # not DELAY
    assert survivor["done"] - survivor["entered"] >= TIMEOUT - 0.5  # it did wait for the peer
    # The late rank arrives to find its peer gone: an error naming it at once, not another timeout.
    assert late["rc"] == 1 and late["type"] == "SPPeerFailure", late["out"][-3000:]
    assert "world rank 1 of 2" in late["error"] and "world rank 0" in late["error"], late["error"]
    assert late["done"] - late["entered"] < DELAY + MARGIN


@pytest.mark.parametrize(
    "shape,where,collective",
    [("loop", "step", "num_items_in_batch"), ("trainer", "step", "training step")],
)
def test_killed_rank_ends_every_rank(tmp_path: Path, shape: str, where: str, collective: str) -> None:
    survivor, killed = _run(tmp_path, shape, "kill", where)
    assert killed["rc"] == -9
    _check_survivor(survivor, collective, MARGIN)  # a closed connection is seen at once
    assert "closed its connection (died)" in survivor["error"], survivor["error"]
