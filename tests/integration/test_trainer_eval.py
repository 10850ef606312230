"""``FPDTTrainer`` evaluation with ``compute_metrics`` at sp 1 (in process): predictions from the tiled head.

The same ``compute_metrics`` / ``preprocess_logits_for_metrics`` pair (HF's convention: argmax, then
predictions at t against labels at t + 1) gives the same accuracy and eval loss through ``FPDTTrainer``
(fpdt, logits never formed for the whole sequence) and through HF's ``Trainer`` with ``sdpa``. The
sp 2 / sp 4 / dp 2 x sp 2 cases run in ``test_example.py`` (launched). Also: the training path imports
no ``datasets``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from testkit import tiny_model
from transformers import Trainer, TrainingArguments

import hf_fpdt
from hf_fpdt.memory.tiling import tiled_head_map


def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def accuracy(pred) -> dict:
    preds, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
    valid = labels != -100
    return {"accuracy": float((preds[valid] == labels[valid]).mean()), "targets": int(valid.sum())}


def _eval_data(ref, n: int = 6, length: int = 70) -> datasets.Dataset:
    """Rows whose labels are the reference model's own argmax at every other position (accuracy near 1/2,
    so a wrong prediction shows), random elsewhere, -100 on a padded tail of the odd rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (n, length), generator=g)
    with torch.no_grad():
        guess = ref(input_ids=ids).logits.argmax(-1)  # [n, S]: prediction for position t + 1
    labels = ids.clone()
    labels[:, 1::2] = guess[:, 0:-1:2]
    labels[1::2, length - 9 :] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _evaluate(trainer_cls, model, data, tmp_path, name: str, **extra) -> dict:
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_eval_batch_size=4, report_to="none")
    trainer = trainer_cls(
        model=model,
        args=args,
        eval_dataset=data,
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=argmax,
        **extra,
    )
    return trainer.evaluate()


def test_accuracy_at_sp1_equals_hf(tmp_path) -> None:
    ref = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None).eval()
    data = _eval_data(ref)
    model = copy.deepcopy(ref)
    fpdt = hf_fpdt.FPDTPlugin(sp_size=1, chunk_size=16, offload=True, loss_chunks=3)  # several head tiles
    got = _evaluate(hf_fpdt.FPDTTrainer, model, data, tmp_path, "fpdt", fpdt=fpdt)
    want = _evaluate(Trainer, ref, data, tmp_path, "sdpa")
    assert got["eval_targets"] == want["eval_targets"] == 6 * 69 - 3 * 9
    assert 0.3 < want["eval_accuracy"] < 0.7
    assert got["eval_accuracy"] == want["eval_accuracy"]
    assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5 * want["eval_loss"]


def test_compute_metrics_needs_a_tilewise_reduction(tmp_path) -> None:
    model = tiny_model("tiny-llama", None, dtype=None, seed=None)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="pass preprocess_logits_for_metrics"):
        hf_fpdt.FPDTTrainer(model=model, args=args, compute_metrics=accuracy, fpdt=hf_fpdt.FPDTPlugin(sp_size=1))


def test_tiled_head_map_order_and_refusal() -> None:
    head = torch.nn.Linear(8, 32)
    hidden = torch.randn(3, 11, 8)
    got = tiled_head_map(hidden, head, argmax, tiles=4)
    assert torch.equal(got, head(hidden).argmax(-1))
    with pytest.raises(ValueError, match=r"per-token tensor \[1, n, ...\]"):
        tiled_head_map(hidden, head, lambda z, y: z.argmax(-1).sum(), tiles=4)
    assert np.isfinite(got.numpy()).all()


@pytest.mark.multiprocess
def test_training_path_imports_no_datasets() -> None:
    code = (
        "import sys, hf_fpdt, hf_fpdt.data.collate, hf_fpdt.trainers.accelerate_plugin; "
        "hf_fpdt.FPDTPlugin; assert 'datasets' not in sys.modules, 'datasets was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _head_inputs(model) -> list[tuple[int, ...]]:
    """Shapes of every input the model's output layer is called on (a list filled by a forward hook)."""
    shapes: list[tuple[int, ...]] = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


def test_plain_trainer_on_applied_model_returns_sdpa_predictions(tmp_path) -> None:
    """HF's own Trainer on an ``apply``-ed model: predict / evaluate(compute_metrics) give what the sdpa model
    gives (the full logits formed only when Trainer asks for predictions), never an empty ``()``."""
    ref = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None).eval()
    data = _eval_data(ref, n=5)
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=16, offload=True, loss_chunks=3))
    calls = _head_inputs(model)
    args = TrainingArguments(output_dir=str(tmp_path / "a"), per_device_eval_batch_size=2, report_to="none")
    loss_only = Trainer(model=model, args=args, eval_dataset=data).evaluate()
    assert all(s[-2] < 70 for s in calls), f"full logits formed for a loss-only evaluation: {calls}"
    want_loss = Trainer(model=ref, args=args, eval_dataset=data).evaluate()["eval_loss"]
    assert abs(loss_only["eval_loss"] - want_loss) <= 1e-5 * want_loss

    got = _evaluate(Trainer, model, data, tmp_path, "fpdt_plain")
    want = _evaluate(Trainer, ref, data, tmp_path, "sdpa")
    assert got["eval_accuracy"] == want["eval_accuracy"] and got["eval_targets"] == want["eval_targets"]
    assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5 * want["eval_loss"]

    pred = Trainer(model=model, args=args).predict(data)
    ref_pred = Trainer(model=ref, args=args).predict(data)
    assert isinstance(pred.predictions, np.ndarray) and pred.predictions.shape == ref_pred.predictions.shape == (
        5,
        70,
        512,
    )
    assert np.abs(pred.predictions - ref_pred.predictions).max() <= 1e-4 * np.abs(ref_pred.predictions).max()


def test_fpdt_trainer_predict_without_reduction_at_sp1_gives_full_logits(tmp_path) -> None:
    ref = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None).eval()
    data = _eval_data(ref, n=3)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none")
    fpdt = hf_fpdt.FPDTPlugin(sp_size=1, chunk_size=16)
    pred = hf_fpdt.FPDTTrainer(model=copy.deepcopy(ref), args=args, fpdt=fpdt).predict(data)
    ref_pred = Trainer(model=ref, args=args).predict(data)
    assert pred.predictions.shape == ref_pred.predictions.shape == (3, 70, 512)
    assert np.abs(pred.predictions - ref_pred.predictions).max() <= 1e-4 * np.abs(ref_pred.predictions).max()


def test_deferred_logits_under_sp_name_fpdt_trainer() -> None:
    from hf_fpdt.integrations.patches import DeferredLogits

    head = torch.nn.Linear(8, 32)
    hidden = torch.randn(2, 5, 8)
    lazy = DeferredLogits(hidden, head, 32, sp_size=1)
    assert lazy.shape == (2, 5, 32) and "not formed" in repr(lazy)
    assert torch.equal(lazy.detach(), head(hidden).detach()) and type(lazy.detach()) is torch.Tensor
    assert torch.equal(torch.argmax(lazy, -1), head(hidden).argmax(-1))
    assert torch.equal(lazy[:, 1:], head(hidden)[:, 1:].detach())
    with pytest.raises(ValueError, match="hf_fpdt.FPDTTrainer and pass preprocess_logits_for_metrics"):
        DeferredLogits(hidden, head, 32, sp_size=2).detach()
