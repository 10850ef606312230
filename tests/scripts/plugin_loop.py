"""A custom Accelerate training step with ``FPDTPlugin`` (launched by ``tests/integration/test_plugin.py``).

Every rank also runs the one-process reference itself (plain ``sdpa`` model, the whole global batch)
and compares: the logged loss, and every parameter gradient after the DDP average. Rank 0 writes
``{"loss", "ref_loss", "max_grad_rel", ...}`` as JSON to ``argv[1]``; ``argv[2]`` is sp_size.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from testkit import tiny_model
from torch.utils.data import DataLoader
from transformers import default_data_collator

import hf_fpdt
from hf_fpdt.data.demo import passkey_dataset, word_tokenizer


def main(out_path: str, sp_size: int) -> None:
    accelerator = Accelerator(cpu=True)
    tokenizer = word_tokenizer()
    # Documents of different lengths: DP replicas hold different numbers of targets.
    data = passkey_dataset(tokenizer, 8, 300, seed=0, min_fill=0.5, progress=False).with_format("torch")
    ref = tiny_model()
    model = tiny_model("tiny-llama", None, seed=None)
    model.load_state_dict(ref.state_dict())

    fpdt = hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=64, offload=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=1, shuffle=False, collate_fn=default_data_collator)
    model, optimizer, loader = fpdt.prepare(accelerator, model, optimizer, loader)

    batch = next(iter(loader))
    n = fpdt.num_items_in_batch(batch)
    loss = model(**batch, num_items_in_batch=n).loss
    accelerator.backward(loss * fpdt.loss_scale)
    logged = fpdt.global_loss(loss)
    grads = {name: p.grad for name, p in accelerator.unwrap_model(model).named_parameters()}

    # One process, the global batch: DP replica d took sample d (sequential sampler).
    full = default_data_collator([data[i] for i in range(fpdt.dp_size)])
    ref_loss = ref(input_ids=full["input_ids"], labels=full["labels"]).loss
    ref_loss.backward()
    worst = 0.0
    for name, p in ref.named_parameters():
        err = (grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)
        worst = max(worst, err.item())
    worst_t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=fpdt.world_group)
    samples = torch.tensor([fpdt.dp_rank], dtype=torch.int64)
    gathered = [torch.zeros_like(samples) for _ in range(fpdt.world_size)]
    dist.all_gather(gathered, samples, group=fpdt.world_group)
    pools_before = [len(getattr(h(), "_stores", {})) for h in fpdt._pools if h() is not None]
    fpdt.release()
    if accelerator.is_main_process:
        result = {
            "loss": logged.item(),
            "ref_loss": ref_loss.item(),
            "max_grad_rel": worst_t.item(),
            "dp_rank_of_each_rank": [int(t.item()) for t in gathered],
            "pools_before_release": pools_before,
            "pools_after_release": [len(getattr(h(), "_stores", {})) for h in fpdt._pools if h() is not None],
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process groups before interpreter shutdown


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
