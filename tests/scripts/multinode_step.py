"""One FPDTPlugin training step on "2 nodes" (launched by ``tests/integration/test_multinode.py``: one
``torchrun --nnodes 2 --node-rank k`` per node on loopback, 2 CPU processes each, gloo).

The plugin builds the groups (``build_groups``, which logs the placement on rank 0); every rank records its
node (torchrun's ``GROUP_RANK``), local rank and SP group, and runs one step of a tiny Llama on its shard. Every
rank also runs the one-process reference (plain ``sdpa``, the whole global batch) and compares the logged loss
and every gradient after DDP's average. Rank 0 writes ``{"ranks": [...], "placement": ..., "loss", "ref_loss",
"max_grad_rel"}`` as JSON to ``argv[1]``; ``argv[2]`` is sp_size.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from testkit import tiny_model
from torch.utils.data import DataLoader
from transformers import default_data_collator

import hf_fpdt
from hf_fpdt.config import IGNORE_INDEX

LENGTHS = (150, 203, 97, 180)  # one sample per DP replica and step; different lengths, different target counts


def samples(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 5] = IGNORE_INDEX  # a prompt without targets
        out.append({"input_ids": ids, "labels": labels})
    return out


def main(out_path: str, sp_size: int) -> None:
    accelerator = Accelerator(cpu=True)
    ref = tiny_model("tiny-llama", "sdpa")
    model = tiny_model("tiny-llama", "sdpa", state=ref.state_dict())
    data = samples(ref.config.vocab_size)

    fpdt = hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=32, offload=True, sp_timeout=60)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=1, shuffle=False, collate_fn=default_data_collator)
    model, optimizer, loader = fpdt.prepare(accelerator, model, optimizer, loader)

    me = {
        "rank": dist.get_rank(),
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "sp_group": dist.get_process_group_ranks(fpdt.groups.sp),
        "dp_group": dist.get_process_group_ranks(fpdt.groups.dp),
        "sp_rank": fpdt.sp_rank,
        "dp_rank": fpdt.dp_rank,
    }
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me)

    batch = next(iter(loader))
    n = fpdt.num_items_in_batch(batch)
    loss = model(**batch, num_items_in_batch=n).loss
    accelerator.backward(loss * fpdt.loss_scale)
    logged = fpdt.global_loss(loss)
    grads = {name: p.grad for name, p in accelerator.unwrap_model(model).named_parameters()}

    # One process, the global batch: DP replica d took sample d (sequential sampler). Samples differ in length,
    # so the reference sums each one's token losses and divides by the targets of the whole batch.
    chosen = data[: fpdt.dp_size]
    total = sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in chosen)
    ref_loss = (
        sum(
            ref(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss
            * int((s["labels"][1:] != IGNORE_INDEX).sum())
            for s in chosen
        )
        / total
    )
    ref_loss.backward()
    worst = 0.0
    for name, p in ref.named_parameters():
        err = (grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)
        worst = max(worst, err.item())
    worst_t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=fpdt.world_group)
    fpdt.release()
    if accelerator.is_main_process:
        placement = fpdt.groups.placement
        result = {
            "ranks": ranks,
            "placement": {"nodes": list(placement.nodes), "line": placement.describe(), "warning": placement.warning()},
            "loss": logged.item(),
            "ref_loss": ref_loss.item(),
            "max_grad_rel": worst_t.item(),
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process groups before interpreter shutdown


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
