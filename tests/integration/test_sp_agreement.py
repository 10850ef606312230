"""SP ranks that disagree, or one rank that raises mid-step (:mod:`hf_fpdt.distributed.agreement`), 2 gloo processes.

* ranks given samples of different lengths, models of different chunk sizes, or gradient checkpointing on
  one rank only: the same ``ValueError``
  on every rank, naming both ranks' values, and the group still works for the next (agreeing) step;
* one rank raising inside a step while it stays alive: its peer stops within the group's timeout with
  an error naming that rank, its step and its error.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.distributed.groups import build_groups

TIMEOUT = 5.0  # seconds the SP group waits for a missing rank


def _model(groups, chunk: int):
    return hf_fpdt.apply(
        tiny_model("tiny-llama", None), hf_fpdt.FPDTConfig(chunk_size=chunk, offload=False), group=groups.sp
    )


def _loss(model, groups, length: int, chunk: int) -> torch.Tensor:
    ids = torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=2, chunk_size=chunk)
    return model(**shard.model_kwargs()).loss


def _caught(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _worker(rank: int, world_size: int) -> dict:
    """All cases in one launch (a process start costs more than the cases): disagreements, then a failure."""
    out = _disagreements(rank)
    out["failure"] = _one_rank_raises(rank)
    return out


def _disagreements(rank: int) -> dict:
    groups = build_groups(2, timeout=60)
    model = _model(groups, 16)
    out = {"length": _caught(lambda: _loss(model, groups, 64 if rank == 0 else 48, 16))}
    # The same model, an agreeing step: the group is usable after the refused one.
    out["after"] = torch.stack([_loss(model, groups, 64, 16).detach()])
    chunk = 16 if rank == 0 else 8  # each rank's data laid out for its own model's chunk size
    other = _model(groups, chunk)
    out["chunk"] = _caught(lambda: _loss(other, groups, 64, chunk))
    ckpt = _model(groups, 16).train()
    if rank == 0:  # the step's plan (checkpoint segments, what is kept) depends on it
        ckpt.gradient_checkpointing_enable()
    out["checkpointing"] = _caught(lambda: _loss(ckpt, groups, 64, 16))
    return out


@pytest.fixture(scope="module")
def disagreements() -> list[dict]:
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.multiprocess
def test_different_lengths_raise_on_every_rank(disagreements) -> None:
    first, second = (r["length"] for r in disagreements)
    assert first == second and first[0] == "SPAgreementError"  # a ValueError subclass
    assert "local sequence length: rank 0 has 32, rank 1 has 24" in first[1]
    assert "chunk size" not in first[1]  # only what differs is named


@pytest.mark.multiprocess
def test_group_works_after_a_refused_step(disagreements) -> None:
    first, second = (r["after"] for r in disagreements)
    assert torch.isfinite(first).all() and torch.equal(first + second, second + first)
    assert (first + second).item() > 1.0  # the shares of one loss of a 512-token vocabulary (about ln 512)


@pytest.mark.multiprocess
def test_different_chunk_sizes_raise_on_every_rank(disagreements) -> None:
    first, second = (r["chunk"] for r in disagreements)
    assert first == second and first[0] == "SPAgreementError"
    assert "chunk size: rank 0 has 16, rank 1 has 8" in first[1] and "build the same FPDTConfig" in first[1]


@pytest.mark.multiprocess
def test_gradient_checkpointing_on_one_rank_only_raises_on_every_rank(disagreements) -> None:
    first, second = (r["checkpointing"] for r in disagreements)
    assert first == second and first[0] == "SPAgreementError"
    assert "gradient checkpointing: rank 0 has 1, rank 1 has 0" in first[1]


def test_agreement_error_is_a_value_error() -> None:
    from hf_fpdt.distributed.agreement import SPAgreementError

    assert issubclass(SPAgreementError, ValueError)


def _one_rank_raises(rank: int) -> dict:
    groups = build_groups(2, timeout=TIMEOUT)  # new groups: the timed-out one is not used again
    model = _model(groups, 16)
    _loss(model, groups, 64, 16).backward()  # step 1 runs on both ranks

    def boom(module, args, output):
        raise RuntimeError(f"boom on rank {rank}")

    if rank == 1:  # raises in layer 0's MLP of step 2; rank 0 is then left in layer 1's all-to-all
        model.model.layers[0].mlp.register_forward_hook(boom)
    start = time.monotonic()
    caught = _caught(lambda: _loss(model, groups, 64, 16).backward())
    elapsed = time.monotonic() - start
    dist.barrier()  # rank 1 stayed alive (and in the world group) all along
    return {"caught": caught, "elapsed": elapsed}


@pytest.mark.multiprocess
def test_one_rank_raising_ends_every_rank_with_a_message(disagreements) -> None:
    first, second = (r["failure"] for r in disagreements)
    assert second["caught"] == ("RuntimeError", "boom on rank 1")
    kind, msg = first["caught"]
    assert kind == "SPPeerFailure"
    assert msg.startswith("SP rank 0 of 2 (world rank 0): a collective of the sequence-parallel group failed")
    assert "SP rank 1 (world rank 1) raised RuntimeError in step 2: boom on rank 1" in msg
    assert first["elapsed"] < TIMEOUT + 30  # bounded by the group's timeout, not gloo's 30 minutes
