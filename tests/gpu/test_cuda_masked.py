"""Masked and softcapped blocks at real chunk sizes on CUDA (issue 44, item 6): documents, padding, a window shorter
than the chunk and Gemma 2's softcap, chunks of 4K and 16K, bf16 with GQA. Each call's output and gradients equal a
float64 reference on sampled query rows (the output gradient is zero elsewhere, so the reference needs only those
rows against every key) within bf16's bound; the call's reserved memory stays under 1.3x the plain causal call's
of the same shape, and the caching allocator never had to free its cache and retry (``num_alloc_retries == 0``).

Window-cut blocks on an installed flash-attn build that takes a window (issue 44, item 1): each block geometry through
the build's ``window_size`` (its band's rectangle) within flash-attn's own rule of a float64 reference (twice a bf16
PyTorch reference's error, plus bf16's rounding of the result), and the masked bench's window case (``hf_fpdt.bench
masked``, Mistral-shaped, in this process) with that backend runs every window-cut block on the build, none on
``math`` (calls counted). Skipped, naming why, where no such build is installed and usable.

Document-cut blocks on an installed flash-attn build's varlen calls (issue 44, item 1): blocks of packed documents
(the diagonal block, an earlier chunk's block, batch 2 with different documents per row, with and without a window,
with a softcap) run as one varlen batch of their (row, document) segments, within the same rule of float64 as
``math``; and the masked bench's documents case with the device's default backend (``cudnn`` on Hopper) runs every
document-cut block on the runtime's flash-attn build (``FPDTRuntime.router``'s ``flash``), none on ``math``.

Skipped without CUDA (``tests/conftest.py``); the command is in docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch
from testkit import count_math

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention import cudnn_blocks, kernels, routes
from hf_fpdt.attention.block_keep import BlockKeep, DocSegments
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.flash_builds import FlashCalls, flash_calls
from hf_fpdt.attention.routes import Router

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
BF16_BOUND = 2e-2  # relative to the reference's largest magnitude (bf16's 8 bits, summed over 32K keys in fp32)
ROWS = 256  # query rows checked against the float64 reference: the last ones of the first and the last chunk


def _spec(case: str, s: int, device: torch.device) -> tuple[MaskSpec, torch.Tensor]:
    """The call's spec and its ``[1, S, S]``-free description: per query row, which keys it sees (as a function)."""
    docs = (torch.arange(s, device=device) * 7 // s).unsqueeze(0)  # 7 documents, none aligned to a chunk
    keys = torch.ones(1, s, dtype=torch.bool, device=device)
    keys[:, : s // 10] = False  # left padding of a tenth
    return {
        "causal": MaskSpec(),
        "documents": MaskSpec(docs=docs),
        "padding": MaskSpec(key_mask=keys),
        "window": MaskSpec(window=1000),
        "softcap": MaskSpec(softcap=50.0),
    }[case], (docs, keys)


def _reference_rows(q, k, v, dout, rows, case, spec, extra, scale):
    """float64 output of ``rows`` and the gradients of ``sum(out[rows] * dout[rows])`` w.r.t. q, k, v."""
    docs, keys = extra
    s = k.shape[1]
    g = HEADS // KV_HEADS
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    sc = q64[:, rows].transpose(1, 2) @ k64.repeat_interleave(g, 2).permute(0, 2, 3, 1) * scale  # [1, H, r, S]
    if spec.softcap is not None:
        sc = spec.softcap * torch.tanh(sc / spec.softcap)
    t, u = rows[:, None], torch.arange(s, device=q.device)[None, :]
    keep = u <= t
    if case == "window":
        keep &= u > t - spec.window
    if case == "documents":
        keep &= docs[0, rows][:, None] == docs[0][None, :]
    if case == "padding":
        keep &= keys[0][None, :]
    sc = sc.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(sc.softmax(-1))  # a row that sees no key: 0, as sdpa's bool mask gives
    out = (p @ v64.repeat_interleave(g, 2).transpose(1, 2)).transpose(1, 2)
    out.backward(dout[:, rows].double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _call(case: str, chunk: int, device: torch.device):
    s = 2 * chunk
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, KV_HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16) for _ in "kv")
    rows = torch.cat([torch.arange(chunk - ROWS // 2, chunk), torch.arange(s - ROWS // 2, s)]).to(device)
    dout = torch.zeros(q.shape, device=device, dtype=torch.bfloat16)
    dout[:, rows] = torch.randn(1, ROWS, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
    spec, extra = _spec(case, s, device)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=False))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    out = fpdt_attention(*leaves, runtime, spec=spec)
    out.backward(dout)
    torch.cuda.synchronize(device)
    reserved = torch.cuda.max_memory_reserved(device) - before
    retried = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    got = (out.detach()[:, rows], *(t.grad for t in leaves))
    return got, (q, k, v, dout, rows, spec, extra), reserved, retried


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("chunk", [4096, 16384])
@pytest.mark.parametrize("case", ["documents", "padding", "window", "softcap"])
def test_masked_blocks_exact_and_bounded(cuda, case, chunk):
    _, _, causal_reserved, _ = _call("causal", chunk, cuda)
    got, (q, k, v, dout, rows, spec, extra), reserved, retried = _call(case, chunk, cuda)
    ref = _reference_rows(q, k, v, dout, rows, case, spec, extra, HEAD_DIM**-0.5)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) < BF16_BOUND, f"{case} chunk {chunk}: {name} off by {_rel(a, r):.3g}"
    assert retried == 0, f"{case} chunk {chunk}: the allocator freed its cache and retried {retried} times"
    assert reserved <= 1.3 * causal_reserved, (
        f"{case} chunk {chunk}: reserved {reserved / 2**20:.0f} MiB, causal {causal_reserved / 2**20:.0f} MiB"
    )


# ---- window-cut blocks through flash-attn's window_size (issue 44, item 1) ----

BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
WINDOW_BLOCKS = {  # (qs, ks, sq, sk, causal, window): the pipeline's cut blocks at chunk 4096
    "diagonal": (4096, 4096, 4096, 4096, True, 1000),
    "previous": (4096, 0, 4096, 4096, False, 1000),  # a rectangle: 999 rows against the last 999 keys
    "last-shorter": (8192, 4096, 1500, 4096, False, 3000),  # Sq != Sk, the last chunk
    "longer-than-chunks": (12288, 4096, 4096, 4096, False, 4096 * 2 + 1),  # window 2 * chunk + 1
}


def _window_backend(name: str, device: torch.device, head_dim: int) -> str:
    """``name`` if its build is installed, takes a window and passes the backend's probe here; else skip, saying
    why."""
    calls = flash_calls(name)
    if not isinstance(calls, FlashCalls):
        pytest.skip(f"{name}: {calls}")
    if not calls.window:
        pytest.skip(f"{name}: this build takes no window_size")
    try:
        return kernels.resolve_backend(name, device, torch.bfloat16, head_dim)
    except ValueError as err:
        pytest.skip(str(err))


def _dense_block(q, k, v, dout, keep, scale, softcap, dtype):
    """The block's attention under ``keep`` ([Sq, Sk]) computed in ``dtype`` by autograd (bf16: the PyTorch reference
    flash-attn's tests use, float64: the truth): ``(out, lse, dq, dk, dv)``."""
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.to(dtype, copy=True).requires_grad_() for t in (q, k, v))
    s = qd.transpose(1, 2) @ kd.repeat_interleave(g, 2).permute(0, 2, 3, 1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.float().logsumexp(-1)
    p = torch.nan_to_num(s.softmax(-1))
    out = (p @ vd.repeat_interleave(g, 2).transpose(1, 2)).transpose(1, 2)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("block", list(WINDOW_BLOCKS))
@pytest.mark.parametrize("name", ["flash_attn3", "flash_attn"])
def test_window_block_through_flash_attn_equals_math_and_float64(cuda, name, block, softcap):
    """One window-cut block (bf16, GQA 16/4, head dim 128) on the build: routed there (not ``math``), and out,
    dq, dk, dv within ``2 * err(bf16 PyTorch reference) + u * max|ref|`` of float64 (flash-attn's test rule), the
    same bound the ``math`` path meets; lse (float32 statistics on both paths) within 1e-3 of float64."""
    backend = _window_backend(name, cuda, HEAD_DIM)
    qs, ks, sq, sk, causal, window = WINDOW_BLOCKS[block]
    keep = BlockKeep(qs, ks, sq, sk, causal=causal, window=window)
    assert Router(backend).route(keep, softcap) == (backend, keep.window_only())
    gen = torch.Generator(device=cuda).manual_seed(1)
    q, dout = (torch.randn(1, sq, HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(1, sk, KV_HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "kv")
    scale, whole = HEAD_DIM**-0.5, keep.whole(cuda)
    truth = _dense_block(q, k, v, dout, whole, scale, softcap, torch.float64)
    base = _dense_block(q, k, v, dout, whole, scale, softcap, torch.bfloat16)
    for path in (backend, "math"):
        out, lse = routes.block_forward(q, k, v, False, scale, path, mask=keep, softcap=softcap)
        final = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows with no key: as the pipeline hands them
        grads = routes.block_backward(dout, q, k, v, out.to(q.dtype), final, False, scale, path, mask=keep,
                                       softcap=softcap)  # fmt: skip
        seen = torch.isfinite(truth[1])
        assert torch.equal(torch.isneginf(lse), ~seen), f"{path}: rows with no key"
        assert float((lse[seen] - truth[1][seen]).abs().max()) < 1e-3, f"{path}: lse"
        for what, got, ref, pt in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), truth[:1] + truth[2:], base[:1] + base[2:]
        ):
            err = float((got.double() - ref).abs().max())
            bound = 2 * float((pt.double() - ref).abs().max()) + BF16_U * float(ref.abs().max())
            assert err <= bound, f"{path} {block}: {what} off by {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", ["flash_attn3", "flash_attn"])
def test_the_masked_bench_window_case_runs_on_flash_attn(cuda, name, monkeypatch):
    """``hf_fpdt.bench masked``'s window case (Mistral-shaped, window 1000, 16K tokens, chunk 4096: per layer the 4
    diagonal blocks and the 3 previous-chunk blocks are cut by the window), with the build forced: every
    window-cut block on the build with a window, forward (and its recomputation) and backward, no ``math`` block."""
    from hf_fpdt.bench.masked import measure

    backend = _window_backend(name, cuda, 32)
    windowed = {"fwd": 0, "bwd": 0}
    fwd, bwd = FlashCalls.forward, FlashCalls.backward

    def forward(self, *args, window=(-1, -1), **kw):
        windowed["fwd"] += window != (-1, -1)
        return fwd(self, *args, window=window, **kw)

    def backward(self, *args, window=(-1, -1), **kw):
        windowed["bwd"] += window != (-1, -1)
        return bwd(self, *args, window=window, **kw)

    monkeypatch.setattr(FlashCalls, "forward", forward)  # kernels pass a block's window by keyword
    monkeypatch.setattr(FlashCalls, "backward", backward)
    math_calls = count_math(monkeypatch)
    payload = {"case": "window", "length": 16384, "chunk_size": 4096, "backend": backend, "window": 1000}
    payload.update(documents=7, softcap=50.0, device=str(cuda), threads=0)
    result = measure(payload)
    assert math_calls == [] and torch.isfinite(torch.tensor(result["loss"]))
    layers, cut = 2, 4 + 3
    assert windowed["bwd"] == layers * cut, windowed
    assert windowed["fwd"] >= layers * cut and windowed["fwd"] % (layers * cut) == 0, windowed


# ---- document-cut blocks through flash-attn's varlen calls (issue 44, item 1) ----

DOC_CHUNK = 2048
DOC_BLOCKS = {  # (documents per row, query chunk i, key chunk j, window): chunks of DOC_CHUNK, 3 of them
    "diagonal": ([[700, 1900, 1000, 2544]], 1, 1, None),
    "previous": ([[700, 1900, 1000, 2544]], 1, 0, None),
    "batch2-previous": ([[2100, 3000, 1044], [500, 4000, 1644]], 2, 1, None),
    "diagonal-window": ([[700, 1900, 1000, 2544]], 1, 1, 1000),
    "previous-window": ([[700, 1900, 1000, 2544], [2000, 4144]], 1, 0, 1000),
}


def _varlen_backend(name: str, device: torch.device, head_dim: int) -> str:
    """``name`` if its build is installed with varlen calls and passes the backend's probe here; else skip."""
    calls = flash_calls(name)
    if not isinstance(calls, FlashCalls):
        pytest.skip(f"{name}: {calls}")
    if calls.varlen is None:
        pytest.skip(f"{name}: this build has no varlen entry points hf_fpdt can fill")
    try:
        return kernels.resolve_backend(name, device, torch.bfloat16, head_dim)
    except ValueError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("block", list(DOC_BLOCKS))
@pytest.mark.parametrize("name", ["flash_attn3", "flash_attn"])
def test_document_block_through_flash_varlen_equals_math_and_float64(cuda, name, block, softcap):
    """One document-cut block (bf16, GQA 16/4, head dim 128) on the build's varlen calls: routed there as its segments
    (not ``math``), and out, dq, dk, dv within ``2 * err(bf16 PyTorch reference) + u * max|ref|`` of float64, the
    bound ``math`` meets too; lse within 1e-3 of float64, ``-inf`` exactly on the rows that see no key."""
    backend = _varlen_backend(name, cuda, HEAD_DIM)
    calls = flash_calls(backend)
    if softcap is not None and not calls.varlen.softcap:
        pytest.skip(f"{name}: this build's varlen calls take no softcap")
    docs, i, j, window = DOC_BLOCKS[block]
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in docs]).to(cuda)
    spec = MaskSpec(docs=ids, window=window, softcap=softcap)
    keep = spec.blocks((DOC_CHUNK,) * 3, ids.shape[0]).cut(i, j, cuda)
    assert keep is not None and keep.docs_q is not None
    route, plan = Router("cudnn", calls).route(keep, softcap)
    assert route == backend and isinstance(plan, DocSegments), (route, plan)
    b, gen = ids.shape[0], torch.Generator(device=cuda).manual_seed(2)
    shape_q, shape_k = (b, DOC_CHUNK, HEADS, HEAD_DIM), (b, DOC_CHUNK, KV_HEADS, HEAD_DIM)
    q, dout = (torch.randn(shape_q, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(shape_k, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "kv")
    scale, whole = HEAD_DIM**-0.5, keep.whole(cuda).unsqueeze(1)  # [B, 1, Sq, Sk]
    truth = _dense_block(q, k, v, dout, whole, scale, softcap, torch.float64)
    base = _dense_block(q, k, v, dout, whole, scale, softcap, torch.bfloat16)
    # the build as the backend; as the second backend beside cudnn (its masked blocks only); math
    for path, build in ((backend, calls), ("cudnn", calls), ("math", None)):
        kw = {"mask": keep, "softcap": softcap, "flash_build": build}
        out, lse = routes.block_forward(q, k, v, i == j, scale, path, **kw)
        final = lse.masked_fill(torch.isneginf(lse), float("inf"))
        grads = routes.block_backward(dout, q, k, v, out.to(q.dtype), final, i == j, scale, path, **kw)
        seen = torch.isfinite(truth[1])
        assert torch.equal(torch.isneginf(lse), ~seen), f"{path}: rows with no key"
        assert float((lse[seen] - truth[1][seen]).abs().max()) < 1e-3, f"{path}: lse"
        for what, got, ref, pt in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), truth[:1] + truth[2:], base[:1] + base[2:]
        ):
            err = float((got.double() - ref).abs().max())
            bound = 2 * float((pt.double() - ref).abs().max()) + BF16_U * float(ref.abs().max())
            assert err <= bound, f"{path} {block}: {what} off by {err:.3g} > {bound:.3g}"


def test_the_masked_bench_documents_case_runs_on_flash_varlen(cuda, monkeypatch):
    """``hf_fpdt.bench masked``'s documents case (Mistral-shaped, 7 documents over 16K tokens, chunk 4096) with the
    device's default backend: every document-cut block runs on a flash-attn build's varlen calls (the backend's own,
    or the runtime's second backend beside ``cudnn``), forward and backward, none on ``math``."""
    from hf_fpdt.bench.masked import measure

    head_dim = 32
    default = kernels.select_backend(cuda, torch.bfloat16, head_dim)
    second = routes.masked_backend(default, cuda, torch.bfloat16, head_dim)
    if second is None or flash_calls(second).varlen is None:
        pytest.skip(f"no flash-attn build with varlen calls beside {default!r} here")
    varlen = {"fwd": 0, "bwd": 0}
    fwd, bwd = FlashCalls.varlen_forward, FlashCalls.varlen_backward

    def forward(self, *args, **kw):
        varlen["fwd"] += 1
        return fwd(self, *args, **kw)

    def backward(self, *args, **kw):
        varlen["bwd"] += 1
        return bwd(self, *args, **kw)

    monkeypatch.setattr(FlashCalls, "varlen_forward", forward)
    monkeypatch.setattr(FlashCalls, "varlen_backward", backward)
    math_calls = count_math(monkeypatch)
    payload = {"case": "documents", "length": 16384, "chunk_size": 4096, "backend": "auto", "window": 1000}
    payload.update(documents=7, softcap=50.0, device=str(cuda), threads=0)
    result = measure(payload)
    assert math_calls == [] and torch.isfinite(torch.tensor(result["loss"]))
    assert varlen["bwd"] > 0 and varlen["fwd"] >= varlen["bwd"], varlen


# Blocks with cuts no flash-attn call takes (or no build installed), on cuDNN with an additive bias over query-row
# slices (issue 44, item 1): (qs, ks, sq, sk, what cuts them). Chunk 4096, bf16, GQA 16/4, head dim 128.
def _cudnn_keep(kind: str, device: torch.device) -> BlockKeep:
    n = 4096
    gen = torch.Generator(device=device).manual_seed(2)
    keys = torch.ones(1, n, dtype=torch.bool, device=device)
    if kind == "padding":  # the diagonal block with 300 left-padding keys: rows 0-299 see no key
        keys[:, :300] = False
        return BlockKeep(0, 0, n, n, causal=True, keys=keys)
    if kind == "mask4d":  # an earlier chunk's rows of a random 4D mask, row 7 keeping nothing
        dense = torch.rand(1, n, n, device=device, generator=gen) > 0.5
        dense[:, 7] = False
        return BlockKeep(n, 0, n, n, dense=dense)
    if kind == "documents-padding":
        docs = (torch.arange(n, device=device) * 3 // n).unsqueeze(0)
        keys[:, -200:] = False
        return BlockKeep(n, n, n, n, causal=True, docs_q=docs, docs_k=docs, keys=keys)
    if kind == "window":  # a window-cut block with no flash-attn build beside cudnn
        return BlockKeep(n, 0, n, n, window=1500)
    from hf_fpdt.attention.sparse_patterns import local_global

    return BlockKeep(2 * n, 0, n, n, sparse=local_global(1000, 64))


def _cudnn_bias_or_skip(device: torch.device) -> None:
    """Skip, naming why, where cudnn cannot run here or its op takes no bias; a probe that fails where the op takes
    one is an error (the masked blocks would silently stay on math)."""
    try:
        kernels.resolve_backend("cudnn", device, torch.bfloat16, HEAD_DIM)
    except ValueError as err:
        pytest.skip(str(err))
    from hf_fpdt.attention.cudnn_blocks import bias_problem

    if bias_problem() is not None:
        pytest.skip(bias_problem())
    assert cudnn_blocks.probe_cudnn_bias(device, torch.bfloat16, HEAD_DIM) is None


@pytest.mark.parametrize("kind", ["padding", "mask4d", "documents-padding", "window", "sparse"])
def test_masked_block_on_cudnn_with_a_bias_equals_math_and_float64(cuda, kind):
    """One cut block on cuDNN with a bias (routed there, not to ``math``): out, dq, dk, dv within twice a bf16
    PyTorch reference's error of float64 (plus bf16's rounding), as ``math`` is; lse within 1e-3; rows with no key
    give out 0, lse -inf and zero dq."""
    _cudnn_bias_or_skip(cuda)
    keep = _cudnn_keep(kind, cuda)
    assert Router("cudnn", None, True).route(keep, None) == ("cudnn", None)
    gen = torch.Generator(device=cuda).manual_seed(1)
    q, dout = (torch.randn(1, 4096, HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "qo")
    k, v = (torch.randn(1, 4096, KV_HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "kv")
    scale, whole = HEAD_DIM**-0.5, keep.whole(cuda)
    whole = whole if whole.dim() == 2 else whole[:, None]
    truth = _dense_block(q, k, v, dout, whole, scale, None, torch.float64)
    base = _dense_block(q, k, v, dout, whole, scale, None, torch.bfloat16)
    seen = torch.isfinite(truth[1])
    for path in ("cudnn", "math"):
        out, lse = routes.block_forward(q, k, v, False, scale, path, mask=keep, cudnn_bias=True)
        final = lse.masked_fill(torch.isneginf(lse), float("inf"))  # rows with no key: as the pipeline hands them
        grads = routes.block_backward(dout, q, k, v, out.to(q.dtype), final, False, scale, path, mask=keep,
                                       cudnn_bias=True)  # fmt: skip
        assert torch.equal(torch.isneginf(lse), ~seen), f"{path}: rows with no key"
        assert float((lse[seen] - truth[1][seen]).abs().max()) < 1e-3, f"{path}: lse"
        empty = ~seen[0].any(0)  # query rows no head sees a key from
        assert (out[0, empty] == 0).all() and (grads[0][0, empty] == 0).all(), f"{path}: empty rows"
        for what, got, ref, pt in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), truth[:1] + truth[2:], base[:1] + base[2:]
        ):
            err = float((got.double() - ref).abs().max())
            bound = 2 * float((pt.double() - ref).abs().max()) + BF16_U * float(ref.abs().max())
            assert err <= bound, f"{path} {kind}: {what} off by {err:.3g} > {bound:.3g}"


def test_the_runtime_runs_cut_blocks_on_cudnn_after_its_probe(cuda, monkeypatch):
    """With ``cudnn`` as the backend and no flash-attn build beside it, a padded call's cut blocks run on cuDNN with
    a bias (``FPDTRuntime.router``'s ``cudnn_bias``, after the masked probe), none on ``math``; its output equals the
    same call on ``math`` within bf16's bound."""
    _cudnn_bias_or_skip(cuda)
    monkeypatch.setattr(routes, "masked_backend", lambda *a, **k: None)  # no flash-attn build beside it
    rt = FPDTRuntime(FPDTConfig(chunk_size=4096, offload=False, backend="cudnn"))
    assert rt.router(cuda, torch.bfloat16, HEAD_DIM).cudnn_bias  # the masked probe (its reference: math) passes
    calls = count_math(monkeypatch)
    spec, _ = _spec("padding", 8192, cuda)
    gen = torch.Generator(device=cuda).manual_seed(3)
    q = torch.randn(1, 8192, HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8192, KV_HEADS, HEAD_DIM, device=cuda, generator=gen, dtype=torch.bfloat16) for _ in "kv")
    with torch.no_grad():
        out = fpdt_attention(q, k, v, rt, spec=spec)
    assert calls == []  # every cut block on cudnn
    ref_rt = FPDTRuntime(FPDTConfig(chunk_size=4096, offload=False, backend="math"))
    with torch.no_grad():
        ref = fpdt_attention(q.float(), k.float(), v.float(), ref_rt, spec=spec)
    assert _rel(out.float(), ref) < BF16_BOUND
