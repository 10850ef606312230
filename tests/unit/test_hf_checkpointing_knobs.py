"""transformers 5.24's own knobs under hf_fpdt (issue 35, item 5).

* ``activation_checkpointing_enable(every_n_layers=k > 1)``: some layers checkpoint, others not; hf_fpdt's
  planner, replay budget and checkpoint segments plan for all or none, so a training forward refuses it naming
  what to use instead (``every_n_layers=1`` still trains as sdpa: tests/unit/test_checkpoint_offload.py);
* ``offload=True`` (HF's ``save_on_cpu`` around each checkpoint): refused, naming hf_fpdt's own layer-input
  offload (HF's copy would bypass ``FPDTConfig.host_memory``);
* ``TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 2})``
  through ``FPDTTrainer``: the same refusal from ``train``;
* ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))``: the FPDT trainers' SP size
  (``FPDTPlugin(sp_size=N)``, the arguments copied without it); a plugin with another ``sp_size`` and the other
  parallelism dimensions are refused.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from testkit import tiny_model

import hf_fpdt

accelerate_parallelism = pytest.importorskip("accelerate.parallelism_config")
ParallelismConfig = accelerate_parallelism.ParallelismConfig


def _knobs(model) -> bool:
    enable = getattr(model, "activation_checkpointing_enable", None)
    return enable is not None and {"every_n_layers", "offload"} <= set(inspect.signature(enable).parameters)


def _fpdt_model():
    model = tiny_model(attn="sdpa", num_hidden_layers=4)
    if not _knobs(model):
        pytest.skip("this transformers has no activation_checkpointing_enable(every_n_layers, offload)")
    model.train()
    return hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=32))


def test_every_n_layers_is_refused_naming_what_to_use():
    model = _fpdt_model()
    ids = torch.randint(0, 100, (1, 96))
    model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(ValueError, match=r"checkpointing of 2 of 4 decoder layers .*every_n_layers=1"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # evaluation checkpoints nothing: not refused
        model.eval()
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_hf_offload_is_refused_naming_hf_fpdts_own():
    model = _fpdt_model()
    ids = torch.randint(0, 100, (1, 96))
    model.activation_checkpointing_enable(offload=True)
    with pytest.raises(ValueError, match=r"offload=True .*FPDTConfig\(offload_layer_inputs=True\)"):
        model(input_ids=ids, labels=ids)


def test_training_arguments_every_n_layers_is_refused_by_fpdt_trainer(tmp_path):
    from transformers import TrainingArguments

    model = tiny_model(attn="sdpa", num_hidden_layers=4)
    if not _knobs(model):
        pytest.skip("this transformers has no every_n_layers")
    ids = torch.randint(0, 100, (4, 64))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"every_n_layers": 2},
        report_to=[],
        use_cpu=True,
    )
    trainer = hf_fpdt.FPDTTrainer(model, args, train_dataset=data, fpdt=hf_fpdt.FPDTPlugin(chunk_size=32))
    with pytest.raises(ValueError, match=r"every_n_layers > 1"):
        trainer.train()


def _args(tmp_path, config):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), parallelism_config=config, report_to=[], use_cpu=True)


def test_parallelism_config_sp_size_is_the_plugins(tmp_path):
    from hf_fpdt.trainers.trainer import plugin_for

    if "sp_size" not in inspect.signature(ParallelismConfig).parameters:
        pytest.skip("this Accelerate's ParallelismConfig has no sp_size")
    args = _args(tmp_path, ParallelismConfig(sp_size=2))
    got, plugin = plugin_for(args, None, "FPDTTrainer")
    assert plugin.sp_size == 2 and got.parallelism_config is None
    assert args.parallelism_config.sp_size == 2  # the caller's arguments are not written
    same, given = plugin_for(args, hf_fpdt.FPDTPlugin(sp_size=2), "FPDTTrainer")
    assert given.sp_size == 2 and same.parallelism_config is None
    with pytest.raises(ValueError, match=r"parallelism_config has sp_size=2 and the plugin FPDTPlugin\(sp_size=4\)"):
        plugin_for(args, hf_fpdt.FPDTPlugin(sp_size=4), "FPDTTrainer")


def test_parallelism_config_other_dimensions_are_refused(tmp_path):
    from hf_fpdt.trainers.trainer import plugin_for

    with pytest.raises(ValueError, match=r"sp_size only \(got \{'tp_size': 2\}\)"):
        plugin_for(_args(tmp_path, ParallelismConfig(tp_size=2)), None, "FPDTTrainer")
