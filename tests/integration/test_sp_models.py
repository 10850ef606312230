"""Sequence parallelism across real processes (gloo, CPU, fp32) equals one-process ``sdpa``.

Every world runs tiny Llama (GQA: 4 query heads over 2 KV heads, so SP 4 replicates KV heads) and
tiny GPT-NeoX (partial rotary, biases) on a batch of 2 samples of 1030 tokens with chunk 128: no chunk
divides the length, padding is needed at SP 4, and one sample has a prompt without targets. Checked:
the logged loss (:func:`hf_fpdt.distributed.sp_loss.global_loss`), every parameter gradient after
:func:`hf_fpdt.distributed.sp_loss.reduce_gradients`, and the logits gathered back with
:func:`hf_fpdt.data.layout.gather_sequence` (from a model in training and in evaluation mode, the config's
``use_cache=True`` left as is). With dp 2 x sp 2 also the DDP rule (loss x sp under a real
``DistributedDataParallel`` averaging over the whole world). ``dist.barrier`` raises during the steps.
The SP step checkpoints its layers (non-reentrant), so the recomputation's replay of the attention
output through the all-to-all is covered; the DDP step runs without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model
from torch.nn.parallel import DistributedDataParallel

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, SPShard, gather_sequence, shard_batch
from hf_fpdt.distributed.groups import ParallelGroups, build_groups
from hf_fpdt.distributed.sp_loss import ddp_loss_scale, global_loss, reduce_gradients

pytestmark = pytest.mark.multiprocess  # every test here starts processes

PRESETS = ("tiny-llama", "tiny-neox")
SEQ_LEN, CHUNK, BATCH = 1030, 128, 2
RTOL = 1e-5


def _data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[dp, BATCH, SEQ_LEN]`` ids and labels: one batch per DP replica."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (dp, BATCH, SEQ_LEN), generator=g)
    labels = ids.clone()
    labels[:, 0, :300] = IGNORE_INDEX  # a prompt: fewer valid targets in sample 0
    labels[:, 1, -7:] = IGNORE_INDEX  # right padding of a shorter sample
    return ids, labels


def _reference(preset: str, state: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """One process, sdpa: the DP mean of each replica's batch loss, its gradients, each replica's logits."""
    model = tiny_model(preset, state=state)
    losses, logits = [], []
    for d in range(ids.shape[0]):
        out = model(input_ids=ids[d], labels=labels[d])
        losses.append(out.loss)
        logits.append(out.logits.detach())
    loss = torch.stack(losses).mean()
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}, "logits": logits}


def _sp_steps(
    rank: int, world_size: int, sp_sizes: tuple, cases: dict, ids: torch.Tensor, labels: torch.Tensor
) -> dict:
    """One training step per SP size and preset on this rank: ``{sp_size: {preset: results, "groups": ...}}``."""
    return {sp: _sp_step(sp, cases, ids, labels) for sp in sp_sizes}


def _members(groups: ParallelGroups) -> dict:
    """World ranks in this rank's SP and DP groups (all-gathered over each), and its coordinates."""
    out = {"sp_rank": groups.sp_rank, "dp_rank": groups.dp_rank, "sizes": (groups.sp_size, groups.dp_size)}
    for name in ("sp", "dp"):
        group = getattr(groups, name)
        ranks = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, torch.tensor(dist.get_rank()), group=group)
        out[name] = [int(r) for r in ranks]
        out[name + "_group_rank"] = dist.get_rank(group)
    return out


def _sp_step(sp_size: int, cases: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    groups = build_groups(sp_size)
    ids, labels = ids[groups.dp_rank], labels[groups.dp_rank]
    shard = shard_batch(ids, labels, rank=groups.sp_rank, sp_size=sp_size, chunk_size=CHUNK)
    results = {"groups": _members(groups)}
    barrier, dist.barrier = dist.barrier, _no_barrier  # this worker process only
    try:
        for preset, state in cases.items():
            results[preset] = _preset_step(preset, state, groups, shard)
    finally:
        dist.barrier = barrier
    return results


def _no_barrier(*args, **kwargs) -> None:
    raise AssertionError("dist.barrier() was called during a training step; FPDT's chunk loops must not call it")


def _preset_step(preset: str, state: dict, groups: ParallelGroups, shard: SPShard) -> dict:
    """One training step of ``preset`` on this rank's shard (and, with DP, the same step under DDP)."""
    model = hf_fpdt.apply(tiny_model(preset, state=state), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=groups.sp)
    model.gradient_checkpointing_enable()  # non-reentrant: the recomputation replays the attention output
    model.train()
    out = model(**shard.model_kwargs())
    out.loss.backward()
    reduce_gradients(model.parameters(), groups.sp, groups.dp)
    res = {
        "loss": global_loss(out.loss, groups.sp, groups.dp),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }
    with torch.no_grad():  # with labels the tiled LM head returns no logits: ask for them separately
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        model.eval()  # the config's use_cache=True: no cache HF would make may send a rank to its own keys only
        eval_logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    res["logits"] = gather_sequence(logits, groups.sp, SEQ_LEN, CHUNK)
    res["eval_logits"] = gather_sequence(eval_logits, groups.sp, SEQ_LEN, CHUNK)
    if groups.dp_size > 1:  # the DDP rule: loss x sp, DDP averages over all dp * sp ranks
        ddp_model = hf_fpdt.apply(
            tiny_model(preset, state=state), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=groups.sp
        )
        ddp = DistributedDataParallel(ddp_model)
        out = ddp(**shard.model_kwargs())
        (out.loss * ddp_loss_scale(groups.sp)).backward()
        res["ddp_grads"] = {n: p.grad for n, p in ddp_model.named_parameters()}
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def cases() -> dict:
    return {p: tiny_model(p).state_dict() for p in PRESETS}


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    return _data(dp=2)


@pytest.fixture(scope="module")
def world4(cases, data) -> list[dict]:
    """One 4-process run serves both 4-process worlds: sp 4, and dp 2 x sp 2."""
    return run_distributed(_sp_steps, 4, (4, 2), cases, *data)


def _check(per_rank: list[dict], sp_size: int, cases: dict, data: tuple) -> None:
    world_size = len(per_rank)
    dp = world_size // sp_size
    ids, labels = (t[:dp] for t in data)
    for preset, state in cases.items():
        ref = _reference(preset, state, ids, labels)
        for rank, results in enumerate(per_rank):
            res, where = results[sp_size][preset], f"{preset} rank {rank} (world {world_size}, sp {sp_size})"
            assert _rel(res["loss"], ref["loss"]) < RTOL, where
            assert _rel(res["logits"], ref["logits"][rank // sp_size]) < RTOL, where
            assert _rel(res["eval_logits"], ref["logits"][rank // sp_size]) < RTOL, where
            for key in ("grads", "ddp_grads") if dp > 1 else ("grads",):
                assert res[key].keys() == ref["grads"].keys()
                for name, g in ref["grads"].items():
                    assert _rel(res[key][name], g) < RTOL, f"{where}: {key} {name} off by {_rel(res[key][name], g)}"


def test_sp2_equals_one_process(cases, data):
    _check(run_distributed(_sp_steps, 2, (2,), cases, *data), 2, cases, data)


def test_sp4_equals_one_process(world4, cases, data):
    _check(world4, 4, cases, data)


def test_dp2_x_sp2_equals_one_process(world4, cases, data):
    _check(world4, 2, cases, data)


@pytest.mark.parametrize("sp_size", [4, 2])
def test_world4_groups(world4, sp_size):
    dp = 4 // sp_size
    for rank, results in enumerate(world4):
        got = results[sp_size]["groups"]
        first = rank - rank % sp_size
        assert got["sizes"] == (sp_size, dp)
        assert got["sp"] == list(range(first, first + sp_size))
        assert got["dp"] == list(range(rank % sp_size, 4, sp_size))
        assert got["sp_rank"] == got["sp_group_rank"] == rank % sp_size
        assert got["dp_rank"] == got["dp_group_rank"] == rank // sp_size
