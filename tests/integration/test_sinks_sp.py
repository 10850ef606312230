"""Attention sinks under sequence parallelism: 2 gloo processes equal one (``hf_fpdt.attention.sinks``).

Each rank holds half of the heads after the all-to-all and folds the sinks of its own heads (heads ``r*H/P ..``, the
head scatter's order); its sink gradient covers those heads only, and the SP group's gradient sum (what every
replicated parameter gets) completes it. Checked on gpt-oss under ``apply`` (alternating windows of 20 with chunk 16,
YaRN, MoE experts tiled; HF's auxiliary loss off, as it is refused under SP): the loss and every gradient, the sinks'
included, equal eager on one process, and before the reduction each rank's sink gradient is zero outside its heads.
Generation: gpt-oss with full-attention layers only (SP generation leaves sliding-window models to one process) decodes
eager's greedy tokens, the prompt prefilled sequence-parallel and each step's sink folded once over the group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_distributed
from families import CHUNK, assert_same, family_batch, family_config, family_model, train_step

import hf_fpdt

pytestmark = pytest.mark.multiprocess

TRAIN = {"output_router_logits": False}
FULL = {"output_router_logits": False, "layer_types": ["full_attention", "full_attention"]}


def _prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 112, (2, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    return ids, mask


def _worker(rank: int, world_size: int, states: dict, ids, labels) -> dict:
    import torch.distributed as dist

    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    group = dist.group.WORLD
    model = family_model(family_config("gpt_oss", **TRAIN))
    model.load_state_dict(states["train"])
    model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6), group=group).train()
    shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK)
    out = model(**shard.model_kwargs())
    out.loss.backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith(".sinks")}
    reduce_gradients(model.parameters(), group)
    results = {
        "train": (global_loss(out.loss, group), {n: p.grad for n, p in model.named_parameters()}),
        "local sinks": local,
    }
    ref = family_model(family_config("gpt_oss", **FULL)).eval()
    ref.load_state_dict(states["generate"])
    sp = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group).eval()
    prompt, mask = _prompts()
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    generated = sp.generate(prompt, **kwargs, return_dict_in_generate=True)
    results["generate"] = generated.sequences
    results["cached"] = generated.past_key_values.layers[0].keys.shape[-2]  # this rank's share of the keys
    return results


@pytest.mark.slow
def test_sinks_at_sp2_equal_one_process():
    batch = family_batch()
    ref = family_model(family_config("gpt_oss", **TRAIN))
    want = train_step(ref, batch)
    gen = family_model(family_config("gpt_oss", **FULL)).eval()
    prompt, mask = _prompts()
    tokens = gen.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    states = {"train": ref.state_dict(), "generate": gen.state_dict()}
    ranks = run_distributed(_worker, 2, states, batch["input_ids"], batch["labels"])
    heads = ref.config.num_attention_heads // 2
    for rank, got in enumerate(ranks):
        assert_same(want, got["train"])
        for name, g in got["local sinks"].items():  # this rank's heads only, before the group's sum
            mine = torch.zeros(g.shape, dtype=torch.bool)
            mine[rank * heads : (rank + 1) * heads] = True
            assert g[~mine].abs().max() == 0 and g[mine].abs().min() > 0, (rank, name, g)
        assert torch.equal(got["generate"], tokens), rank
        assert got["cached"] < prompt.shape[1], "the prompt was not prefilled sequence-parallel"
