"""The attention's all-to-alls overlapped with the compute (issue 44, item 5), on real gloo processes.

At SP 2 and SP 4 (tiny Llama: 4 query heads over 2 KV heads, so SP 4 replicates the KV heads; a batch of 2
samples of 520 tokens, chunk 128: 5 chunks, padding at SP 4; layers checkpointed, so the recomputation's replay of
the output goes through the exchange too):

* a training step with the exchanges overlapped (the default) gives the same bits as with
  ``FPDTConfig(sync_exchanges=True)`` (the synchronous order): the loss, the logits and every parameter gradient
  on every rank, before any reduction;
* both equal one process's ``sdpa`` step within the SP tolerance;
* the overlap happens: with it, two exchanges are in flight at once; without it, never more than one.

And a rank raising mid-forward while its peer has exchanges in flight (SP 2, a 5-second group timeout): the
peer's wait ends with :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming the failing rank, its step and its
error, within the timeout; the failing rank raises its own error; nothing hangs or aborts (both ranks then meet
in a world barrier). Likewise a rank raising in backward (chunk 0's projection backward, chunk 1's dq/dk/dv
exchange in flight): its peer's error is ``SPPeerFailure`` naming it, within the timeout. Ranks given different
``sync_exchanges`` (their collectives would come in different orders) raise ``SPAgreementError`` on both before
any exchange.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.groups import build_groups
from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

pytestmark = pytest.mark.multiprocess  # every test here starts processes

PRESET, SEQ_LEN, CHUNK, BATCH = "tiny-llama", 520, 128, 2
RTOL = 1e-5
TIMEOUT = 5.0  # seconds the SP group of the failure cases waits for a missing rank


class _InFlight:
    """Counts the all-to-alls issued with ``async_op=True`` and not yet waited (this process's ``dist`` only)."""

    def __init__(self) -> None:
        self.open = self.most = 0
        self.at_failure: int | None = None
        self._real = dist.all_to_all_single

    def __enter__(self) -> _InFlight:
        def tracked(*args, **kwargs):
            work = self._real(*args, **kwargs)
            if not kwargs.get("async_op"):
                return work
            self.open += 1
            self.most = max(self.most, self.open)
            return _Work(work, self)

        dist.all_to_all_single = tracked
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._real


class _Work:
    def __init__(self, work, tracker: _InFlight) -> None:
        self.work, self.tracker = work, tracker

    def wait(self, *args):
        try:
            return self.work.wait(*args)
        except Exception:
            self.tracker.at_failure = self.tracker.open
            raise
        finally:
            self.tracker.open -= 1


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (BATCH, SEQ_LEN), generator=g)
    labels = ids.clone()
    labels[0, :100] = IGNORE_INDEX  # a prompt without targets
    return ids, labels


def _step(state: dict, groups, shard, sync: bool) -> dict:
    config = hf_fpdt.FPDTConfig(chunk_size=CHUNK, sync_exchanges=sync)
    model = hf_fpdt.apply(tiny_model(PRESET, state=state), config, group=groups.sp)
    model.gradient_checkpointing_enable()  # non-reentrant: the recomputation replays the output through the exchange
    model.train()
    with _InFlight() as flight:
        out = model(**shard.model_kwargs())
        out.loss.backward()
        with torch.no_grad():
            logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    reduce_gradients(model.parameters(), groups.sp, groups.dp)
    return {
        "local_loss": out.loss.detach(),
        "local_grads": local,
        "logits": logits,
        "loss": global_loss(out.loss, groups.sp, groups.dp),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "most_in_flight": flight.most,
    }


def _equality(rank: int, world: int, state: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    groups = build_groups(world)
    shard = shard_batch(ids, labels, rank=groups.sp_rank, sp_size=world, chunk_size=CHUNK)
    return {sync: _step(state, groups, shard, sync) for sync in (True, False)}


def _reference(state: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    model = tiny_model(PRESET, state=state)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_exchanges_equal_the_synchronous_order_bit_for_bit(world: int) -> None:
    state = tiny_model(PRESET).state_dict()
    ids, labels = _data()
    ref = _reference(state, ids, labels)
    for rank, results in enumerate(run_distributed(_equality, world, state, ids, labels, timeout=600)):
        sync, overlapped = results[True], results[False]
        where = f"rank {rank} of SP {world}"
        assert torch.equal(overlapped["local_loss"], sync["local_loss"]), where
        assert torch.equal(overlapped["logits"], sync["logits"]), where
        assert overlapped["local_grads"].keys() == sync["local_grads"].keys() == ref["grads"].keys()
        for name, g in sync["local_grads"].items():
            assert torch.equal(overlapped["local_grads"][name], g), f"{where}: {name} differs"
        for res in (sync, overlapped):  # and both are one process's step
            assert _rel(res["loss"], ref["loss"]) < RTOL, where
            for name, g in ref["grads"].items():
                assert _rel(res["grads"][name], g) < RTOL, f"{where}: {name} off by {_rel(res['grads'][name], g)}"
        assert sync["most_in_flight"] == 1, where  # each exchange waited where it is issued
        assert overlapped["most_in_flight"] >= 2, where  # the next chunk's travels beside the previous output's


def _raises_mid_forward(rank: int, world: int) -> dict:
    """Rank 1 raises in layer 0's q projection of chunk 1, then (new groups, a new model) of chunk 2."""
    out = {}
    # chunk 1: projected ahead, nothing of rank 1's in flight; chunk 2: its chunk-0 output is; 5: the first q
    # projection of backward (chunk 0's, recomputed by backward_chunk(0) after row 1, while chunk 1's dq/dk/dv travel)
    for at in (1, 2, 5):
        out[at] = _failing_step(rank, at)
        dist.barrier()  # rank 1 stayed alive (and in the world group) all along: neither rank hangs or aborts
    out["disagree"] = _disagreeing_step(rank)
    return out


def _disagreeing_step(rank: int) -> tuple[str, str] | None:
    """Rank 0 synchronous, rank 1 overlapped: their collectives would come in different orders."""
    groups = build_groups(2, timeout=60)
    config = hf_fpdt.FPDTConfig(chunk_size=16, offload=False, sync_exchanges=rank == 0)
    model = hf_fpdt.apply(tiny_model(PRESET, None), config, group=groups.sp)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=2, chunk_size=16)
    try:
        model(**shard.model_kwargs())
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _failing_step(rank: int, at: int) -> dict:
    """Step 1 on both ranks, then step 2, in which rank 1 raises when layer 0 projects chunk ``at``."""
    groups = build_groups(2, timeout=TIMEOUT)  # new groups per case: a timed-out one is not used again
    model = hf_fpdt.apply(tiny_model(PRESET, None), hf_fpdt.FPDTConfig(chunk_size=16, offload=False), group=groups.sp)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=2, chunk_size=16)
    model(**shard.model_kwargs()).loss.backward()  # step 1 runs on both ranks
    calls, seen = {"n": 0}, {}
    with _InFlight() as flight:

        def boom(module, args, output):
            calls["n"] += 1
            if calls["n"] == at + 1:  # one q projection per chunk in forward (4 chunks), then one per chunk in backward
                seen["open"] = flight.open
                raise RuntimeError(f"boom on rank {rank} at chunk {at}")

        if rank == 1:
            model.model.layers[0].self_attn.q_proj.register_forward_hook(boom)
        start = time.monotonic()
        try:
            model(**shard.model_kwargs()).loss.backward()
            caught = None
        except Exception as exc:
            caught = (type(exc).__name__, str(exc))
        elapsed = time.monotonic() - start
    return {"caught": caught, "elapsed": elapsed, "open": seen.get("open"), "at_failure": flight.at_failure}


@pytest.mark.parametrize("at", [1, 2])
def test_rank_raising_mid_forward_with_exchanges_in_flight(failures, at: int) -> None:
    first, second = (r[at] for r in failures)
    assert second["caught"] == ("RuntimeError", f"boom on rank 1 at chunk {at}")
    kind, msg = first["caught"]
    assert kind == "SPPeerFailure", msg
    assert msg.startswith("SP rank 0 of 2 (world rank 0): a collective of the sequence-parallel group failed")
    assert "all_to_all of an attention chunk" in msg and f"timeout {TIMEOUT:g} s" in msg, msg
    assert f"SP rank 1 (world rank 1) raised RuntimeError in step 2: boom on rank 1 at chunk {at}" in msg, msg
    assert first["elapsed"] < TIMEOUT + 30  # bounded by the group's timeout
    assert first["at_failure"] is not None and first["at_failure"] >= 2  # the failed wait had another beside it
    assert second["open"] == (0 if at == 1 else 1)  # at chunk 2, rank 1's chunk-0 output exchange is in flight


def test_rank_raising_mid_backward_with_exchanges_in_flight(failures) -> None:
    """Rank 1 raises in chunk 0's projection backward with chunk 1's dq/dk/dv exchange in flight; no note (it
    raised outside the forward), so rank 0's error names the group's other rank as the one that did not arrive."""
    first, second = (r[5] for r in failures)
    assert second["caught"] == ("RuntimeError", "boom on rank 1 at chunk 5"), second["caught"]
    assert second["open"] == 1  # chunk 1's gradient exchange
    kind, msg = first["caught"]
    assert kind == "SPPeerFailure", msg
    assert "world rank 1" in msg and f"timeout {TIMEOUT:g} s" in msg, msg
    assert first["elapsed"] < TIMEOUT + 30


@pytest.fixture(scope="module")
def failures() -> list[dict]:
    return run_distributed(_raises_mid_forward, 2, timeout=300)


def test_ranks_disagreeing_on_sync_exchanges_raise_on_every_rank(failures) -> None:
    first, second = (r["disagree"] for r in failures)
    assert first == second and first[0] == "SPAgreementError", first
    assert "sync_exchanges: rank 0 has 1, rank 1 has 0" in first[1], first[1]
