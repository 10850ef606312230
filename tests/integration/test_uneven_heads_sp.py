"""Sequence parallelism over SP sizes that do not divide the heads (issue 51, item 1), on real gloo processes.

Shapes of the models people finetune, at tiny widths (head dim 8): Qwen2.5-7B's 28 query heads over 4 KV heads and
Phi-4's 40 over 10, at SP 8 (8 processes): query heads 4,4,4,4,3,3,3,3 and 5 each; a rank receives the 1 or 2 KV
heads its query heads use (:mod:`hf_fpdt.data.head_split`). And 4 / 2 heads at SP 3 (2,1,1 query heads; KV
head 1 on two ranks). Checked, fp32, against one process:

* attention alone (:func:`hf_fpdt.fpdt_attention`, with and without attention sinks): the output and the gradients
  of q, k, v (and the sinks) equal a float64 reference (sinks: one process's fpdt) within 1e-5 relative;
* the uneven all-to-all is the adjoint of its reverse (``<scatter(x), y> = <x, gather(y)>`` over the group: the
  gradients of a KV head several ranks hold are summed exactly once each), and moves the sizes
  :meth:`HeadSplit.exchange_elements` states;
* ``hf_fpdt.apply`` on the two models *in one process* (a Qwen2-shaped and a Phi-3-shaped one, their forwards and
  backwards interleaved, so no head count of one leaks into the other), under activation checkpointing: the loss
  and every parameter gradient equal one process's sdpa step (max error over the reference's largest value
  <= 1e-5);
* ``FPDTTrainer`` with LoRA on each model (``FPDTPlugin(sp_size=8)``): one SGD step's loss and every LoRA gradient
  equal HF ``Trainer``'s at one process.

And at SP 3 (3 processes, 2,1,1 query heads of tiny Llama's 4 over 2 KV heads; 5 / 1 and 8 / 4 heads in the
attention alone): the same attention checks, the synchronous exchange order bit-identical to the overlapped one, and
``generate()`` with its sequence-parallel prefill (left padding) giving one process's greedy tokens and scores.

The 8-process world runs once per session (:func:`_sp8`), each test reading its results.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_distributed
from standins import reference_attention
from testkit import rel_err, tiny_model, trainer_step

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.data.head_split import HeadSplit
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.all_to_all import start_gather_heads_split, start_scatter_heads_split
from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

pytestmark = pytest.mark.multiprocess  # every test here starts processes; the 8-process ones are slow too

D, CHUNK, SEQ, BATCH = 8, 32, 70, 2
RTOL = 1e-5
SHAPES = {"qwen2.5-7b": ("qwen2", 28, 4), "phi-4": ("phi3", 40, 10)}  # model type, heads, KV heads


def _config(name: str):
    from transformers import AutoConfig

    model_type, heads, kv = SHAPES[name]
    return AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=heads * D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        **({"pad_token_id": 0} if model_type == "phi3" else {}),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :20] = IGNORE_INDEX  # a prompt: fewer targets in sample 0
    return ids, labels


def _attention(rank: int, world: int, heads: int, kv: int, sinks: bool, sync: bool | None = None) -> dict:
    """This rank's fpdt attention output and gradients vs the reference, as relative errors (``sync``: and whether
    the synchronous exchange order gives the same bits as the overlapped one)."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(heads * 100 + kv)
    q, k, v, dout = (torch.randn(BATCH, SEQ, n, D, generator=g) for n in (heads, kv, kv, heads))
    s = torch.randn(heads, generator=g) if sinks else None
    index = shard_batch(torch.zeros(BATCH, SEQ, dtype=torch.long), None, rank=rank, sp_size=world, chunk_size=CHUNK)
    index = index.index
    pad = world * index.numel() - SEQ
    q, k, v, dout = (torch.cat([t, t.new_zeros(BATCH, pad, *t.shape[2:])], 1) if pad else t for t in (q, k, v, dout))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=CHUNK, offload=True), group=group)
    mine = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
    mine_s = s.clone().requires_grad_() if sinks else None
    out = fpdt_attention(*mine, runtime, sinks=mine_s)
    out.backward(dout[:, index])
    same = None
    if sync:
        serial = FPDTRuntime(FPDTConfig(chunk_size=CHUNK, offload=True, sync_exchanges=True), group=group)
        again = [t.detach().clone().requires_grad_() for t in mine]
        out2 = fpdt_attention(*again, serial)
        out2.backward(dout[:, index])
        same = torch.equal(out2, out) and all(torch.equal(a.grad, b.grad) for a, b in zip(again, mine))
    if sinks:  # the reference: one process's fpdt (sinks are checked against eager in test_sinks_sp)
        one = FPDTRuntime(FPDTConfig(chunk_size=CHUNK, offload=True))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        full_s = s.clone().requires_grad_()
        ref = fpdt_attention(*full, one, sinks=full_s)
        ref.backward(dout)
        refs = (ref.detach(), *(t.grad for t in full))
        sink_grad = mine_s.grad.clone()
        dist.all_reduce(sink_grad)  # each rank's heads: the group's sum completes it
        sink_err = rel_err(sink_grad, full_s.grad)
    else:
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(q64, k64, v64, D**-0.5)
        ref.backward(dout.double())
        refs = (ref.detach(), q64.grad, k64.grad, v64.grad)
        sink_err = 0.0
    ours = (out.detach(), *(t.grad for t in mine))
    return {"errors": [rel_err(a, r[:, index]) for a, r in zip(ours, refs)] + [sink_err], "same": same}


def _adjoint(rank: int, world: int, heads: int, kv: int) -> dict:
    """``<scatter(x), y>`` and ``<x, gather(y)>`` summed over the group (equal: the gather is the adjoint), and
    the elements this rank sent and received."""
    group = dist.group.WORLD
    split = HeadSplit.of(heads, kv, world)
    g = torch.Generator().manual_seed(rank)
    n = 3
    xs = [torch.randn(BATCH, n, h, d, generator=g, dtype=torch.float64) for h, d in ((heads, D), (kv, D), (kv, 4))]
    kinds = (False, True, True)
    sizes = {}
    real = dist.all_to_all_single

    def sized(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        sizes.setdefault("sent", inp.numel())
        sizes.setdefault("received", out.numel())
        return real(out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, **kw)

    dist.all_to_all_single = sized
    try:
        ys_shape = start_scatter_heads_split(xs, group, split, kinds).wait()
    finally:
        dist.all_to_all_single = real
    ys = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ys_shape]
    back = start_gather_heads_split(ys, group, split, kinds).wait()
    lhs = sum((a * b).sum() for a, b in zip(ys_shape, ys))
    rhs = sum((a * b).sum() for a, b in zip(xs, back))
    both = torch.stack([lhs, rhs])
    dist.all_reduce(both)
    shapes = [tuple(t.shape) for t in ys_shape]
    return {"inner": both.tolist(), "shapes": shapes, **sizes}


def _apply_two_models(rank: int, world: int, states: dict) -> dict:
    """Both models applied in this process, their steps interleaved: loss and summed gradients of each."""
    group = dist.group.WORLD
    ids, labels = _data()
    shard = shard_batch(ids, labels, rank=rank, sp_size=world, chunk_size=CHUNK)
    models = {}
    for name, state in states.items():
        model = tiny_model(_config(name), state=state)
        model = hf_fpdt.apply(model, FPDTConfig(chunk_size=CHUNK), group=group)
        model.gradient_checkpointing_enable()
        model.train()
        models[name] = model
    outs = {name: m(**shard.model_kwargs()) for name, m in models.items()}  # both forwards, then both backwards
    for out in outs.values():
        out.loss.backward()
    result = {}
    for name, model in models.items():
        reduce_gradients(model.parameters(), group)
        result[name] = {
            "loss": global_loss(outs[name].loss, group),
            "grads": {n: p.grad for n, p in model.named_parameters()},
        }
    return result


def _lora(model):
    from peft import LoraConfig, get_peft_model

    fused = model.config.model_type == "phi3"  # Phi-3's fused qkv_proj
    targets = ["qkv_proj", "o_proj"] if fused else ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, config)


def _trainer_step(name: str, output_dir: str, state: dict, fpdt=None) -> dict:
    """One SGD step of (FPDT)Trainer on model ``name`` with LoRA: its loss and the LoRA gradients."""
    ids, _ = _data()
    torch.manual_seed(0)
    model = _lora(tiny_model(_config(name), state=state))
    return trainer_step(model, ids, BATCH, output_dir, fpdt)


def _worker(rank: int, world: int, states: dict, port: int) -> dict:
    out = {
        "adjoint": {name: _adjoint(rank, world, h, kv) for name, (_, h, kv) in SHAPES.items()},
        "attention": {
            (name, sinks): _attention(rank, world, h, kv, sinks)
            for name, (_, h, kv) in SHAPES.items()
            for sinks in (False, True)
        },
        "apply": _apply_two_models(rank, world, states),
    }
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    out["trainer"] = {}
    for name, state in states.items():
        plugin = hf_fpdt.FPDTPlugin(sp_size=world, chunk_size=CHUNK, offload=True)
        out["trainer"][name] = _trainer_step(name, f"/tmp/uneven_heads_{name}_{rank}", state, plugin)
    return out


def _generate(model, ids, mask):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip


SP3_SHAPES = ((4, 2), (5, 1), (8, 4))


def _sp3_worker(rank: int, world: int) -> dict:
    import copy

    out = {
        "attention": {shape: _attention(rank, world, *shape, False, sync=True) for shape in SP3_SHAPES},
        "sinks": _attention(rank, world, 4, 2, True),
    }
    ref = tiny_model("tiny-llama", "sdpa").eval()  # 4 heads / 2 KV heads over 3 ranks: 2, 1, 1
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=16), group=dist.group.WORLD)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 500, (2, 41), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7], ids[1, :7] = 0, 0  # left padding
    want, got = _generate(ref, ids, mask), _generate(model, ids, mask)
    out["generate"] = {
        "equal": torch.equal(got.sequences, want.sequences),
        "scores": rel_err(torch.stack(got.scores), torch.stack(want.scores)),
        "cached": got.past_key_values.layers[0].keys.shape[-2],
    }
    return out


@functools.cache
def _sp3() -> list[dict]:
    return run_distributed(_sp3_worker, 3, timeout=600)


@pytest.mark.slow
def test_sp3_attention_and_generation_over_uneven_heads():
    for rank, r in enumerate(_sp3()):
        for shape in SP3_SHAPES:
            got = r["attention"][shape]
            assert max(got["errors"]) <= RTOL and got["same"], (rank, shape, got)
        assert max(r["sinks"]["errors"]) <= RTOL, (rank, r["sinks"])
        gen = r["generate"]
        assert gen["equal"] and gen["scores"] < RTOL, (rank, gen)
        assert gen["cached"] == 14 + 6 - 1, gen  # this rank's share of the 41-token prompt (padded to 42)


def _states() -> dict:
    return {name: tiny_model(_config(name)).state_dict() for name in SHAPES}


@functools.cache
def _sp8() -> list[dict]:
    return run_distributed(_worker, 8, _states(), free_port(), timeout=900)


def _close(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for n, r in ref.items():
        err = (got[n].double() - r.double()).abs().max().item() / max(r.abs().max().item(), 1e-30)
        assert err <= RTOL, f"{what}: {n} max error {err:.2e} over its largest value"


@pytest.mark.slow
def test_the_uneven_exchange_is_the_adjoint_of_its_reverse_and_moves_what_the_split_states():
    for rank, r in enumerate(_sp8()):
        for name, (_, heads, kv) in SHAPES.items():
            got = r["adjoint"][name]
            lhs, rhs = got["inner"]
            assert abs(lhs - rhs) <= 1e-9 * abs(lhs), (name, got["inner"])
            split = HeadSplit.of(heads, kv, 8)
            assert [s[2] for s in got["shapes"]] == [split.counts[rank], *[split.kv_counts[rank]] * 2]
            sent, received = split.exchange_elements(rank, D, D)
            per_token = BATCH * 3  # the adjoint's chunk: BATCH x 3 local tokens; v's head dim is 4, not D
            v_extra = -sum(split.kv_sent) * (D - 4), -8 * split.kv_sent[rank] * (D - 4)
            assert got["sent"] == per_token * (sent + v_extra[0]), (name, rank)
            assert got["received"] == per_token * (received + v_extra[1]), (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_attention_alone_at_sp8_equals_one_process(name, sinks):
    for r in _sp8():
        assert max(r["attention"][name, sinks]["errors"]) <= RTOL, r["attention"][name, sinks]


@pytest.mark.slow
def test_apply_two_models_in_one_process_at_sp8_equal_one_process_each():
    ids, labels = _data()
    for name, state in _states().items():
        model = tiny_model(_config(name), state=state)
        model.train()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        ref = {n: p.grad for n, p in model.named_parameters()}
        for rank, r in enumerate(_sp8()):
            got = r["apply"][name]
            assert abs(got["loss"].item() - out.loss.item()) <= RTOL * abs(out.loss.item()), (name, rank)
            _close(got["grads"], ref, f"{name} rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_fpdt_trainer_with_lora_at_sp8_equals_one_process(tmp_path, name):
    ref = _trainer_step(name, str(tmp_path / "one"), _states()[name])
    assert ref["grads"] and all(g.abs().max() > 0 for g in ref["grads"].values())
    for rank, r in enumerate(_sp8()):
        got = r["trainer"][name]
        assert abs(got["loss"][0] - ref["loss"][0]) <= RTOL * abs(ref["loss"][0]), (rank, got["loss"], ref["loss"])
        _close(got["grads"], ref["grads"], f"trainer rank {rank}")
