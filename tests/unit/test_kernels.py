"""Block kernels against an independent float64 reference: forward (out, lse), backward, LSE merge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from standins import aten_references_on_cpu, dense_attention, install_flash
from testkit import max_err, rel_err

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.kernels import DeviceCapability, probe_device, resolve_backend, select_backend
from hf_fpdt.attention.merge import merge_block
from hf_fpdt.attention.routes import block_backward, block_forward
from hf_fpdt.config import BACKENDS

# (B, Sq, Sk, Hq, Hkv, D): MHA, GQA, MQA; odd lengths and an odd head dim.
SHAPES = [(1, 37, 37, 4, 4, 16), (3, 64, 64, 4, 2, 59), (2, 45, 45, 6, 1, 32)]
CROSS_SHAPES = [(1, 37, 80, 4, 4, 16), (3, 64, 29, 4, 2, 59), (2, 45, 128, 6, 1, 32)]


def _ref_lse(q, k, scale, causal):
    return dense_attention(q, k, k, scale=scale, causal=causal).lse


def _inputs(b, sq, sk, h, hkv, d, dtype):
    q = torch.randn(b, sq, h, d).to(dtype)
    k = torch.randn(b, sk, hkv, d).to(dtype)
    v = torch.randn(b, sk, hkv, d).to(dtype)
    dout = torch.randn(b, sq, h, d).to(dtype)
    return q, k, v, dout


def _ref_grads(q, k, v, dout, scale, causal):
    ref = dense_attention(q, k, v, scale=scale, causal=causal, dout=dout)
    return ref.out, ref.dq, ref.dk, ref.dv


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


# ---- backend selection by capability (no GPU needed: the capability is injected) ----------------------

H100 = DeviceCapability("cuda", (9, 0), cudnn_version=91000, torch_cudnn_attention=True)
A100 = DeviceCapability("cuda", (8, 0), cudnn_version=91000, torch_cudnn_attention=True)
T4 = DeviceCapability("cuda", (7, 5), cudnn_version=91000, torch_cudnn_attention=True)
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "cap,dtype,head_dim,expected",
    [
        (H100, torch.bfloat16, 64, "cudnn"),
        (H100, torch.float16, 128, "cudnn"),
        (H100, torch.bfloat16, 256, "torch_flash"),  # beyond cuDNN's head dims
        (H100, torch.bfloat16, 59, "math"),  # no fused kernel takes an odd head dim
        (H100, torch.float32, 64, "math"),
        (DeviceCapability("cuda", (9, 0), 8902, True), torch.bfloat16, 64, "torch_flash"),  # cuDNN 8
        (DeviceCapability("cuda", (9, 0), 91000), torch.bfloat16, 64, "torch_flash"),  # torch without the op
        (DeviceCapability("cuda", (9, 0), flash_attn=True, flash_attn3=True), torch.bfloat16, 64, "flash_attn3"),
        (DeviceCapability("cuda", (10, 0), 91000, True, flash_attn3=True), torch.bfloat16, 64, "cudnn"),
        (DeviceCapability("cuda", (10, 0), flash_attn=True, flash_attn3=True), torch.bfloat16, 64, "flash_attn"),
        (DeviceCapability("cuda", (8, 0), flash_attn=True), torch.bfloat16, 64, "flash_attn"),
        (A100, torch.bfloat16, 64, "torch_flash"),
        (A100, torch.float64, 64, "math"),
        (T4, torch.float16, 64, "math"),
        (DeviceCapability("cpu"), torch.bfloat16, 64, "cpu_flash"),
        (DeviceCapability("cpu"), torch.float64, 59, "cpu_flash"),
        (DeviceCapability("mps"), torch.float16, 64, "math"),
    ],
)
def test_select_backend_by_capability(cap, dtype, head_dim, expected):
    device = torch.device(cap.device_type, 0) if cap.device_type == "cuda" else torch.device(cap.device_type)
    assert select_backend(device, dtype, head_dim, cap) == expected
    assert resolve_backend("auto", device, dtype, head_dim, cap) == expected
    assert resolve_backend(None, device, dtype, head_dim, cap) == expected
    assert resolve_backend(expected, device, dtype, head_dim, cap) == expected  # a usable name passes


@pytest.mark.parametrize(
    "requested,cap,dtype,why",
    [
        ("cudnn", DeviceCapability("cpu"), torch.bfloat16, "needs a CUDA device"),
        ("cudnn", A100, torch.bfloat16, "compute capability >= 9.0"),
        ("cudnn", H100, torch.float32, "float16 or bfloat16"),
        ("flash_attn", H100, torch.bfloat16, "flash-attn package is not installed"),
        ("flash_attn3", DeviceCapability("cuda", (8, 0), flash_attn3=True), torch.bfloat16, r"9\.x"),
        ("torch_flash", T4, torch.float16, r">= 8\.0 \(found 7\.5\)"),
        ("cpu_flash", H100, torch.bfloat16, "needs a CPU device"),
    ],
)
def test_a_requested_backend_that_cannot_run_is_refused_with_the_reason(requested, cap, dtype, why):
    with pytest.raises(ValueError, match=why) as err:
        resolve_backend(requested, CUDA, dtype, 64, cap)
    assert "FPDT_BACKEND" in str(err.value) and "math" in str(err.value)  # names the fix and what can run


def test_probe_on_cpu_and_config_backend(monkeypatch):
    assert probe_device(torch.device("cpu")) == DeviceCapability("cpu")
    assert FPDTConfig().backend == "auto"
    monkeypatch.setenv("FPDT_BACKEND", " Math ")
    assert FPDTConfig().backend == "math"
    assert FPDTConfig(backend="cudnn").backend == "cudnn"  # explicit wins over the environment
    for bad in ("flash", "nope"):
        monkeypatch.setenv("FPDT_BACKEND", bad)
        with pytest.raises(ValueError, match="FPDT_BACKEND"):
            FPDTConfig()
    with pytest.raises(ValueError, match="backend='fa2'"):
        FPDTConfig(backend="fa2")


def test_runtime_resolves_the_backend_once_and_refuses_an_impossible_one():
    q = torch.randn(1, 24, 2, 8)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=8, offload=False, backend="math"))
    fpdt_attention(q, q, q, runtime)
    assert runtime.kernel_backend(q.device, q.dtype, 8) == "math"
    assert FPDTRuntime(FPDTConfig(backend="math"), backend="cpu_flash").kernel_backend(q.device, q.dtype, 8) == (
        "cpu_flash"
    )
    bad = FPDTRuntime(FPDTConfig(chunk_size=8, offload=False, backend="cudnn"))
    with pytest.raises(ValueError, match="'cudnn' cannot run .* needs a CUDA device"):
        fpdt_attention(q, q, q, bad)


# ---- the CUDA backends' plumbing on CPU: the ops emulated by an fp64 reference of their contract ------


def _forward_backend(call):
    """A stand-in build's forward calls, by backend name."""
    return call.backend if call.op == "fwd" else None


@pytest.fixture
def emulated_cuda_ops(monkeypatch):
    """CPU stand-ins (tests/standins.py), with the upstream signatures, for the ops the CUDA backends call: torch's
    cuDNN attention pair (the references registered as CPU kernels of the aten ops), flash-attn 2 (2.7+) and
    FlashAttention-3. Each checks the arguments the op's contract fixes, so a wrong layout or argument order fails
    here."""
    seen = []
    install_flash(monkeypatch, "2.7", calls=seen, record=_forward_backend)
    install_flash(monkeypatch, "fa3", calls=seen, record=_forward_backend)
    cudnn = "_scaled_dot_product_cudnn_attention"
    with aten_references_on_cpu(record=lambda op: seen.append("cudnn") if op == cudnn else None):
        yield seen


@pytest.mark.parametrize("backend", ["cudnn", "flash_attn", "flash_attn3"])
@pytest.mark.parametrize("causal,shape", [(True, SHAPES[1]), (False, CROSS_SHAPES[2])], ids=["causal", "cross"])
def test_cuda_backends_plumbing_is_exact_with_emulated_ops(emulated_cuda_ops, backend, causal, shape):
    q, k, v, dout = _inputs(*shape, torch.float32)
    scale = 0.37
    out, lse = block_forward(q, k, v, causal, scale, backend)
    assert emulated_cuda_ops == [backend]  # the named backend's op ran
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal, scale, backend)
    ref = _ref_grads(q, k, v, dout, scale, causal)
    assert rel_err(lse, _ref_lse(q, k, scale, causal)) < 1e-5
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert a.shape == r.shape and rel_err(a, r) < 1e-5, name


@pytest.mark.parametrize("backend", ["cudnn", "flash_attn3"])
def test_cuda_backends_blocks_merge_to_whole_sequence(emulated_cuda_ops, backend):
    test_blocks_merge_to_whole_sequence(backend, torch.float32, 1e-5)  # supplied final out/lse != the block's own


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_calls_fit_the_cuda_ops_under_fake_tensors(causal):
    """The ``cudnn`` backend traced with fake CUDA tensors: torch's own meta functions accept the
    arguments (schema, order, keyword ``scale``), the lse goes back in as ``[B, H, Sq, 1]``, and GQA key/value
    heads reach the op unexpanded."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
            named.update({a.name: x for a, x in zip(func._schema.arguments, args)}, **kwargs)
            self.calls[func.overloadpacket.__name__] = named  # every argument by its schema name
            return func(*args, **kwargs)

    b, sq, sk, h, hkv, d = 2, 64, 48 if not causal else 64, 8, 2, 64
    with FakeTensorMode(), Record() as rec:
        q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, sk, hkv, d, dtype=torch.bfloat16, device="cuda")
        out, lse = block_forward(q, k, torch.empty_like(k), causal, 0.125, "cudnn")
        dq, dk, dv = block_backward(torch.empty_like(out), q, k, k, out, lse, causal, 0.125, "cudnn")
    assert (out.shape, out.dtype, out.device.type, out.is_contiguous()) == (q.shape, q.dtype, "cuda", True)
    assert (lse.shape, lse.dtype) == ((b, h, sq), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    fwd = rec.calls["_scaled_dot_product_cudnn_attention"]
    assert fwd["query"].shape == (b, h, sq, d) and fwd["key"].shape == fwd["value"].shape == (b, hkv, sk, d)
    assert (fwd["attn_bias"], fwd["compute_log_sumexp"], fwd["dropout_p"]) == (None, True, 0.0)
    assert (fwd["is_causal"], fwd["scale"]) == (causal, 0.125)
    bwd = rec.calls["_scaled_dot_product_cudnn_attention_backward"]
    assert bwd["logsumexp"].shape == (b, h, sq, 1) and bwd["out"].shape == bwd["grad_out"].shape == (b, h, sq, d)
    assert (bwd["max_q"], bwd["max_k"], bwd["dropout_p"]) == (sq, sk, 0.0)
    assert (bwd["is_causal"], bwd["scale"]) == (causal, 0.125)


def test_the_registry_names_every_backend_once_with_both_directions():
    """Every backend of the config is one registry entry with a forward and a backward, a masked forward exactly
    where it has a masked backward, and the preference orders name registry kernels only."""
    from hf_fpdt.attention.kernels import KERNELS, PREFERENCE, kernel_table

    assert tuple(KERNELS) == BACKENDS and all(name == k.name for name, k in KERNELS.items())
    for k in KERNELS.values():
        assert callable(k.forward) and callable(k.backward)
        assert (k.masked_forward is None) == (k.masked_backward is None)
    assert all(set(order) <= set(KERNELS) and order[-1] == "math" for order in PREFERENCE.values())
    table = kernel_table()
    assert all(f"| `{name}` |" in table for name in BACKENDS)


# ---- flash-attn builds: the call read from the installed module's signature, chosen only after a probe block ----


FA3_VERSIONS = {"beta": "fa3-beta", "positional": "fa3-2025", "base2": "fa3-base2"}


@pytest.fixture
def fake_builds(monkeypatch):
    """``install(variant)`` puts a stand-in FA3 build of that generation into ``sys.modules``; returns the ops run."""
    seen: list = []

    def install(variant: str) -> list:
        return install_flash(monkeypatch, FA3_VERSIONS[variant], calls=seen, record=_forward_backend)[1]

    return install


@pytest.mark.parametrize("variant", ["beta", "positional"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_flash_attn3_call_follows_the_installed_signature(fake_builds, variant, softcap):
    """The 2024 beta (positional, returns ``(out, q, ...)``: ``res[1]`` is q, not the LSE) and a positional-only
    build: both called right, the LSE found by what it is; a softcap goes to the build that takes one, and to the
    ``math`` path for the beta, which has none."""
    seen = fake_builds(variant)
    q, k, v, dout = _inputs(2, 33, 33, 4, 2, 16, torch.float32)
    out, lse = block_forward(q, k, v, True, 0.3, "flash_attn3", softcap=softcap)
    grads = block_backward(dout, q, k, v, out, lse, True, 0.3, "flash_attn3", softcap=softcap)
    assert seen == ([] if variant == "beta" and softcap else ["flash_attn3"])
    ref_out, ref_lse, *ref_grads = dense_attention(q, k, v, scale=0.3, causal=True, softcap=softcap, dout=dout)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32 and rel_err(lse, ref_lse) < 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert rel_err(got, want) < 1e-5, name


def test_a_build_that_fails_its_probe_is_passed_over_with_one_log_line(fake_builds, caplog):
    """A build whose LSE is in base 2 imports and runs, and would merge blocks wrongly: its probe block fails, the
    next backend is chosen, and one line on the ``hf_fpdt`` logger says which and why."""
    import logging

    from hf_fpdt.attention.kernels import probe_backend

    fake_builds("base2")
    cap = DeviceCapability("cuda", (9, 0), flash_attn3=True)  # no cuDNN op, no FA2: flash_attn3, then torch_flash
    cpu = torch.device("cpu")

    def probe(name):  # the stand-in runs on CPU; torch_flash's CUDA op would not, so it stands for a good kernel
        return probe_backend(name, cpu, torch.bfloat16, 64) if name == "flash_attn3" else None

    assert "base 2" in probe("flash_attn3")
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        assert select_backend(CUDA, torch.bfloat16, 64, cap, probe) == "torch_flash"
    lines = [r for r in caplog.records if r.name == "hf_fpdt"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "'torch_flash'" in lines[0].getMessage() and "flash_attn3 (probe failed" in lines[0].getMessage()
    with pytest.raises(ValueError, match="'flash_attn3' cannot run .* probe failed: .*base 2"):
        resolve_backend("flash_attn3", CUDA, torch.bfloat16, 64, cap, probe)
    fake_builds("positional")
    assert probe_backend("flash_attn3", cpu, torch.bfloat16, 64) is None  # a right build passes the same probe
    assert select_backend(CUDA, torch.bfloat16, 64, cap, probe) == "flash_attn3"


def test_flash_builds_that_cannot_be_called_are_refused_with_the_reason(monkeypatch):
    """Not importable (a wheel built for another torch raises at import), or an entry point with a parameter a
    dense block cannot fill: ``flash_calls`` says why, and ``probe_device`` would not offer the backend."""
    import sys
    import types

    from hf_fpdt.attention.flash_builds import flash_calls

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise ImportError("undefined symbol: _ZN3c104cuda9SetDeviceEi")

    monkeypatch.setitem(sys.modules, "flash_attn_interface", Broken("flash_attn_interface"))
    assert "does not import" in flash_calls("flash_attn3")
    odd = types.ModuleType("flash_attn_interface")
    odd._flash_attn_forward = lambda q, k, v, softmax_scale, causal, tile_order: None
    odd._flash_attn_backward = lambda dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal: None
    monkeypatch.setitem(sys.modules, "flash_attn_interface", odd)
    assert "_flash_attn_forward(tile_order)" in flash_calls("flash_attn3")


def test_flash_attn2_custom_op_and_keyword_only_entry_points(monkeypatch):
    """FA2 2.7+ registers ``_flash_attn_backward`` as a ``torch.library.custom_op`` (its Python signature is
    ``(*args, **kwargs)``: the parameters come from the function it wraps) and a build may take options after
    ``*``: both called right, and a softcap reaches the build that has one."""
    _, seen = install_flash(monkeypatch, "2.7-op", record=_forward_backend)
    q, k, v, dout = _inputs(1, 29, 29, 4, 1, 8, torch.float32)
    out, lse = block_forward(q, k, v, True, 0.4, "flash_attn", softcap=4.0)
    grads = block_backward(dout, q, k, v, out, lse, True, 0.4, "flash_attn", softcap=4.0)
    assert seen == ["flash_attn"]
    ref_out, ref_lse, *ref_grads = dense_attention(q, k, v, scale=0.4, causal=True, softcap=4.0, dout=dout)
    assert rel_err(lse, ref_lse) < 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert rel_err(got, want) < 1e-5, name


def test_the_docs_kernel_table_is_the_registry():
    """docs/concepts.md's kernel table is :func:`~hf_fpdt.attention.kernels.kernel_table` (regenerate it there when a
    kernel changes what it takes)."""
    from pathlib import Path

    from hf_fpdt.attention.kernels import kernel_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "concepts.md").read_text()
    between = text.split("<!-- kernel table: start -->\n", 1)[1].split("\n<!-- kernel table: end -->", 1)[0]
    assert between == kernel_table()
