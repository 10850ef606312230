"""TRL ``SFTTrainer`` with FPDT (``hf_fpdt.FPDTSFTTrainer``): the losses of one process without FPDT.

Plain (padded) batches, padding-free rows and packed rows (several documents per row), 3 SGD steps at
a large learning rate, fp32 tiny Llama: at sp 1 in this process, and at sp 2 launched on 2 CPU
processes (gloo), against ``SFTTrainer`` with ``sdpa`` on one process.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from launch import SCRIPTS, accelerate_launch
from sft_loop import MODES, sft_losses
from testkit import SCRATCH

import hf_fpdt

RTOL = 1e-5


@functools.cache
def baseline(mode: str, tmp: str = SCRATCH) -> tuple[float, ...]:
    return tuple(sft_losses(mode, f"{tmp}/sft_sdpa_{mode}"))


def _assert_close(got, want) -> None:
    assert len(got) == len(want) == 3
    assert abs(want[2] - want[0]) > 1e-3  # the steps move the loss, so a wrong gradient shows
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step}: fpdt {g} vs sdpa {w}"


@pytest.mark.parametrize("mode", MODES)
def test_sft_sp1_equals_sdpa(mode: str, tmp_path) -> None:
    got = sft_losses(mode, str(tmp_path), hf_fpdt.FPDTPlugin(sp_size=1, chunk_size=32))
    _assert_close(got, baseline(mode))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sft_sp2_equals_one_process(tmp_path) -> None:
    out = tmp_path / "sft.json"
    accelerate_launch(SCRIPTS / "sft_loop.py", 2, str(out), "2")
    result = json.loads(out.read_text())
    for mode in MODES:
        _assert_close(result[mode], baseline(mode))


def test_model_name_and_compute_metrics_are_refused() -> None:
    with pytest.raises(ValueError, match="needs the model object"):
        hf_fpdt.FPDTSFTTrainer("some/model")
    with pytest.raises(ValueError, match="drop compute_metrics"):
        hf_fpdt.FPDTSFTTrainer(torch.nn.Linear(2, 2), compute_metrics=lambda p: {})
