"""FSDP2 (``torch.distributed.fsdp.fully_shard``) x FPDT sequence parallelism on CPU processes with gloo.

Parameters are sharded over the whole world (every SP and DP rank holds a slice, as with ZeRO-3);
each SP group takes one sample of the global batch. Each rank's loss is its share of the global
batch's loss (``num_items_in_batch`` = valid targets of all ranks), scaled by the world size before
backward because FSDP averages gradients over the world (``FPDTPlugin.loss_scale``). Three SGD steps
at a large learning rate: the logged losses equal one process running HF ``sdpa`` on the global batch.
Cases: 2 processes (sp 2) and 4 processes (dp 2 x sp 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch
from hf_fpdt.distributed.groups import build_groups

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SEQ, CHUNK, STEPS, LR = 75, 32, 3, 1.0


def _batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 512, (dp, SEQ), generator=g)
    labels = ids.clone()
    labels[0, SEQ - 20 :] = IGNORE_INDEX  # samples with different target counts
    return ids, labels


def _fsdp_sp(rank: int, world_size: int, sp: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    groups = build_groups(sp)
    dp = world_size // sp
    ref = tiny_model()
    model = tiny_model("tiny-llama", None, seed=None)
    model.load_state_dict(ref.state_dict())
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, offload=True), group=groups.sp)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses, ref_losses = [], []
    for step in range(STEPS):
        ids, labels = _batch(dp, step)
        shard = shard_batch(
            ids[groups.dp_rank : groups.dp_rank + 1],
            labels[groups.dp_rank : groups.dp_rank + 1],
            rank=groups.sp_rank,
            sp_size=sp,
            chunk_size=CHUNK,
        )
        kwargs = shard.model_kwargs()
        kwargs["num_items_in_batch"] = (labels[:, 1:] != IGNORE_INDEX).sum()  # the global batch's targets
        loss = model(**kwargs).loss
        (loss * world_size).backward()  # FSDP averages over the world; SP partial gradients must add up
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the shares of all ranks add up to the global batch's loss
        losses.append(logged.item())
        ref_loss = ref(input_ids=ids, labels=labels).loss  # one process, the whole global batch
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref": ref_losses, "sharded": type(next(model.parameters())).__name__}


@pytest.mark.slow
@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2)])
def test_fsdp2_with_sp_equals_one_process(world: int, sp: int) -> None:
    results = run_distributed(_fsdp_sp, world, sp, timeout=240)
    first = results[0]
    assert first["sharded"] == "DTensor"  # parameters really are sharded by FSDP2
    assert all(r["losses"] == first["losses"] for r in results)  # every rank logs the same global loss
    assert abs(first["ref"][-1] - first["ref"][0]) > 1e-2  # the steps move the loss: a wrong gradient shows
    for step, (got, want) in enumerate(zip(first["losses"], first["ref"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: fsdp2 x sp {got} vs one process {want}"
