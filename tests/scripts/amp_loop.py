"""Training under ``bf16=True`` (autocast bf16) with ``FPDTTrainer`` and ``FPDTSFTTrainer`` (TRL's default
``SFTConfig``: bf16 and gradient checkpointing on), shared by ``tests/unit/test_autocast.py``: the sdpa baselines
(in the test's process) and the fpdt runs (in process at sp 1, launched by ``accelerate launch`` at sp 2).

Launched: ``amp_loop.py OUT_JSON SP_SIZE``; rank 0 writes ``{"trainer": [...], "sft": [...]}``, the loss of
each step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from loop_common import TRAINING, finish
from sft_loop import sft_losses
from testkit import tiny_model
from transformers import Trainer, TrainingArguments


def trainer_data(n: int = 8, length: int = 48) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (n, length), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def trainer_losses(output_dir: str, fpdt=None, bf16: bool = True, steps: int = 3) -> list[float]:
    """Loss of each step of ``Trainer`` (sdpa, ``fpdt=None``) or ``FPDTTrainer`` with ``fpdt``."""
    import hf_fpdt

    model = tiny_model()
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1.0,  # large: every step's loss depends on the previous gradients
        **TRAINING,
        bf16=bf16,
        gradient_checkpointing=True,
    )
    common = dict(model=model, args=args, train_dataset=trainer_data())
    trainer = Trainer(**common) if fpdt is None else hf_fpdt.FPDTTrainer(**common, fpdt=fpdt)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def fpdt_runs(out_dir: str, sp_size: int) -> dict:
    import hf_fpdt

    def plugin():
        return hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=16, offload=True)

    return {
        "trainer": trainer_losses(str(Path(out_dir) / "amp_trainer"), plugin()),
        "sft": sft_losses("plain", str(Path(out_dir) / "amp_sft"), plugin(), bf16=None),
    }


def main(out_path: str, sp_size: int) -> None:
    result = fpdt_runs(str(Path(out_path).parent), sp_size)
    finish(lambda: Path(out_path).write_text(json.dumps(result)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
