"""The CUDA suite's attention bodies (``tests/gpu/cases.py``) at the CPU sizes, on a GPU or, without one, on the
virtual CUDA device (``tests/virtual_cuda.py``) with torch's cuDNN and flash attention ops answered by references of
their schemas and layouts (``tests/standins.py``): the CUDA code paths (routes, probes, copy streams, events, pinned
buffers) run in every test run, checked against float64 and sdpa as on a GPU, and a race fails the test.

What the virtual device cannot show, and stays on ``test_cuda_*.py`` at real sizes on a GPU: a real kernel's own
numbers and speed, flash-attn's builds, and softcapped bf16 blocks (the bf16 baseline's autograd there mixes host
tensors into the virtual device's, so its reference cannot be taken).
"""

from __future__ import annotations

import pytest
import torch
from gpu import cases
from gpu.cases import CPU

SHAPES = [s for s in CPU.attention]
PLAIN = [s for s in SHAPES if s.softcap is None]


@pytest.mark.virtual_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
def test_math_fp32(cuda_or_virtual, shape):
    cases.check_attention(cuda_or_virtual, "math", torch.float32, shape)


@pytest.mark.virtual_kernels
@pytest.mark.parametrize("shape", PLAIN, ids=[s.id for s in PLAIN])
@pytest.mark.parametrize("backend", ["cudnn", "torch_flash"])
def test_fused_bf16_within_twice_sdpa(cuda_or_virtual, backend, shape):
    """Masked blocks (windows, documents) go where the router sends them beside the fused kernel (cuDNN's bias,
    else math); each result within twice sdpa's own bf16 error of float64."""
    cases.check_attention(cuda_or_virtual, backend, torch.bfloat16, shape)


@pytest.mark.virtual_kernels
@pytest.mark.parametrize("offload", [False, True])
def test_cudnn_offload_settings(cuda_or_virtual, offload):
    cases.check_attention(cuda_or_virtual, "cudnn", torch.bfloat16, CPU.attention[0], offload=offload)
