"""Every registered family through ``hf_fpdt.apply``: one training step equals HF eager, chunked for real.

Per family a tiny config (fp32, two layers, GQA, head_dim 8) with the family's special pieces switched
on (fused qkv and partial rotary for Phi-3, Granite's multipliers, SmolLM3's NoPE layer, ...) runs one
forward + backward with labels; loss and every parameter gradient must equal HF's eager attention. The
same step runs under a ``TorchDispatchMode`` that sees every aten op: no tensor may have the sequence
dimension together with the intermediate, 2 x intermediate or vocabulary dimension, and no attention
kernel call may take more than one chunk of queries (the check flags an untiled model, see the control).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from families import (
    BATCH,
    CHUNK,
    COMMON,
    CONFIG,
    FAMILIES,
    INTER,
    SEQ,
    VOCAB,
    assert_same,
    family_batch,
    family_config,
    family_model,
    recorded_step,
    train_step,
    violations,
)
from testkit import tiny_model
from transformers import AutoConfig

import hf_fpdt


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_step_equals_eager_and_is_chunked(model_type):
    ref = family_model(family_config(model_type))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a registered family gets no partial-support warning
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    batch = family_batch()
    got, rec = recorded_step(model, batch)
    assert_same(train_step(ref, batch), got)
    assert rec.queries, "no chunked attention kernel ran"
    if "router_aux_loss_coef" in ref.config:
        out = model(**batch)
        assert out.aux_loss is not None and len(out.router_logits) == ref.config.num_hidden_layers
    assert violations(rec, ref.config.intermediate_size) == []


def test_recorder_flags_an_unchunked_model():
    """Control: HF's own model (sdpa over the whole sequence, full MLP and logits) fails every check."""
    model = tiny_model(family_config("qwen2"), "sdpa", dtype=None, seed=None).train()
    _, rec = recorded_step(model, family_batch())
    bad = violations(rec, INTER)
    assert any("attention over 45" in b for b in bad) and any("wide" in b for b in bad)
    assert any(s[-1] == VOCAB and BATCH * SEQ in (s[0], s[0] * s[1]) for s in rec.shapes)


def test_models_that_bypass_the_attention_interface_are_refused():
    cfg = AutoConfig.for_model("falcon", **{k: v for k, v in COMMON.items() if k != "head_dim"})
    model = tiny_model(cfg, None, dtype=None, seed=None)
    with pytest.raises(ValueError, match="does not dispatch through HF's attention interface"):
        hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))


# ----------------------------------------------------------------------------- two sequence-parallel processes

SP_CASES = {  # name: (model_type, config overrides, document lengths of a packed row or None)
    "qwen3": ("qwen3", {}, None),  # dense, per-head q/k norms
    "mixtral": ("mixtral", {"output_router_logits": False}, None),  # MoE (HF's aux loss needs the whole sequence)
    "mistral-w20": ("mistral", {"sliding_window": 20}, None),  # a window shorter than the sequence, across ranks
    "llama-packed": ("llama", {}, (13, 20, 12)),  # packed documents in the Fig. 6 layout
}


def _positions(docs, batch: int) -> torch.Tensor | None:
    return None if docs is None else torch.cat([torch.arange(n) for n in docs]).expand(batch, -1)


def _sp_worker(rank: int, world_size: int, states: dict, ids, labels) -> dict:
    import torch.distributed as dist

    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    group = dist.group.WORLD
    results = {}
    for name, (model_type, overrides, docs) in SP_CASES.items():
        model = family_model(family_config(model_type, **overrides))
        model.load_state_dict(states[name])
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6), group=group).train()
        pos = _positions(docs, ids.shape[0])
        shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK, position_ids=pos)
        # packed documents only without a KV cache (HF's rule; the reference's use_cache=False)
        out = model(**shard.model_kwargs(), **({"use_cache": False} if docs else {}))
        out.loss.backward()
        reduce_gradients(model.parameters(), group)
        results[name] = (global_loss(out.loss, group), {n: p.grad for n, p in model.named_parameters()})
    # HF's MoE auxiliary loss averages over the whole sample: refused under SP, on every rank
    model = hf_fpdt.apply(family_model(family_config("mixtral")), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group)
    try:
        model(**shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK).model_kwargs())
    except ValueError as e:
        results["refused"] = str(e)
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_sp_ranks_equal_one_process_dense_moe_windowed_packed():
    from distributed import run_distributed

    batch = family_batch()
    want, states = {}, {}
    for name, (model_type, overrides, docs) in SP_CASES.items():
        ref = family_model(family_config(model_type, **overrides))
        pos = _positions(docs, BATCH)
        want[name] = train_step(ref, {**batch, "position_ids": pos, "use_cache": False} if docs else batch)
        states[name] = ref.state_dict()
    for got in run_distributed(_sp_worker, 2, states, batch["input_ids"], batch["labels"]):
        for name in SP_CASES:
            assert_same(want[name], got[name])
        assert "output_router_logits under sequence parallelism" in got.get("refused", "")
