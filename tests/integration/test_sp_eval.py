"""Evaluation and prediction under SP equal one process, for eval sets that end in a partial batch.

Two real gloo processes (sp 2) run ``FPDTTrainer.evaluate`` / ``predict`` (with ``compute_metrics`` and a
tile-wise ``preprocess_logits_for_metrics``) and ``FPDTSFTTrainer.evaluate`` on eval sets of 3, 5 and 7
samples with eval batch 2, with and without ``eval_accumulation_steps``; this process runs HF's
``Trainer`` (``sdpa``) and TRL's ``SFTTrainer`` on the same model and data. Equal: the eval loss (1e-6
relative), the metrics, and the prediction rows (their number and order). Before the fix the SP ranks'
copies were gathered twice and the last batch cut as if it held one sample (sp 2, 3 samples: 5 rows
instead of 3, eval loss weighting the batches 4:1 instead of 2:1).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from distributed import free_port, run_distributed
from testkit import tiny_model

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SIZES = (3, 5, 7)
ACCUMULATION = (None, 2)
RTOL = 1e-6


def _data(n: int, length: int = 37):
    """Rows whose every other label is the model's own argmax (accuracy near 1/2, so a dropped or doubled
    row moves it), a padded tail (-100) on the odd rows, so batches differ in their number of targets."""
    import datasets

    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 512, (n, length), generator=g)
    with torch.no_grad():
        guess = tiny_model("tiny-llama", "sdpa")(input_ids=ids).logits.argmax(-1)
    labels = ids.clone()
    labels[:, 1::2] = guess[:, 0:-1:2]
    labels[1::2, length - 1 - 2 * (n % 4) - 5 :] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def accuracy(pred) -> dict:
    preds, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
    valid = labels != -100
    return {"accuracy": float((preds[valid] == labels[valid]).mean()), "targets": int(valid.sum())}


def _trainer_results(trainer_cls, n: int, accumulation: int | None, out: str, **extra) -> dict:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        per_device_eval_batch_size=2,
        eval_accumulation_steps=accumulation,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs = dict(compute_metrics=accuracy, preprocess_logits_for_metrics=argmax, **extra)
    attn = "sdpa" if "fpdt" not in extra else None
    trainer = trainer_cls(model=tiny_model("tiny-llama", attn), args=args, eval_dataset=_data(n), **kwargs)
    metrics = trainer.evaluate()
    pred = trainer.predict(_data(n))
    metrics.update(pred.metrics)
    return {"metrics": metrics, "predictions": pred.predictions, "label_ids": pred.label_ids}


def _sft_results(trainer_cls, n: int, accumulation: int | None, out: str, **extra) -> dict:
    from trl import SFTConfig

    from hf_fpdt.data.demo import word_tokenizer

    args = SFTConfig(
        output_dir=out,
        per_device_eval_batch_size=2,
        eval_accumulation_steps=accumulation,
        max_length=64,
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    data = _data(n).remove_columns("labels")
    common = dict(train_dataset=data, eval_dataset=data, processing_class=word_tokenizer())
    trainer = trainer_cls(model=tiny_model("tiny-llama", "sdpa"), args=args, **common, **extra)
    return {"metrics": trainer.evaluate()}


def _sp_worker(rank: int, world_size: int, port: int) -> dict:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import hf_fpdt

    out = {}
    for n in SIZES:
        for acc in ACCUMULATION:
            fpdt = hf_fpdt.FPDTPlugin(sp_size=world_size, chunk_size=8, offload=True)
            out["fpdt", n, acc] = _trainer_results(hf_fpdt.FPDTTrainer, n, acc, f"/tmp/sp_eval_{rank}", fpdt=fpdt)
        fpdt = hf_fpdt.FPDTPlugin(sp_size=world_size, chunk_size=8, offload=True)
        out["sft", n] = _sft_results(hf_fpdt.FPDTSFTTrainer, n, None, f"/tmp/sp_eval_sft_{rank}", fpdt=fpdt)
    return out


@functools.cache
def _sp_results() -> tuple[dict, dict]:
    return tuple(run_distributed(_sp_worker, 2, free_port(), timeout=600))


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * abs(want), f"{what}: sp 2 {got!r} vs one process {want!r}"


@pytest.mark.slow
def test_trainer_eval_and_predict_sp2_equal_one_process(tmp_path) -> None:
    from transformers import Trainer

    results = _sp_results()
    for n in SIZES:
        for acc in ACCUMULATION:
            want = _trainer_results(Trainer, n, acc, str(tmp_path))
            assert want["predictions"].shape[0] == n
            for rank, res in enumerate(results):
                got = res["fpdt", n, acc]
                what = f"rank {rank}, {n} samples, eval_accumulation_steps={acc}"
                _close(got["metrics"]["eval_loss"], want["metrics"]["eval_loss"], what + " eval_loss")
                _close(got["metrics"]["test_loss"], want["metrics"]["test_loss"], what + " test_loss")
                for key in ("eval_accuracy", "eval_targets", "test_accuracy", "test_targets"):
                    assert got["metrics"][key] == want["metrics"][key], f"{what} {key}"
                assert got["predictions"].shape == want["predictions"].shape, what
                assert np.array_equal(got["predictions"], want["predictions"]), what
                # position 0 targets nothing in a causal LM: FPDT returns -100 there, the rest as given
                assert np.array_equal(got["label_ids"][:, 1:], want["label_ids"][:, 1:]), what


def test_sft_eval_sp2_equals_one_process(tmp_path) -> None:
    from trl import SFTTrainer

    results = _sp_results()
    for n in SIZES:
        want = _sft_results(SFTTrainer, n, None, str(tmp_path))["metrics"]
        for rank, res in enumerate(results):
            got = res["sft", n]["metrics"]
            what = f"rank {rank}, {n} samples"
            for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
                _close(got[key], want[key], f"{what} {key}")
