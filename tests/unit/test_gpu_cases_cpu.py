"""The CUDA suite's bodies (``tests/gpu/cases.py``) on CPU at tiny sizes, so they run in CI and never rot.

A selection: every body once, each attention feature (GQA/MQA/MHA, head dims 64/128, windows, documents, softcap)
with the CPU backends in fp32 and bf16, the training step under a few settings, the race check, generation.
"""

from __future__ import annotations

import pytest
import torch
from gpu import cases
from gpu.cases import CPU

CPU_DEVICE = torch.device("cpu")
SHAPES = {s.id: s for s in CPU.attention}


@pytest.mark.parametrize("shape", CPU.attention, ids=[s.id for s in CPU.attention])
def test_attention_fp32(shape):
    backend = "math" if shape.softcap or shape.docs else "cpu_flash"
    cases.check_attention(CPU_DEVICE, backend, torch.float32, shape)


@pytest.mark.parametrize("backend", cases.CPU_BACKENDS)
@pytest.mark.parametrize("index", [0, 3, 6])  # GQA, a window, softcap
def test_attention_bf16_within_twice_sdpa(backend, index):
    cases.check_attention(CPU_DEVICE, backend, torch.bfloat16, CPU.attention[index])


def test_attention_offload_off_and_auto():
    for offload in (False, "auto"):
        cases.check_attention(CPU_DEVICE, "cpu_flash", torch.float32, CPU.attention[0], offload=offload)


def test_a_backend_that_cannot_run_is_skipped_with_its_reason():
    with pytest.raises(pytest.skip.Exception, match="cudnn: needs a CUDA device"):
        cases.check_attention(CPU_DEVICE, "cudnn", torch.bfloat16, CPU.attention[0])


@pytest.mark.parametrize("setting", ["offload-on", "device-between", "host-0-segments-2"])
def test_training_step_equals_sdpa(setting):
    cases.check_training_step(CPU_DEVICE, CPU, setting)


def test_race_check_attention_and_step(monkeypatch):
    cases.check_bit_identical(
        lambda: cases.check_attention(CPU_DEVICE, "cpu_flash", torch.float32, CPU.attention[3]), monkeypatch
    )
    cases.check_bit_identical(lambda: cases.check_training_step(CPU_DEVICE, CPU, "host-0", check=False), monkeypatch)


def test_race_check_reports_a_difference(monkeypatch):
    calls = iter([[torch.zeros(2)], [torch.ones(2)], [torch.zeros(2)]])
    with pytest.raises(AssertionError, match="a race"):
        cases.check_bit_identical(lambda: next(calls), monkeypatch)


@pytest.mark.parametrize("kwargs", [{"prefill_chunk_size": 13}, {"cache_implementation": "static"}])
def test_generate_equals_sdpa(kwargs):
    cases.check_generate(CPU_DEVICE, CPU, **kwargs)


def test_autocast_bf16_step():
    cases.check_autocast_step(CPU_DEVICE, CPU)


def test_bf16_training_step_within_twice_sdpa():
    cases.check_training_step(CPU_DEVICE, CPU, "offload-on", dtype=torch.bfloat16)
