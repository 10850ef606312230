"""fpdt attention on CUDA, each backend that can run, forward + backward vs float64 and vs sdpa (issue 22).

Backends that cannot run here (no Hopper for cudnn/flash_attn3, flash-attn not installed, fp32 on a half-only
kernel) are skipped with the reason. fp32: 1e-5 relative; bf16/fp16: within twice sdpa's own error.
"""

from __future__ import annotations

import pytest
import torch
from gpu import cases
from gpu.cases import CUDA

IDS = [s.id for s in CUDA.attention]


@pytest.mark.parametrize("shape", CUDA.attention, ids=IDS)
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_bf16(cuda, backend, shape):
    cases.check_attention(cuda, backend, torch.bfloat16, shape)


@pytest.mark.parametrize("shape", CUDA.attention[:3], ids=IDS[:3])
@pytest.mark.parametrize("backend", ["cudnn", "torch_flash"])
def test_fp16(cuda, backend, shape):
    cases.check_attention(cuda, backend, torch.float16, shape)


@pytest.mark.parametrize("shape", CUDA.attention, ids=IDS)
def test_fp32_math(cuda, shape):
    cases.check_attention(cuda, "math", torch.float32, shape)


@pytest.mark.parametrize("offload", [False, True, "auto"])
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_offload_settings(cuda, backend, offload):
    dtype = torch.float32 if backend == "math" else torch.bfloat16
    cases.check_attention(cuda, backend, dtype, CUDA.attention[0], offload=offload)


@pytest.mark.parametrize("shape", [CUDA.attention[0], CUDA.attention[5]], ids=[IDS[0], IDS[5]])
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_race_check(cuda, backend, shape, monkeypatch):
    """FPDT_SYNC_COPIES=1 (a synchronisation after every copy) gives bit-identical results."""
    dtype = torch.float32 if backend == "math" else torch.bfloat16
    cases.check_bit_identical(lambda: cases.check_attention(cuda, backend, dtype, shape), monkeypatch)
