"""DeepSpeed ZeRO-3 x FPDT sequence parallelism on CPU processes with gloo.

ZeRO-3 partitions every parameter over the world (``stage3_param_persistence_threshold: 0``: none stays
whole, so the LM head, the projections and the MLP all hold shape ``[0]`` outside their modules' forward)
and gathers it around each module's forward and backward. FPDT's tiled pieces get such parameters
delivered (:mod:`hf_fpdt.integrations.deepspeed`) instead of as Function inputs. Each rank's loss is its
share of the sample's loss, scaled by the world size before backward (ZeRO averages over the world).
Three SGD steps at lr 1.0, gradient clipping off: the losses equal one process running HF ``sdpa``.

2 processes (sp 2), full finetuning (PEFT LoRA with activation checkpointing and a frozen head runs
through the example: ``tests/integration/test_example.py``). DeepSpeed's shared-memory all-reduce op is marked
unavailable so that nothing is JIT-compiled (that C++ build takes minutes); gloo carries every collective.

The delivered path itself (parameters reached through their modules, gradients accumulated at the end
of each tiled Function's backward) is also checked on one process without DeepSpeed, per family kind:
loss and every gradient equal HF eager, for full finetuning and for LoRA over a frozen base.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from families import CONFIG, assert_same, family_batch, family_config, family_model, train_step
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.groups import build_groups
from hf_fpdt.integrations import patches as patch_common
from hf_fpdt.memory.replay import DeliveredParams, accumulate, trainable

SEQ, CHUNK, STEPS, LR = 75, 32, 3, 1.0
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 unless told
    "zero_allow_untested_optimizer": True,  # torch's SGD
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 512, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[0, SEQ - 20 :] = IGNORE_INDEX
    return ids, labels


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = tiny_model()
    model = tiny_model("tiny-llama", None, seed=None)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _zero3_sp(rank: int, world: int, sp: int) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build: collectives go over gloo
    deepspeed.init_distributed(dist_backend="gloo")  # joins the harness's process group
    groups = build_groups(sp)
    ref, model = _models()
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=groups.sp)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ZERO3)
    head = engine.module.get_output_embeddings().weight
    partitioned = head.numel() == 0 and tuple(head.ds_shape) == (512, 64)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses, ref_losses = [], []
    for step in range(STEPS):
        ids, labels = _batch(step)
        kwargs = shard_batch(ids, labels, rank=groups.sp_rank, sp_size=sp, chunk_size=CHUNK).model_kwargs()
        kwargs["num_items_in_batch"] = (labels[:, 1:] != IGNORE_INDEX).sum()
        loss = engine(**kwargs).loss
        engine.backward(loss * world)  # ZeRO averages over the world; SP partial gradients must add up
        engine.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item())
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref": ref_losses, "partitioned": partitioned}


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "mixtral"])
@pytest.mark.parametrize("lora", [False, True])
def test_delivered_parameters_equal_hf(monkeypatch, model_type: str, lora: bool) -> None:
    delivered = []

    def deliver(params, grads):  # autograd accumulation, as for DeepSpeed but without the gathering
        delivered.append(len(params))
        accumulate(params, grads)

    deliver_all = lambda modules: DeliveredParams(tuple(trainable(modules)), deliver)  # noqa: E731
    monkeypatch.setattr(patch_common, "zero3_params", deliver_all)
    cfg = family_config(model_type, **({"output_router_logits": False} if lora else {}))
    ref, model = family_model(cfg), family_model(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        try:
            ref, model = (get_peft_model(m, lcfg) for m in (ref, model))
        except ValueError as e:  # PEFT's own refusal, the same without hf_fpdt (peft 0.19 on a fused-expert MoE)
            pytest.skip(f"peft {importlib.metadata.version('peft')} cannot adapt this {model_type}: {e}")
        model.load_state_dict(ref.state_dict())
    hf_fpdt.apply(model, CONFIG)
    assert_same(train_step(ref, family_batch()), train_step(model, family_batch()))
    # per layer the attention's projections and the MLP (or the experts) where they train, and the head unless
    # frozen: with LoRA, what PEFT adapted (peft 0.18 leaves a fused-expert MoE block without adapters)
    layers = (model.get_base_model() if lora else model).base_model.layers
    mlps = sum(any(p.requires_grad for p in layer.mlp.parameters()) for layer in layers)
    assert len(delivered) == cfg.num_hidden_layers + mlps + (0 if lora else 1)
    assert all(delivered)


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero3_with_sp_equals_one_process() -> None:
    results = run_distributed(_zero3_sp, 2, 2, timeout=240)
    first = results[0]
    assert first["partitioned"], "ZeRO-3 must hold the LM head partitioned outside its forward"
    assert all(r["losses"] == first["losses"] for r in results)  # every rank logs the same loss
    assert abs(first["ref"][-1] - first["ref"][0]) > 1e-3  # the steps move the loss: a wrong gradient shows
    for step, (got, want) in enumerate(zip(first["losses"], first["ref"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: zero3 x sp {got} vs one process {want}"


def _zero3_dp_lengths(rank: int, world: int, sp: int) -> str:
    """Data parallelism under ZeRO-3 (sp 1): rank 1's batch is 40 tokens shorter than rank 0's."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    _, model = _models()
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ZERO3)
    ids, labels = _batch(0)
    n = SEQ - 40 * rank  # 2 query chunks against 3: different tile counts
    try:
        engine(input_ids=ids[:, :n], labels=labels[:, :n])
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero3_ranks_with_different_lengths_get_a_value_error() -> None:
    """Every tile gathers its parameters collectively under ZeRO-3: data-parallel ranks with different
    lengths would issue different collectives (gloo aborts, NCCL hangs); each rank gets a ValueError first."""
    for message in run_distributed(_zero3_dp_lengths, 2, 1, timeout=120):
        assert "ZeRO-3 partition group" in message, message
        assert f"local sequence length: rank 0 has {SEQ}, rank 1 has {SEQ - 40}" in message
        assert "pad every batch to one length" in message
