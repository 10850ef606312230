"""sdpa's semantics at the edges under sequence parallelism (issue 29, items 2 and 6): two gloo ranks run
``hf_fpdt.apply``'s tiny Llama on ``shard_batch``'s shards, as a user of the plugin or the collator does, and
each case ends as one process with ``sdpa`` does, or in a clear error on both ranks:

* packed ``position_ids`` (restarting at 0) with the model's default ``use_cache=True``: HF makes its cache and
  attends the row as one sequence, so does fpdt (it took them as documents: gradients 2.24 off); with
  ``use_cache=False`` they are documents, as in HF;
* reversed ``position_ids``: a ``ValueError`` naming them on both ranks (the SP layout check);
* every label ignored: the loss NaN on every rank, as one process (it was 0.0), and zero gradients;
* labels out of the vocabulary, or of a float dtype: a ``ValueError`` naming labels on both ranks; out of the
  vocabulary on one rank's shard only: that ``ValueError`` there, ``SPPeerFailure`` naming it on the other.

One process: ``tests/unit/test_sdpa_edges.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

pytestmark = pytest.mark.multiprocess  # every test here starts processes

S, CHUNK, VOCAB = 50, 8, 512  # at SP 2: global chunks of 16 tokens, 4 of them (the last one short)
RTOL = 1e-5


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :7] = IGNORE_INDEX  # a prompt
    return ids, labels


def _restarting() -> torch.Tensor:
    return torch.cat([torch.arange(23), torch.arange(S - 23)]).expand(2, S)


def _sp_step(state: dict, ids, labels, positions=None, **extra) -> tuple[torch.Tensor, dict]:
    """One training step of this rank on its shard: the group's loss and summed gradients."""
    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    model = hf_fpdt.apply(tiny_model("tiny-llama", state=state), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group)
    shard = shard_batch(ids, labels, rank=rank, sp_size=size, chunk_size=CHUNK, position_ids=positions)
    out = model.train()(**shard.model_kwargs(), **extra)
    out.loss.backward()
    reduce_gradients(model.parameters(), group)
    return global_loss(out.loss, group), {n: p.grad for n, p in model.named_parameters()}


def _error(fn, *args, **kwargs) -> str:
    """The error ``fn`` raises on this rank, as ``"<type>: <message>"`` ("" if none)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _worker(rank: int, world_size: int, state: dict) -> dict:
    ids, labels = _batch()
    results = {
        "packed, default cache": _sp_step(state, ids, labels, _restarting()),
        "packed, use_cache=False": _sp_step(state, ids, labels, _restarting(), use_cache=False),
        "all ignored": _sp_step(state, ids, torch.full_like(labels, IGNORE_INDEX)),
    }
    # errors last: both ranks raise at the same point (the model's input check, or its loss after the forward)
    reversed_positions = torch.arange(S - 1, -1, -1).expand(2, S)
    results["reversed"] = _error(_sp_step, state, ids, labels, reversed_positions)
    bad = labels.clone()
    bad[:, 1:] = 600  # every target of both rows: on both ranks' shards
    results["out of vocabulary"] = _error(_sp_step, state, ids, bad)
    results["float labels"] = _error(_sp_step, state, ids, labels.float())
    # on one rank's shard only (the last case: the group ends that step): the error there, and SPPeerFailure
    # naming it on the other rank (raised in its next collective, backward's, at once)
    bad = labels.clone()
    bad[0, 1:] = 600  # rank 0's copy of the batch: its shard holds some of these targets, rank 1's batch is clean
    results["out of vocabulary on rank 0"] = _error(_sp_step, state, ids, bad if rank == 0 else labels)
    return results


def _reference(state: dict, positions=None, **extra) -> tuple[torch.Tensor, dict]:
    ids, labels = _batch()
    model = tiny_model("tiny-llama", state=state).train()
    out = model(input_ids=ids, labels=labels, position_ids=positions, **extra)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list]:
    state = tiny_model("tiny-llama").state_dict()
    return state, run_distributed(_worker, 2, state, timeout=300.0)


def _assert_same(got: tuple, want: tuple) -> None:
    assert abs(float(got[0]) - float(want[0])) <= RTOL * abs(float(want[0])), (got[0], want[0])
    for name, g in want[1].items():
        err = (got[1][name] - g).abs().max().item()
        assert err <= RTOL * g.abs().max().item(), (name, err)


def test_packed_positions_follow_hfs_cache_rule_under_sp(runs):
    state, results = runs
    one_sequence = _reference(state, _restarting())  # HF's default use_cache=True: a cache, no documents
    documents = _reference(state, _restarting(), use_cache=False)
    assert abs(float(one_sequence[0]) - float(documents[0])) > 1e-4  # the two readings differ
    for got in results:
        _assert_same(got["packed, default cache"], one_sequence)
        _assert_same(got["packed, use_cache=False"], documents)


def test_all_labels_ignored_gives_nan_on_every_rank_as_one_process(runs):
    state, results = runs
    ids, labels = _batch()
    want = tiny_model("tiny-llama", state=state)(input_ids=ids, labels=torch.full_like(labels, IGNORE_INDEX)).loss
    assert want.isnan()
    for got in results:
        loss, grads = got["all ignored"]
        assert loss.isnan()  # was 0.0
        assert all(g is not None and not g.any() for g in grads.values())  # zero gradients, as sdpa's


def test_bad_inputs_are_a_clear_error_on_both_ranks(runs):
    _, results = runs
    for got in results:
        assert got["reversed"].startswith("ValueError: position_ids do not follow FPDT's layout")
        assert got["out of vocabulary"].startswith(
            f"ValueError: labels hold 600, outside the vocabulary of {VOCAB} tokens"
        )
        assert got["float labels"].startswith(
            "ValueError: labels must be integer token ids (torch.long), got dtype torch.float32"
        )
    first, second = (got["out of vocabulary on rank 0"] for got in results)
    assert first.startswith("ValueError: labels hold 600")
    assert second.startswith("SPPeerFailure") and "raised ValueError" in second and "labels hold 600" in second
