"""TRL's fused LM head over whole sequences under SP (:mod:`hf_fpdt.trainers.trl_fused_head`) equals one process.

A preference-style loss (a sigmoid of per-sequence log-probability sums, plus TRL's NLL term) is not a sum of
token terms, so each rank scores its shard and the per-token fields are gathered into the whole sequence;
loss, per-token log-probabilities, entropies and every gradient equal one process with sdpa, at SP 2, SP 4 and
dp 2 x sp 2 (gradients reduced explicitly, and under DDP with the default grad_scale). Bad batches raise on
every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from testkit import tiny_model
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("trl")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import hf_fpdt  # noqa: E402
from hf_fpdt.distributed.agreement import SPAgreementError  # noqa: E402
from hf_fpdt.distributed.groups import build_groups  # noqa: E402
from hf_fpdt.distributed.sp_loss import reduce_gradients  # noqa: E402
from hf_fpdt.trainers.trl_fused_head import install_sp_fused_head  # noqa: E402

pytestmark = pytest.mark.multiprocess

SEQ, CHUNK, BATCH, BETA = 301, 64, 2, 0.5


def _data(dp: int) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (dp, BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 1, -40:] = 0  # right padding of the shorter row
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :, :120] = -100  # the prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(out) -> torch.Tensor:
    sums = out.log_probs.sum(-1)
    return -F.logsigmoid(BETA * (sums[0] - sums[1])) + 0.3 * out.loss


def _reference(state: dict, data: dict) -> dict:
    model = tiny_model(state=state)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    losses, logps, ents = [], [], []
    for d in range(data["input_ids"].shape[0]):
        out = model(**{k: v[d] for k, v in data.items()}, fused_lm_head=True)
        losses.append(_loss(out))
        logps.append(out.log_probs.detach())
        ents.append(out.entropy.detach())
    loss = torch.stack(losses).mean()
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}, "logps": logps,
            "entropy": ents}  # fmt: skip


def _sp_model(state: dict, group, grad_scale=None):
    model = hf_fpdt.apply(tiny_model(state=state), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install_sp_fused_head(model, group, CHUNK, grad_scale=grad_scale)
    return model


def _worker(rank: int, world: int, sp: int, state: dict, data: dict) -> dict:
    groups = build_groups(sp)
    batch = {k: v[groups.dp_rank] for k, v in data.items()}
    model = _sp_model(state, groups.sp, grad_scale=1)
    model.train()
    out = model(**batch, fused_lm_head=True)
    loss = _loss(out)
    loss.backward()
    reduce_gradients(model.parameters(), groups.sp, groups.dp)
    logged = loss.detach().clone()
    if groups.dp_size > 1:
        dist.all_reduce(logged, group=groups.dp)
        logged /= groups.dp_size
    res = {"loss": logged, "grads": {n: p.grad for n, p in model.named_parameters()},
           "logps": out.log_probs.detach(), "entropy": out.entropy.detach()}  # fmt: skip
    if groups.dp_size > 1:  # DDP averages over the world: the default grad_scale (sp_size)
        ddp_model = _sp_model(state, groups.sp)
        ddp = DistributedDataParallel(ddp_model)
        _loss(ddp(**batch, fused_lm_head=True)).backward()
        res["ddp_grads"] = {n: p.grad for n, p in ddp_model.named_parameters()}
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize(("world", "sp"), [(2, 2), (4, 4), (4, 2)])
def test_whole_sequence_fields_equal_one_process(world: int, sp: int) -> None:
    state = tiny_model().state_dict()
    dp = world // sp
    data = _data(dp)
    ref = _reference(state, data)
    results = run_distributed(_worker, world, sp, state, data)
    for rank, res in enumerate(results):
        d = rank // sp
        assert _rel(res["loss"], ref["loss"]) < 1e-5, (rank, res["loss"], ref["loss"])
        assert _rel(res["logps"], ref["logps"][d]) < 1e-5
        assert _rel(res["entropy"], ref["entropy"][d]) < 1e-5
        for name, grad in ref["grads"].items():
            assert _rel(res["grads"][name], grad) < 1e-5, (rank, name)
            if "ddp_grads" in res:
                assert _rel(res["ddp_grads"][name], grad) < 1e-5, (rank, name, "ddp")


def _bad_worker(rank: int, world: int, state: dict, data: dict, case: str) -> str:
    groups = build_groups(world)
    model = _sp_model(state, groups.sp)
    batch = {k: v[0] for k, v in data.items()}
    if case == "other batch" and rank == 1:
        batch["input_ids"] = batch["input_ids"].roll(1, dims=1)
    if case == "4d mask":
        batch["attention_mask"] = torch.ones(BATCH, 1, SEQ, SEQ)
    try:
        model(**batch, fused_lm_head=True)
    except (ValueError, SPAgreementError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [("other batch", "SPAgreementError: .*disagree on the batch the fused LM head scores: input_ids"),
     ("4d mask", "ValueError: a 4D attention_mask under sequence parallelism")],
)  # fmt: skip
def test_bad_batches_raise_on_every_rank(case: str, expected: str) -> None:
    import re

    messages = run_distributed(_bad_worker, 2, tiny_model().state_dict(), _data(1), case)
    for message in messages:
        assert re.match(expected, message), message
