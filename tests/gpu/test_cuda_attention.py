"""fpdt attention on CUDA, each backend that can run, forward + backward vs float64 and vs sdpa (issue 22).

On a GPU at the sizes of ``cases.CUDA``; without one on the virtual CUDA device at ``cases.CPU`` (every number
computed on the CPU, torch's cuDNN/flash ops and flash-attn's builds answered by ``tests/standins.py``'s references):
the routes, probes, copy streams, events and pinned buffers run in every test run, checked against float64 and sdpa.
Backends that cannot run here (no Hopper for cudnn/flash_attn3, flash-attn not installed, fp32 on a half-only
kernel) are skipped with the reason. fp32: 1e-5 relative; bf16/fp16: within twice sdpa's own error.
"""

from __future__ import annotations

import pytest
import torch
from gpu import cases

pytestmark = pytest.mark.virtual_kernels
SIZES = cases.sizes()
IDS = [s.id for s in SIZES.attention]


@pytest.mark.parametrize("shape", SIZES.attention, ids=IDS)
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_bf16(cuda_or_virtual, backend, shape, monkeypatch):
    cases.stand_in_flash(cuda_or_virtual, backend, monkeypatch)
    cases.check_attention(cuda_or_virtual, backend, torch.bfloat16, shape)


@pytest.mark.parametrize("shape", SIZES.attention[:3], ids=IDS[:3])
@pytest.mark.parametrize("backend", ["cudnn", "torch_flash"])
def test_fp16(cuda_or_virtual, backend, shape):
    cases.check_attention(cuda_or_virtual, backend, torch.float16, shape)


@pytest.mark.parametrize("shape", SIZES.attention, ids=IDS)
def test_fp32_math(cuda_or_virtual, shape):
    cases.check_attention(cuda_or_virtual, "math", torch.float32, shape)


@pytest.mark.parametrize("offload", [False, True, "auto"])
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_offload_settings(cuda_or_virtual, backend, offload, monkeypatch):
    cases.stand_in_flash(cuda_or_virtual, backend, monkeypatch)
    dtype = torch.float32 if backend == "math" else torch.bfloat16
    cases.check_attention(cuda_or_virtual, backend, dtype, SIZES.attention[0], offload=offload)


@pytest.mark.parametrize("shape", [SIZES.attention[0], SIZES.attention[5]], ids=[IDS[0], IDS[5]])
@pytest.mark.parametrize("backend", cases.CUDA_BACKENDS)
def test_race_check(cuda_or_virtual, backend, shape, monkeypatch):
    """FPDT_SYNC_COPIES=1 (a synchronisation after every copy) gives bit-identical results."""
    dtype = torch.float32 if backend == "math" else torch.bfloat16
    cases.check_bit_identical(
        cuda_or_virtual, lambda: cases.check_attention(cuda_or_virtual, backend, dtype, shape), monkeypatch
    )


def test_a_backend_that_cannot_run_is_skipped_with_its_reason():
    with pytest.raises(pytest.skip.Exception, match="cudnn: needs a CUDA device"):
        cases.check_attention(torch.device("cpu"), "cudnn", torch.bfloat16, cases.CPU.attention[0])


def test_race_check_reports_a_difference(monkeypatch):
    calls = iter([[torch.zeros(2)], [torch.ones(2)], [torch.zeros(2)]])
    with pytest.raises(AssertionError, match="a race"):
        cases.check_bit_identical(torch.device("cpu"), lambda: next(calls), monkeypatch)
