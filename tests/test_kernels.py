"""Block kernels against an independent float64 reference: forward (out, lse), backward, LSE merge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import max_err, reference_attention, rel_err

from hf_fpdt.kernels import block_backward, block_forward, merge_block, select_backend

# (B, Sq, Sk, Hq, Hkv, D): MHA, GQA, MQA; odd lengths and an odd head dim.
SHAPES = [(1, 37, 37, 4, 4, 16), (3, 64, 64, 4, 2, 59), (2, 45, 45, 6, 1, 32)]
CROSS_SHAPES = [(1, 37, 80, 4, 4, 16), (3, 64, 29, 4, 2, 59), (2, 45, 128, 6, 1, 32)]


def _ref_lse(q, k, scale, causal):
    groups = q.shape[2] // k.shape[2]
    s = q.double().transpose(1, 2) @ k.double().repeat_interleave(groups, 2).transpose(1, 2).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, -1)


def _inputs(b, sq, sk, h, hkv, d, dtype):
    q = torch.randn(b, sq, h, d).to(dtype)
    k = torch.randn(b, sk, hkv, d).to(dtype)
    v = torch.randn(b, sk, hkv, d).to(dtype)
    dout = torch.randn(b, sq, h, d).to(dtype)
    return q, k, v, dout


def _ref_grads(q, k, v, dout, scale, causal):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q64, k64, v64, scale, causal)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _torch_bf16_grads(q, k, v, dout, scale, causal):
    """The bf16 torch reference: sdpa on the whole block in bf16 (flash-attention's test rule)."""
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), is_causal=causal, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    out.backward(dout)
    return out.detach(), qt.grad, kt.grad, vt.grad


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "causal,shape", [(True, s) for s in SHAPES] + [(False, s) for s in CROSS_SHAPES], ids=lambda x: str(x)
)
def test_block_matches_fp64_reference(backend, dtype, causal, shape):
    q, k, v, dout = _inputs(*shape, dtype)
    scale = 0.37  # not 1/sqrt(D): the kernels must honour the caller's (HF's) scaling
    out, lse = block_forward(q, k, v, causal, scale, backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal, scale, backend)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    ref = _ref_grads(q, k, v, dout, scale, causal)
    # lse is float32 from exactly representable inputs in both dtypes
    assert rel_err(lse, _ref_lse(q, k, scale, causal)) < 1e-5
    ours = (out, dq, dk, dv)
    if dtype == torch.float32:
        for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
            assert rel_err(a, r) < 1e-5, name
    else:
        torch_ref = _torch_bf16_grads(q, k, v, dout, scale, causal)
        for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, torch_ref, ref):
            assert max_err(a, r) <= 2 * max_err(t, r) + 1e-5, name


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_blocks_merge_to_whole_sequence(backend, dtype, tol):
    """Causal attention over 3 chunks = diagonal blocks + full lower blocks merged; the backward
    of each block given the *final* out/lse sums to the exact gradients."""
    b, s, h, hkv, d = 2, 70, 4, 2, 59
    q, k, v, dout = _inputs(b, s, s, h, hkv, d, dtype)
    scale = d**-0.5
    bounds = [(0, 25), (25, 50), (50, 70)]
    outs, lses = [], []
    for i, (a, e) in enumerate(bounds):
        o, lse = merge_block(None, None, *block_forward(q[:, a:e], k[:, a:e], v[:, a:e], True, scale, backend))
        for j in range(i):
            ka, ke = bounds[j]
            o, lse = merge_block(o, lse, *block_forward(q[:, a:e], k[:, ka:ke], v[:, ka:ke], False, scale, backend))
        assert o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        outs.append(o.to(dtype))
        lses.append(lse)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, (ka, ke) in enumerate(bounds):
        for j in range(i, len(bounds)):
            a, e = bounds[j]
            g = block_backward(
                dout[:, a:e], q[:, a:e], k[:, ka:ke], v[:, ka:ke], outs[j], lses[j], i == j, scale, backend
            )
            dq[:, a:e] += g[0]
            dk[:, ka:ke] += g[1]
            dv[:, ka:ke] += g[2]
    ref = _ref_grads(q, k, v, dout, scale, True)
    for name, a, r in zip(("out", "dq", "dk", "dv"), (torch.cat(outs, 1), dq, dk, dv), ref):
        assert rel_err(a, r) < tol, name


@pytest.mark.parametrize("gap", [50.0, 1e4, 1e30])
def test_merge_block_survives_huge_lse_gaps(gap):
    b, s, h, d = 2, 5, 3, 8
    o1, o2 = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    big = torch.full((b, h, s), gap)
    small = torch.full((b, h, s), -gap)
    for first, second, winner in (((o1, big), (o2, small), o1), ((o1, small), (o2, big), o2)):
        out, lse = merge_block(*merge_block(None, None, *first), *second)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(out, winner, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, big, rtol=1e-6, atol=1e-6)


def test_merge_block_matches_logsumexp_and_is_symmetric():
    b, s, h, d = 2, 7, 3, 8
    o1, o2 = torch.randn(b, s, h, d, dtype=torch.float64), torch.randn(b, s, h, d, dtype=torch.float64)
    l1, l2 = 3 * torch.randn(b, h, s, dtype=torch.float64), 3 * torch.randn(b, h, s, dtype=torch.float64)
    out, lse = merge_block(*merge_block(None, None, o1, l1), o2, l2)
    expect_lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - expect_lse).transpose(1, 2).unsqueeze(-1)
    w2 = torch.exp(l2 - expect_lse).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(lse, expect_lse)
    torch.testing.assert_close(out, w1 * o1 + w2 * o2)
    out_r, lse_r = merge_block(*merge_block(None, None, o2, l2), o1, l1)
    torch.testing.assert_close(out_r, out)
    torch.testing.assert_close(lse_r, lse)


def test_merge_block_accumulates_in_fp32_for_bf16_blocks():
    o = torch.randn(1, 4, 2, 8).bfloat16()
    out, lse = merge_block(None, None, o, torch.zeros(1, 2, 4))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_kernel_errors_and_backend_choice():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        block_forward(q, k, k, True, 1.0)
    with pytest.raises(ValueError, match="expected q"):
        block_forward(q, k, k[:, :2], True, 1.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        block_forward(q, q, q, True, 1.0, backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        block_backward(q, q, q, q, q, torch.zeros(1, 3, 4), True, 1.0, backend="nope")
    assert select_backend(torch.device("cpu"), torch.bfloat16) == "cpu_flash"
    assert select_backend(torch.device("cpu"), torch.float32) == "cpu_flash"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 64, 8, 2, 64), (1, 32, 96, 4, 1, 128)])
def test_torch_flash_calls_fit_the_cuda_ops_under_fake_tensors(causal, shape):
    """The CUDA-only ``torch_flash`` backend, traced with fake CUDA tensors (no GPU, no values).

    Checks what a CPU machine can: the aten flash forward/backward accept the arguments as passed
    (schema, positional order, keyword ``scale``), and the outputs come back in the block layout,
    with GQA/MQA key/value gradients folded back to the key/value heads.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, sq, sk, h, hkv, d = shape
    with FakeTensorMode():
        q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, sk, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.empty_like(k)
        out, lse = block_forward(q, k, v, causal, d**-0.5, "torch_flash")
        dq, dk, dv = block_backward(torch.empty_like(out), q, k, v, out, lse, causal, d**-0.5, "torch_flash")
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
    assert (lse.shape, lse.dtype) == ((b, h, sq), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
