"""Messages and noise: every out-of-range ``FPDT_*`` value names its variable, an SP forward emits no
deprecation warning of HF's, and the plan's summary with the resolved ``auto`` values shows by default."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.config import FPDTConfig

BAD_ENV = [
    ("FPDT_CHUNK_SIZE", "0"),
    ("FPDT_CHUNK_SIZE", "-5"),
    ("FPDT_CHUNK_SIZE", "lots"),
    ("FPDT_SP_SIZE", "0"),
    ("FPDT_MLP_CHUNKS", "0"),
    ("FPDT_LOSS_CHUNKS", "-3"),
    ("FPDT_CHECKPOINT_SEGMENTS", "0"),
    ("FPDT_HOST_MEMORY", "-1"),
    ("FPDT_DEVICE_MEMORY", "-1"),
    ("FPDT_BACKEND", "bogus"),
    ("FPDT_OFFLOAD", "maybe"),
    ("FPDT_OFFLOAD_LAYER_INPUTS", "auto"),
]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_every_bad_environment_value_names_its_variable(name: str, value: str, monkeypatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        FPDTConfig()
    FPDTConfig(**{"chunk_size": 64, "sp_size": 1, "mlp_chunks": 2, "loss_chunks": 2, "checkpoint_segments": 1,
                  "host_memory": "auto", "device_memory": "auto", "backend": "auto", "offload": True,
                  "offload_layer_inputs": True})  # fmt: skip  # set in code, the variable is not read


def test_chunk_size_below_sp_size_names_both_variables(monkeypatch) -> None:
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "1")
    monkeypatch.setenv("FPDT_SP_SIZE", "2")
    with pytest.raises(ValueError, match="FPDT_CHUNK_SIZE='1', FPDT_SP_SIZE='2' \\(environment variables\\)"):
        FPDTConfig()


def _sp_forward_warnings(rank: int, world_size: int) -> list[str]:
    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.groups import build_groups

    groups = build_groups(2, timeout=60)
    model = tiny_model("tiny-llama", None)
    model.gradient_checkpointing_enable()
    model = hf_fpdt.apply(model, FPDTConfig(chunk_size=16, offload=True), group=groups.sp)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=2, chunk_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**shard.model_kwargs()).loss.backward()
        model.eval()
        with torch.no_grad():
            model(**shard.model_kwargs())
    deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    return [f"{w.category.__name__}: {w.message}" for w in deprecated]


@pytest.mark.multiprocess
def test_sp_forward_emits_no_deprecation_warning() -> None:
    for rank, caught in enumerate(run_distributed(_sp_forward_warnings, 2)):
        assert caught == [], f"rank {rank}: {caught}"


SHOWN = """
import torch, hf_fpdt
from types import SimpleNamespace
from testkit import tiny_model
from hf_fpdt.attention.autotune import Autotuner
Autotuner.measured_chunk_size = lambda self, device, sp_size=1, **hints: 32  # no timing in a test
model = tiny_model("tiny-llama", None, seed=None)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
plugin = hf_fpdt.FPDTPlugin(sp_size=1, chunk_size="auto")
plugin.setup(SimpleNamespace(num_processes=1, device="cpu"))
plugin.apply(model)
model.train()
for length in (64, 64, 48):
    ids = torch.randint(0, 512, (1, length))
    model(input_ids=ids, labels=ids).loss.backward()
"""


@pytest.mark.multiprocess
def test_plan_and_auto_chunk_size_are_shown_once_by_default() -> None:
    import subprocess
    import sys

    from launch import IMPORT_PATH

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([IMPORT_PATH, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SHOWN], capture_output=True, text=True, check=True, env=env).stderr
    assert out.count("hf_fpdt: chunk_size='auto' -> 32 tokens per chunk") == 1, out
    plans = [line for line in out.splitlines() if line.startswith("hf_fpdt plan:")]
    assert len(plans) == 1, out  # one line per run, not per step shape
    assert "chunk_size 32, offload auto, checkpoint_segments auto;" in plans[0]
    assert "checkpoint segments of k=1" in plans[0] and "of host_memory" in plans[0]


def test_example_output_folder_differs_per_launch_config(monkeypatch) -> None:
    """The ZeRO-3 (and FSDP) launch of the example writes beside the DDP quickstart's adapter, not into it."""
    import importlib.util

    from launch import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # what the examples share, as Python finds it for a script
    spec = importlib.util.spec_from_file_location("finetune_lora_example", ROOT / "examples" / "finetune_lora.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--attn", "fpdt", "--sp-size", "2"])
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    folders = {"ddp": example.default_output_dir(args, 2, 2)}
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    folders["zero3"] = example.default_output_dir(args, 2, 2)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    folders["fsdp"] = example.default_output_dir(args, 2, 2)
    assert folders["ddp"] == "out/finetune_lora/fpdt_sp2_np2"  # the quickstart's folder, as documented
    assert len(set(folders.values())) == 3, folders
