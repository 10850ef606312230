"""The CUDA-only attention ops on the virtual CUDA device (``VirtualCuda(kernels=True)``, issue 49, item 1).

torch's cuDNN and flash SDPA ops are answered on virtual tensors by the references of ``tests/standins.py``. Checked:
each op's outputs have the shapes, strides and dtypes torch's own meta functions give the real op (traced with fake
CUDA tensors) and the LSE layout the kernels read (cuDNN ``[B, H, Sq, 1]``, flash ``[B, H, Sq]``, float32), with
values equal to the dense float64 reference; the ``cudnn`` and ``torch_flash`` probes pass there, so the runtime's
router resolves ``cudnn`` with its bias for masked blocks as on a Hopper GPU; and the chunked attention on it runs its
blocks on ``cudnn`` (nothing on ``math``) within bf16's error of ``math`` and with no host synchronisation per block.
"""

from __future__ import annotations

import pytest
import torch
from standins import dense_attention
from testkit import count_math, max_err, record_kernel
from torch._subclasses.fake_tensor import FakeTensorMode
from virtual_cuda import VirtualCuda, VirtualTensor

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.kernels import probe_backend, probe_device

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
B, S, H, HKV, D = 2, 40, 4, 2, 64


def _inputs(device, dtype=torch.bfloat16, hkv=HKV):
    """``[B, S, H, D]`` tensors (the blocks' layout) made on the CPU from one seed, then moved."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, S, H, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, S, hkv, D, generator=g) for _ in range(2))
    return [t.to(dtype).to(device) for t in (q, k, v, dout)]


def _layout(res) -> list:
    """(shape, stride, dtype) of each tensor among an op's outputs; ``None`` for the rest (ints, undefined)."""
    return [(tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None for t in res]


def _calls(causal: bool):
    """The ops as the ``cudnn`` / ``torch_flash`` kernels call them (heads-first views of ``[B, S, H, D]`` tensors):
    ``{name: (op, args, kwargs)}``, the backwards given their forward's outputs by ``run``."""

    def cudnn(q, k, v, dout):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fwd = aten._scaled_dot_product_cudnn_attention.default(qt, kt, vt, None, True, 0.0, causal, False, scale=0.2)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        bwd = aten._scaled_dot_product_cudnn_attention_backward.default(
            dout.transpose(1, 2), qt, kt, vt, fwd[0], fwd[1], seed, seed, None, None, None, S, S, 0.0, causal,
            scale=0.2,
        )  # fmt: skip
        return fwd, bwd

    def flash(q, k, v, dout):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fwd = aten._scaled_dot_product_flash_attention.default(qt, kt, vt, 0.0, causal, False, scale=0.2)
        bwd = aten._scaled_dot_product_flash_attention_backward.default(
            dout.transpose(1, 2), qt, kt, vt, fwd[0], fwd[1], None, None, S, S, 0.0, causal, fwd[6], fwd[7], scale=0.2
        )
        return fwd, bwd

    return {"cudnn": (cudnn, HKV), "flash": (flash, H)}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("op", ["cudnn", "flash"])
def test_the_ops_answer_with_the_real_ops_layouts_and_the_reference_values(op, causal):
    """Outputs on the virtual device: virtual ``cuda`` tensors with the shapes, strides and dtypes of torch's meta
    functions for the real op (bf16 out, float32 LSE: cuDNN ``[B, H, Sq, 1]``, flash ``[B, H, Sq]``; gradients like
    their inputs, GQA key / value heads unexpanded on cuDNN), and the dense float64 reference's values."""
    run, hkv = _calls(causal)[op]
    with FakeTensorMode():  # torch's meta functions of the real ops, on fake CUDA tensors of the same shapes
        shapes = ((B, S, H, D), (B, S, hkv, D), (B, S, hkv, D), (B, S, H, D))
        fake = run(*(torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes))
    with VirtualCuda(kernels=True):
        q, k, v, dout = _inputs("cuda", hkv=hkv)
        fwd, bwd = run(q, k, v, dout)
        outputs = [t for t in (*fwd, *bwd) if isinstance(t, torch.Tensor)]
        assert all(isinstance(t, VirtualTensor) and t.device == CUDA for t in outputs)
        got = [t._elem for t in (fwd[0], fwd[1], *bwd)]
    tensors = [0, 1, 6, 7] if op == "flash" else [0, 1]  # cuDNN's seed / offset are meta tensors in its trace
    assert [_layout(fwd)[i] for i in tensors] == [_layout(fake[0])[i] for i in tensors]
    assert fwd[4:6] == fake[0][4:6] == (S, S)
    assert _layout(bwd) == _layout(fake[1])
    lse_shape = (B, H, S, 1) if op == "cudnn" else (B, H, S)
    assert (tuple(fwd[1].shape), fwd[1].dtype) == (lse_shape, torch.float32)
    assert fwd[0].dtype == torch.bfloat16 and fwd[0].shape == (B, H, S, D)

    ref = dense_attention(*_inputs("cpu", hkv=hkv)[:3], scale=0.2, causal=causal, dout=_inputs("cpu", hkv=hkv)[3])
    out, lse, dq, dk, dv = got
    assert max_err(lse.reshape(B, H, S), ref.lse) < 1e-4  # float32 from float64
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out.transpose(1, 2), *(g.transpose(1, 2) for g in (dq, dk, dv))),
                          (ref.out, ref.dq, ref.dk, ref.dv)):  # fmt: skip
        assert max_err(a, r) <= 1e-2 * r.abs().max().item(), name  # one bf16 rounding of the float64 values


def test_without_kernels_the_ops_fail_as_on_a_cpu():
    """The default device models no CUDA-only kernel: the op fails, the probe says so, the routes fall back."""
    with VirtualCuda():
        q, k, v, _ = _inputs("cuda")
        with pytest.raises(NotImplementedError, match="Could not run"):
            aten._scaled_dot_product_flash_attention.default(*(t.transpose(1, 2) for t in (q, k, k)), 0.0, True)
        assert "raised" in probe_backend("cudnn", CUDA, torch.bfloat16, 64)


def test_the_router_resolves_cudnn_with_its_bias_on_the_virtual_device():
    """Capability (9, 0), cuDNN 9.1: the ``cudnn`` and ``torch_flash`` probe blocks pass (forward and backward against
    ``math``), and the runtime's router takes ``cudnn`` with the additive bias for masked blocks (its masked probe
    passes too), no flash-attn build installed."""
    with VirtualCuda(kernels=True):
        cap = probe_device(CUDA)
        assert (cap.compute_capability, cap.cudnn_version, cap.torch_cudnn_attention) == ((9, 0), 91002, True)
        assert probe_backend("cudnn", CUDA, torch.bfloat16, 64) is None
        assert probe_backend("torch_flash", CUDA, torch.bfloat16, 64) is None
        router = FPDTRuntime(FPDTConfig(chunk_size=16, offload=False)).router(CUDA, torch.bfloat16, 64)
    assert (router.backend, router.cudnn_bias, router.flash) == ("cudnn", True, None)


def _chunked(backend: str, chunk: int, keys: torch.Tensor | None, monkeypatch) -> tuple:
    """``fpdt_attention`` forward and backward of the inputs on the virtual device: ``(out, dq, dk, dv)`` as CPU
    float64, the host syncs of the call, the cudnn blocks run and the math blocks run."""
    cudnn, math = record_kernel(monkeypatch, "cudnn"), count_math(monkeypatch)
    with VirtualCuda(kernels=True) as vdev:
        rt = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=False, backend=backend))
        rt.router(CUDA, torch.bfloat16, D)  # resolved (probed) before the count: once per runtime, not per call
        q, k, v, dout = _inputs("cuda")
        spec = None if keys is None else MaskSpec(key_mask=keys.to("cuda"))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        math.clear()
        cudnn.clear()
        before = vdev.sync_count
        out = fpdt_attention(*leaves, rt, scale=0.2, spec=spec)
        out.backward(dout)
        syncs = vdev.sync_count - before
        result = [t._elem.double() for t in (out.detach(), *(x.grad for x in leaves))]
    monkeypatch.undo()
    return result, syncs, len(cudnn), len(math)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding"])
def test_chunked_attention_runs_on_cudnn_within_bf16_of_math_with_no_sync_per_block(monkeypatch, masked):
    """Chunks of 10 and of 4 tokens (4 and 10 query chunks): every block on ``cudnn`` (the padded ones with its bias),
    none on ``math``; output and gradients within twice ``math``'s bf16 error against float64, plus a bf16 ulp; the
    host syncs of a forward and backward the same at 4 and 10 chunks (none per block)."""
    keys = None
    if masked:
        keys = torch.ones(B, S, dtype=torch.bool)
        keys[0, :7] = False  # left padding of row 0
    q, k, v, dout = _inputs("cpu")
    ref = dense_attention(q, k, v, None if keys is None else MaskSpec(key_mask=keys), scale=0.2, causal=True, dout=dout)
    ref = (ref.out, ref.dq, ref.dk, ref.dv)
    syncs = {}
    for chunk in (10, 4):
        got, syncs[chunk], cudnn_blocks, math_blocks = _chunked("auto", chunk, keys, monkeypatch)
        n = S // chunk
        assert cudnn_blocks == 2 * n * (n + 1) // 2 and math_blocks == 0, chunk
        base, *_ = _chunked("math", chunk, keys, monkeypatch)
        for name, a, m, r in zip(("out", "dq", "dk", "dv"), got, base, ref):
            assert max_err(a, r) <= 2 * max_err(m, r) + 2**-8 * r.abs().max().item(), (chunk, name)
    assert syncs[10] == syncs[4], syncs
