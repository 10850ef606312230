"""A Llama training step on CUDA (apply + LoRA + checkpointing) equal to HF sdpa's under every placement
setting, the race check, and the autocast bf16 step (issue 22). On a GPU at ``cases.CUDA``'s sizes; without one on
the virtual CUDA device at ``cases.CPU``'s (torch's cuDNN/flash ops answered by references; races and freed-in-use
memory fail the test)."""

from __future__ import annotations

import pytest
import torch
from gpu import cases
from gpu.cases import STEP_SETTINGS

pytestmark = pytest.mark.virtual_kernels
SIZES = cases.sizes()


@pytest.mark.parametrize("setting", list(STEP_SETTINGS))
def test_step_equals_sdpa(cuda_or_virtual, setting):
    cases.check_training_step(cuda_or_virtual, SIZES, setting)


@pytest.mark.parametrize("setting", list(STEP_SETTINGS))
def test_race_check(cuda_or_virtual, setting, monkeypatch):
    """FPDT_SYNC_COPIES=1 (a synchronisation after every copy) gives bit-identical losses and gradients."""
    cases.check_bit_identical(
        cuda_or_virtual, lambda: cases.check_training_step(cuda_or_virtual, SIZES, setting, check=False), monkeypatch
    )


def test_autocast_bf16_step(cuda_or_virtual):
    cases.check_autocast_step(cuda_or_virtual, SIZES)


@pytest.mark.parametrize("setting", ["offload-on", "device-between", "host-0-segments-2"])
def test_bf16_step_within_twice_sdpa(cuda_or_virtual, setting):
    """bf16 weights: the fused backends (cudnn, flash) run inside the model; within twice sdpa's bf16 error."""
    cases.check_training_step(cuda_or_virtual, SIZES, setting, dtype=torch.bfloat16)
