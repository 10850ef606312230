"""Multi-head latent attention at two sequence-parallel ranks (gloo, real processes, fp32) equals one process.

DeepSeek-V2 (complex RoPE), DeepSeek-V3 (q LoRA) and GLM-4 MoE lite under ``hf_fpdt.apply``: q/k heads of 12 and
v heads of 8 go through the all-to-all (heads scattered, sequence gathered) and the nested backward at different
widths; the compressed KV projection and q LoRA per chunk; the MoE with its shared expert tiled. The logged loss
and every gradient (after ``reduce_gradients``) equal one process's eager step (``tests/mla_hybrids.py``'s tiny
models, 45 tokens, chunk 16, the Fig. 6 layout's padding included). A hybrid (Qwen3-Next) is refused under SP by
name on every rank.
"""

from __future__ import annotations

import pytest
import torch
from families import CHUNK, assert_same, family_batch, train_step
from mla_hybrids import MLA_CASES, hybrid_model, mla_model

import hf_fpdt

pytestmark = pytest.mark.multiprocess

SP_CASES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")


def _worker(rank: int, world_size: int, states: dict, ids, labels) -> dict:
    import torch.distributed as dist

    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    group = dist.group.WORLD
    results = {}
    for name in SP_CASES:
        model_type, overrides = MLA_CASES[name]
        model = mla_model(model_type, **overrides)
        model.load_state_dict(states[name])
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6), group=group).train()
        shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK)
        out = model(**shard.model_kwargs())
        out.loss.backward()
        reduce_gradients(model.parameters(), group)
        results[name] = (global_loss(out.loss, group), {n: p.grad for n, p in model.named_parameters()})
    try:
        hf_fpdt.apply(hybrid_model("qwen3_next"), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group)
    except ValueError as e:
        results["refused"] = str(e)
    return results


@pytest.mark.slow
def test_mla_at_two_sp_ranks_equals_one_process():
    from distributed import run_distributed

    batch = family_batch()
    want, states = {}, {}
    for name in SP_CASES:
        model_type, overrides = MLA_CASES[name]
        torch.manual_seed(0)
        ref = mla_model(model_type, **overrides)
        want[name] = train_step(ref, batch)
        states[name] = ref.state_dict()
    for got in run_distributed(_worker, 2, states, batch["input_ids"], batch["labels"]):
        for name in SP_CASES:
            assert_same(want[name], got[name])
        assert "qwen3_next under sequence parallelism" in got.get("refused", ""), got.get("refused")
