"""Every trainer's whole ``log_history``, shared by ``tests/integration/test_logged_metrics.py``: the one-process
runs (in the test's process, plain HF/TRL trainers with sdpa) and the FPDT trainers (launched at SP 2).

The runs reuse the trainers' own test loops (``sft_loop``, ``dpo_loop``, ``grpo_loop``, ``amp_loop``'s data) for 2
steps. Launched: ``logged_metrics.py OUT_JSON SP_SIZE CHECKPOINT RUN[,RUN...]`` (``CHECKPOINT``: the DPO
checkpoint, :func:`dpo_loop.tiny_checkpoint`); rank 0 writes ``{run: log_history}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from loop_common import TRAINING
from testkit import tiny_model

CHUNK = 16  # a chunk every run's sequences span several of, and whose layout pads them (lengths not multiples)
DPO_CHUNK = 64  # DPO's pairs are longer (140-270 tokens)
STEPS = 2
# run -> what it is; SFT: TRL's padded batches (rows of different lengths, and rows of one length, which the SP
# collator gives no attention_mask), padding-free rows and packed rows
RUNS = ("sft_padded", "sft_padded_equal", "sft_padding_free", "sft_packing", "dpo", "grpo", "trainer")


def equal_rows() -> datasets.Dataset:
    """Three pre-tokenized rows of one length (no padding in any batch), not a multiple of the SP layout's; in
    batches of 2 the second step is the loader's last, uneven batch (one sample). Their targets are only tokens
    that SP rank 1 holds (at SP 2, chunk :data:`CHUNK`): a metric that drops a rank's counts cannot agree."""
    from hf_fpdt.data.chunks import local_token_index

    n, length = 3, 71
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 512, (n, length), generator=g)
    labels = torch.full_like(ids, -100)
    held = local_token_index(length, CHUNK, 2, 1)
    held = held[held < length - 1]  # rank 1's tokens whose next token is a target
    labels[:, held + 1] = ids[:, held + 1]
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def trainer_history(output_dir: str, fpdt=None) -> list[dict]:
    """HF ``Trainer`` (sdpa, ``fpdt=None``) or ``FPDTTrainer``, counting its input tokens
    (``include_num_input_tokens_seen``, hence ``train_tokens_per_second``), evaluated after every step (3 rows in
    batches of 2)."""
    from amp_loop import trainer_data
    from transformers import Trainer, TrainingArguments

    import hf_fpdt

    model = tiny_model()
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1.0,
        **TRAINING,
        include_num_input_tokens_seen=True,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
    )
    data = trainer_data(length=45)  # 45: the layout pads it
    common = dict(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(3)))  # 2 + 1 rows
    trainer = Trainer(**common) if fpdt is None else hf_fpdt.FPDTTrainer(**common, fpdt=fpdt)
    trainer.train()
    return trainer.state.log_history


def history(run: str, output_dir: str, checkpoint: str, fpdt=None) -> list[dict]:
    """The whole ``log_history`` of ``run``; ``fpdt``: an ``FPDTPlugin`` (the FPDT trainer) or None (one process,
    sdpa)."""
    if run.startswith("sft_"):
        from sft_loop import sft_history

        mode = run.removeprefix("sft_")
        data = equal_rows() if mode == "padded_equal" else None
        mode = {"padded": "plain", "padded_equal": "plain"}.get(mode, mode)
        return sft_history(mode, output_dir, fpdt, steps=STEPS, data=data, eval_data=data)
    if run == "dpo":
        from dpo_loop import dpo_run

        return dpo_run("sigmoid", checkpoint, output_dir, fpdt, steps=STEPS)["history"]
    if run == "grpo":
        from grpo_loop import grpo_run

        return grpo_run("lora", output_dir, fpdt)[0]["history"]
    if run == "trainer":
        return trainer_history(output_dir, fpdt)
    raise ValueError(f"unknown run {run!r}; one of {RUNS}")


def main(out_path: str, sp_size: int, checkpoint: str, runs: str) -> None:
    import torch.distributed as dist

    import hf_fpdt

    result = {}
    for run in runs.split(","):
        fpdt = hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=DPO_CHUNK if run == "dpo" else CHUNK)
        result[run] = history(run, str(Path(out_path).parent / f"metrics_{run}"), checkpoint, fpdt)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
