"""TRL ``SFTTrainer`` runs shared by ``tests/integration/test_trl.py``: the baseline (in the test's process) and
``FPDTSFTTrainer`` (in process at sp 1, or launched by ``accelerate launch`` at sp 2).

Launched: ``sft_loop.py OUT_JSON SP_SIZE``; rank 0 writes ``{mode: [loss of each step]}`` for every mode
of :data:`MODES` (one launch, both modes: a process start costs more than the runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from loop_common import TRAINING, finish
from testkit import tiny_model

MODES = ("plain", "padding_free", "packing")


def sft_data() -> datasets.Dataset:
    """Pre-tokenized rows of 40-89 tokens (TRL pads them per batch, keeps them padding-free, or packs them
    into rows of 128 tokens)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 90, (8,), generator=g).tolist()
    return datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]}
    )


def sft_losses(mode: str, output_dir: str, fpdt=None, steps: int = 3, bf16: bool | None = False) -> list[float]:
    """Global training loss of each step; ``fpdt``: an ``FPDTPlugin`` (FPDTSFTTrainer) or None (SFTTrainer, sdpa);
    ``bf16``: the training argument, None for TRL's default (autocast bf16, as on GPUs)."""
    history = sft_history(mode, output_dir, fpdt, steps, bf16)
    return [h["loss"] for h in history if "loss" in h]


def sft_history(
    mode: str, output_dir: str, fpdt=None, steps: int = 3, bf16: bool | None = False, data=None, eval_data=None
) -> list[dict]:
    """The run of :func:`sft_losses`; returns the trainer's whole ``log_history`` (``data``: default
    :func:`sft_data`; ``eval_data``: evaluated after every step in batches of 2)."""
    from trl import SFTConfig, SFTTrainer

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer

    model = tiny_model()
    args = SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1 if mode == "padding_free" else 2,  # one sample per padding-free row
        padding_free=mode == "padding_free",
        packing=mode == "packing",
        max_length=None if mode == "padding_free" else 128,
        learning_rate=1.0,  # large: every step's loss depends on the previous gradients
        **TRAINING,
        **({} if bf16 is None else {"bf16": bf16}),
        **({} if eval_data is None else {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2}),
    )
    data = sft_data() if data is None else data
    common = dict(model=model, args=args, train_dataset=data, eval_dataset=eval_data, processing_class=word_tokenizer())
    trainer = SFTTrainer(**common) if fpdt is None else hf_fpdt.FPDTSFTTrainer(**common, fpdt=fpdt)
    trainer.train()
    return trainer.state.log_history


def main(out_path: str, sp_size: int) -> None:
    import hf_fpdt

    result = {}
    for mode in MODES:
        fpdt = hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=32, offload=True)
        result[mode] = sft_losses(mode, str(Path(out_path).parent / f"sft_{mode}"), fpdt)
    finish(lambda: Path(out_path).write_text(json.dumps(result)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
