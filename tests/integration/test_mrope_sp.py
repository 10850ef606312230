"""3D rotary positions at two sequence-parallel ranks (gloo, real processes, fp32) equal one process.

Qwen2.5-VL and Qwen3-VL text-only batches with ``position_ids`` ``[3, B, S]`` and ``[4, B, S]`` (each row counting
from its own offset), sharded with ``hf_fpdt.data.layout.shard_batch`` along the last axis, under ``hf_fpdt.apply``
and on the attention-only path (``attn_implementation="fpdt"`` + ``hf_fpdt.configure`` with the group): the logged
loss and every gradient (after ``reduce_gradients``) equal one process's eager step (45 tokens, chunk 16).
"""

from __future__ import annotations

import pytest
from families import CHUNK, family_batch, train_step
from vl_text import VL, assert_same_text, mrope_positions, vl_model

import hf_fpdt

pytestmark = pytest.mark.multiprocess

CASES = [(model_type, rows) for model_type in VL for rows in (3, 4)]


def _worker(rank: int, world_size: int, states: dict, ids, labels) -> dict:
    import torch.distributed as dist

    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    group = dist.group.WORLD
    config = hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6)
    results = {}
    for model_type, rows in CASES:
        pos = mrope_positions(*ids.shape, rows)
        shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK, position_ids=pos)
        for path in ("apply", "attention-only"):
            if path == "apply":
                model = hf_fpdt.apply(vl_model(model_type, state=states[model_type]), config, group=group)
                out = model(**shard.model_kwargs())
            else:  # HF's own loss over this rank's shard, summed over the ranks (the attention-only path's rule)
                model = hf_fpdt.configure(vl_model(model_type, "fpdt", state=states[model_type]), config, group)
                out = model(input_ids=shard.input_ids, position_ids=shard.position_ids)
                out = _shard_loss(out.logits, shard)
            loss = out.loss if path == "apply" else out
            loss.backward()
            reduce_gradients(model.parameters(), group)
            results[model_type, rows, path] = (
                global_loss(loss, group),
                {n: p.grad for n, p in model.named_parameters()},
            )
    return results


def _shard_loss(logits, shard):
    """This rank's share of the mean cross-entropy over the whole sample's valid targets."""
    import torch

    from hf_fpdt.distributed.sp_loss import sp_loss

    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), shard.shift_labels.flatten(), reduction="sum", ignore_index=-100
    )
    return sp_loss(loss_sum, shard.num_items_in_batch)


@pytest.mark.slow
def test_mrope_at_two_sp_ranks_equals_one_process():
    from distributed import run_distributed

    batch = family_batch()
    b, s = batch["input_ids"].shape
    want, states = {}, {}
    for model_type in VL:
        ref = vl_model(model_type)
        states[model_type] = ref.state_dict()
        for rows in (3, 4):
            step = train_step(
                vl_model(model_type, state=states[model_type]), {**batch, "position_ids": mrope_positions(b, s, rows)}
            )
            want[model_type, rows] = step
    for got in run_distributed(_worker, 2, states, batch["input_ids"], batch["labels"]):
        for model_type, rows in CASES:
            for path in ("apply", "attention-only"):
                assert_same_text(want[model_type, rows], got[model_type, rows, path])
