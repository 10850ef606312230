"""A Llama training step on CUDA (apply + LoRA + checkpointing) equal to HF sdpa's under every placement
setting, the race check, and the autocast bf16 step (issue 22)."""

from __future__ import annotations

import pytest
import torch
from gpu import cases
from gpu.cases import CUDA, STEP_SETTINGS


@pytest.mark.parametrize("setting", list(STEP_SETTINGS))
def test_step_equals_sdpa(cuda, setting):
    cases.check_training_step(cuda, CUDA, setting)


@pytest.mark.parametrize("setting", list(STEP_SETTINGS))
def test_race_check(cuda, setting, monkeypatch):
    """FPDT_SYNC_COPIES=1 (a synchronisation after every copy) gives bit-identical losses and gradients."""
    cases.check_bit_identical(lambda: cases.check_training_step(cuda, CUDA, setting, check=False), monkeypatch)


def test_autocast_bf16_step(cuda):
    cases.check_autocast_step(cuda, CUDA)


@pytest.mark.parametrize("setting", ["offload-on", "device-between", "host-0-segments-2"])
def test_bf16_step_within_twice_sdpa(cuda, setting):
    """bf16 weights: the fused backends (cudnn, flash) run inside the model; within twice sdpa's bf16 error."""
    cases.check_training_step(cuda, CUDA, setting, dtype=torch.bfloat16)
