"""Every rank issues the same collectives in the same order (issue 49, item 3).

Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps each process group in a checker (``ProcessGroupWrapper``) that,
before every collective, compares the op, its sequence number and its tensors' shapes, dtypes and devices across the
group's ranks and raises on the first difference (``Detected mismatch between collectives on ranks``): a collective
issued in another order, or skipped, on one rank fails there instead of hanging or exchanging the wrong tensors.

The checker compares no shapes for all-to-alls (uneven splits are legal there), so each rank also records every
collective it issues (name, tensor shapes and dtypes, split sizes, ops) and the two records must be equal, entry by
entry. On 2 gloo ranks: an SP training step through ``apply`` (LoRA, non-reentrant checkpointing, offload, a prompt
without targets and right padding) and one with packed documents, the gradients reduced and the loss logged, then
SP ``generate()`` with left padding. And the checker's own contract on this torch: a reorder on one rank raises.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from peft import LoraConfig, get_peft_model
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.groups import build_groups
from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SEQ, CHUNK = 70, 16


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 500, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :20] = IGNORE_INDEX  # a prompt
    labels[1, -5:] = IGNORE_INDEX  # right padding
    positions = torch.cat([torch.arange(30), torch.arange(SEQ - 30)]).expand(2, -1)  # two packed documents
    return ids, labels, positions


COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier", "monitored_barrier",
)  # fmt: skip


def _shapes(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype))
    if isinstance(x, (list, tuple)):
        return [_shapes(i) for i in x]
    if isinstance(x, dist.ProcessGroup):
        return ("group of", dist.get_world_size(x))
    return "a function" if isinstance(x, types.FunctionType) else repr(x)  # a ReduceOp: its name


def _record(log: list) -> None:
    """Every collective this process issues, appended to ``log`` as (name, its arguments' shapes and values)."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def call(*args, _name=name, _real=real, **kwargs):
            log.append((_name, _shapes(list(args)), sorted((k, _shapes(v)) for k, v in kwargs.items())))
            return _real(*args, **kwargs)

        setattr(dist, name, call)


def _steps(rank: int, world_size: int, state: dict) -> dict:
    log: list = []
    _record(log)  # this spawned process only
    groups = build_groups(world_size)
    ids, labels, positions = _batch()
    out = {}
    for name, pos in (("plain", None), ("documents", positions)):
        shard = shard_batch(ids, labels, rank=groups.sp_rank, sp_size=world_size, chunk_size=CHUNK, position_ids=pos)
        base = tiny_model("tiny-llama", state=state)
        lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
        model = hf_fpdt.apply(lora, hf_fpdt.FPDTConfig(chunk_size=CHUNK, offload=True), group=groups.sp)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        loss = model(**shard.model_kwargs()).loss
        loss.backward()
        reduce_gradients([p for p in model.parameters() if p.requires_grad], groups.sp, groups.dp)
        out[name] = global_loss(loss, groups.sp, groups.dp)
    ref = tiny_model("tiny-llama", "sdpa", state=state).eval()
    model = hf_fpdt.apply(ref, hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=groups.sp)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    out["generated"] = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    out["log"] = log
    return out


def _reordered(rank: int, world_size: int) -> None:
    ops = [lambda: dist.all_reduce(torch.ones(4)), lambda: dist.broadcast(torch.ones(3), 0)]
    for op in ops if rank == 0 else ops[::-1]:
        op()


def test_a_step_and_generation_issue_the_same_collectives_on_every_rank(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the spawned ranks inherit it
    state = tiny_model("tiny-llama").state_dict()
    ranks = run_distributed(_steps, 2, state)
    logs = [r["log"] for r in ranks]
    assert len(logs[0]) > 50 and any(entry[0] == "all_to_all_single" for entry in logs[0]), logs[0][:5]
    first = next((i for i, (a, b) in enumerate(zip(*logs)) if a != b), None)
    assert first is None and len(logs[0]) == len(logs[1]), (
        f"the ranks' collectives differ at #{first}: {logs[0][first - 1 : first + 2] if first else ''} vs "
        f"{logs[1][first - 1 : first + 2] if first else ''} ({len(logs[0])} and {len(logs[1])} in all)"
    )
    for key in ("plain", "documents", "generated"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        assert ranks[0][key].isfinite().all() if key != "generated" else ranks[0][key].shape == (2, SEQ + 3)


def test_the_check_catches_a_collective_issued_in_another_order_on_one_rank(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(RuntimeError, match="Detected mismatch between collectives on ranks"):
        run_distributed(_reordered, 2)
