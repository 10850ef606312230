"""The chunked FPDT attention (autograd Function) against whole-sequence float64 attention.

fp32 must match to ~1e-5 relative; bf16 must stay within twice the error of torch's own bf16 sdpa on
the whole sequence (flash-attention's rule), forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from standins import reference_attention
from testkit import max_err, rel_err

from hf_fpdt import FPDTAttentionFunction, FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention.chunked import TensorSource

BIG = 2048  # one chunk larger than every sequence below

# (S, chunk, B, Hq, Hkv, D, offload): every length with chunk 64, 128 and one chunk longer than the
# sequence; batch 1 and 3, MHA / GQA / MQA and offload on and off spread over them.
CASES = [
    (1, 64, 1, 4, 4, 16, True),
    (1, 128, 3, 4, 2, 16, False),
    (1, BIG, 3, 4, 1, 16, True),
    (63, 64, 3, 4, 1, 59, False),
    (63, 128, 1, 4, 4, 16, True),
    (63, BIG, 1, 4, 2, 16, False),
    (517, 64, 3, 4, 2, 59, True),
    (517, 128, 1, 4, 1, 16, False),
    (517, BIG, 3, 4, 4, 32, True),
    (1000, 64, 1, 4, 1, 32, True),
    (1000, 64, 3, 4, 2, 16, False),
    (1000, 128, 3, 4, 4, 59, False),
    (1000, BIG, 1, 4, 2, 32, False),
]


def _case_id(case):
    s, c, b, h, hkv, d, off = case
    return f"S{s}-c{c}-B{b}-h{h}kv{hkv}-d{d}-{'offload' if off else 'device'}"


def _run(case, dtype, backend=None, scale=None):
    s, chunk, b, h, hkv, d, offload = case
    q = torch.randn(b, s, h, d)
    k = torch.randn(b, s, hkv, d)
    v = torch.randn(b, s, hkv, d)
    dout = torch.randn(b, s, h, d)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = d**-0.5 if scale is None else scale
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=offload), backend=backend)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = fpdt_attention(qs, ks, vs, runtime, scale)
    out.backward(dout)
    ours = (out.detach(), qs.grad, ks.grad, vs.grad)
    for a, t in zip(ours, (q, q, k, v)):
        assert a.shape == t.shape and a.dtype == dtype

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out = reference_attention(q64, k64, v64, scale)
    ref_out.backward(dout.double())
    ref = (ref_out.detach(), q64.grad, k64.grad, v64.grad)
    return ours, ref, (q, k, v, dout, scale), runtime


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp32_matches_fp64_reference(case):
    ours, ref, _, runtime = _run(case, torch.float32)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, r) < 1e-5, name
    store = runtime.store(torch.device("cpu"))
    # every chunk went back to the pool after backward; offload=False never touches host memory
    assert store.pooled_bytes() == store.host_bytes
    assert (store.host_bytes > 0) == case[-1]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bf16_within_twice_torch_bf16_error(case):
    ours, ref, (q, k, v, dout, scale), _ = _run(case, torch.bfloat16)
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    torch_out = F.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    torch_out.backward(dout)
    torch_ref = (torch_out.detach(), qt.grad, kt.grad, vt.grad)
    for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, torch_ref, ref):
        assert max_err(a, r) <= 2 * max_err(t, r) + 1e-5, name


@pytest.mark.parametrize("dtype,backend", [(torch.float64, "math"), (torch.float64, None), (torch.float32, "math")])
def test_other_backends_and_fp64(dtype, backend):
    """fp64 through the chunk pipeline is exact to rounding, proving the algorithm (not just tolerance)."""
    case = (203, 64, 2, 6, 2, 59, True)
    ours, ref, _, _ = _run(case, dtype, backend=backend, scale=0.21)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, r) < tol, name


def test_function_apply_without_grad_keeps_nothing():
    q, k, v = torch.randn(2, 150, 4, 16), torch.randn(2, 150, 2, 16), torch.randn(2, 150, 2, 16)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=64, offload=True))
    source = TensorSource([64, 64, 22], 4, 2)
    out = FPDTAttentionFunction.apply(source, runtime, 0.25, q, k, v)
    assert not out.requires_grad
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)
    store = runtime.store(q.device)
    assert store.host_bytes > 0 and store.pooled_bytes() == store.host_bytes  # all k/v chunks released


def test_runtime_reused_across_calls_gives_same_result():
    """A second step through the same runtime (pooled buffers reused) computes the same numbers."""
    runtime = FPDTRuntime(FPDTConfig(chunk_size=32, offload=True))
    q, k, v = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(3))
    results = []
    for _ in range(2):
        out = fpdt_attention(q, k, v, runtime)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out.detach(), *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [1, 3])
def test_tiny_chunks(chunk):
    """Chunks of one token (every block a diagonal or a full lower block) are still exact."""
    ours, ref, _, _ = _run((7, chunk, 2, 4, 2, 8, True), torch.float32)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, r) < 1e-5, name


@pytest.mark.parametrize("needs", ["q", "k", "v"])
def test_gradient_of_one_input_only(needs):
    runtime = FPDTRuntime(FPDTConfig(chunk_size=16, offload=True))
    tensors = {"q": torch.randn(2, 50, 4, 8), "k": torch.randn(2, 50, 1, 8), "v": torch.randn(2, 50, 1, 8)}
    tensors[needs].requires_grad_()
    out = fpdt_attention(tensors["q"], tensors["k"], tensors["v"], runtime)
    (grad,) = torch.autograd.grad(out, tensors[needs], out.detach())
    ref64 = {n: t.detach().double().requires_grad_(n == needs) for n, t in tensors.items()}
    ref = reference_attention(ref64["q"], ref64["k"], ref64["v"], 8**-0.5)
    (ref_grad,) = torch.autograd.grad(ref, ref64[needs], out.detach().double())
    assert rel_err(grad, ref_grad) < 1e-5
