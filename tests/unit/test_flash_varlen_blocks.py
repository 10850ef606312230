"""Document-cut blocks through flash-attn's varlen entry points (issue 44, item 1).

A block cut by document boundaries (packed sequences) is a set of independent attentions, one per (batch row,
document) present on both sides of it: :meth:`BlockKeep.documents` gives them as segments, which the kernels pack as
one varlen batch per ``window_size`` (``cu_seqlens_q`` / ``cu_seqlens_k``). Checked here without a GPU:

- the segments, read with flash-attn's documented varlen semantics (each sequence its own attention, causal and
  window bottom-right aligned per sequence: :func:`flash_keep`), are exactly the block's keep mask, for every block of
  every config (documents shorter and longer than a chunk, a boundary on a chunk edge, a shorter last chunk, batch 2
  with different documents, with and without a window);
- with stand-in builds computing that semantics in float64 (FA2 2.7+'s ``flash_attn_varlen_func`` /
  ``_flash_attn_varlen_backward`` with an ``[H, total_q]`` log-sum-exp, FA2 2.5's with ``[n, H, max_seqlen_q]``, and
  FA3's positional-only ``_flash_attn_forward`` / ``_flash_attn_backward`` with ``cu_seqlens``), every document-cut
  block goes to the build's varlen calls, once forward and once backward per window group, with the segments' lengths,
  no block runs on ``math``, and the merged output and gradients equal a dense float64 reference (1e-10);
- with ``cudnn`` as the call's backend, the runtime's flash-attn build takes the masked blocks (chosen once, after its
  probe, logged once), the rest stay on ``cudnn``; a build without varlen leaves document-cut blocks to ``math``.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from standins import dense_attention, flash_keep, install_flash
from testkit import count_math, record_kernel, rel_err

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention import routes
from hf_fpdt.attention.block_keep import BlockKeep
from hf_fpdt.attention.block_mask import MaskSpec
from hf_fpdt.attention.chunked import fpdt_attention
from hf_fpdt.attention.flash_builds import FlashCalls, flash_calls
from hf_fpdt.attention.kernels import DeviceCapability
from hf_fpdt.attention.merge import merge_rows
from hf_fpdt.attention.routes import Router, block_router, masked_backend

CPU = torch.device("cpu")


def segments_mask(keep: BlockKeep) -> torch.Tensor:
    """The ``[B, Sq, Sk]`` mask :meth:`BlockKeep.documents` stands for under :func:`flash_keep`, checking its promises:
    rectangles inside the block, disjoint rows and keys, no row of a rectangle without a key."""
    segs = keep.documents()
    b = keep.docs_q.shape[0]
    whole = torch.zeros(b, keep.sq, keep.sk, dtype=torch.bool)
    rows, keys = torch.zeros(b, keep.sq, dtype=torch.int), torch.zeros(b, keep.sk, dtype=torch.int)
    for s in segs.segments:
        assert 0 <= s.r0 < s.r1 <= keep.sq and 0 <= s.c0 < s.c1 <= keep.sk, s
        sub = flash_keep(s.r1 - s.r0, s.c1 - s.c0, segs.causal, *s.window)
        assert sub.any(-1).all(), f"a row of the segment keeps no key: {s}"
        whole[s.row, s.r0 : s.r1, s.c0 : s.c1] = sub
        rows[s.row, s.r0 : s.r1] += 1
        keys[s.row, s.c0 : s.c1] += 1
    assert rows.max() <= 1 and keys.max() <= 1, "segments overlap"
    return whole


def _docs(lengths: list[list[int]]) -> torch.Tensor:
    """``[B, S]`` document ids from each row's document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])


# (chunk lengths, documents per row): documents shorter and longer than a chunk, a boundary exactly on a chunk edge
# (16, 32), a shorter last chunk, batch 2 with different documents per row
CONFIGS = {
    "short-docs": ((16, 16, 16, 16, 7), [[5, 9, 2, 16, 11, 23, 4, 1]]),
    "long-docs": ((16, 16, 16, 16, 7), [[40, 31]]),
    "on-edges": ((16, 16, 16, 16, 7), [[16, 16, 30, 9]]),
    "batch2": ((16, 16, 16, 16, 7), [[16, 5, 27, 23], [3, 44, 17, 7]]),
    "uneven": ((13, 16, 9, 16, 5), [[7, 21, 14, 1, 16], [59]]),
}
WINDOWS = (None, 5, 20)


def _spec(name: str, window, softcap=None) -> tuple[MaskSpec, tuple[int, ...]]:
    lengths, docs = CONFIGS[name]
    return MaskSpec(window=window, docs=_docs(docs), softcap=softcap), lengths


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_segments_are_the_block_mask_for_every_block(config, window):
    """Every document-cut block: the segments under flash-attn's varlen semantics equal ``rows(0, Sq)``, whole
    blocks compared; the diagonal block's segments are causal with equal query and key runs."""
    spec, lengths = _spec(config, window)
    pattern = spec.blocks(lengths, spec.docs.shape[0])
    cut = 0
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            keep = pattern.cut(i, j, CPU)
            if keep is None or keep.docs_q is None:
                continue
            cut += 1
            assert keep.host_docs is not None  # the call's host copy: no device read per block
            segs = keep.documents()
            assert segs is not None
            assert segs.causal == (i == j and keep.window is None)
            if i == j and keep.window is None:
                assert all((s.r0, s.r1) == (s.c0, s.c1) for s in segs.segments)
            want = keep.rows(0, keep.sq, CPU).expand(spec.docs.shape[0], -1, -1)
            assert torch.equal(segments_mask(keep), want), (i, j, segs)
    assert cut > 0


def test_documents_that_are_not_one_run_or_carry_other_cuts_are_not_segments():
    docs = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]])  # document 0 twice in the row: not one varlen sequence
    assert BlockKeep(0, 0, 8, 8, causal=True, docs_q=docs, docs_k=docs).documents() is None
    ok = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    assert BlockKeep(0, 0, 8, 8, causal=True, docs_q=ok, docs_k=ok).documents() is not None
    keys = torch.ones(1, 8, dtype=torch.bool)
    assert BlockKeep(0, 0, 8, 8, causal=True, docs_q=ok, docs_k=ok, keys=keys).documents() is None
    assert BlockKeep(0, 0, 8, 8, causal=True).documents() is None  # no documents


# ---- stand-in flash-attn builds (tests/standins.py) with flash-attn's (varlen) semantics, in float64 ----

STYLES = {"fa2": ("2.7", True), "fa2_25": ("2.5", True), "fa2_no_varlen": ("2.7", False), "fa3": ("fa3", True)}


def _tag(call) -> tuple:
    op = call.op if call.varlen else "dense" if call.op == "fwd" else "dense-bwd"
    return (op, call.causal, call.window, call.sq, call.sk)


def install(monkeypatch, style: str) -> tuple[str, list]:
    """A stand-in build of ``style`` in ``sys.modules``: its backend name and the calls it records,
    ``("fwd" | "bwd" | "dense" | "dense-bwd", causal, (left, right), query lengths, key lengths)``.

    fa2: FA2 2.7+ (``window_size`` in the funcs, ``window_size_left/right`` in the backwards, softcap, varlen
    log-sum-exp ``[H, total_q]``); fa2_25: FA2 2.5 (``window_size`` everywhere, no softcap, varlen log-sum-exp
    ``[n, H, max_seqlen_q]``); fa2_no_varlen: FA2 without ``flash_attn_varlen_func``; fa3: FA3's positional-only
    entry points, dense and varlen (``cu_seqlens_*`` set)."""
    version, varlen = STYLES[style]
    return install_flash(monkeypatch, version, varlen=varlen, record=_tag)


def _dense_reference(q, k, v, dout, spec: MaskSpec, scale: float):
    """float64 attention of the whole sequence under ``spec`` (documents, window, softcap) and its gradients."""
    ref = dense_attention(q, k, v, spec, scale=scale, dout=dout)
    return ref.out, ref.dq, ref.dk, ref.dv


def _run_blocks(q, k, v, dout, spec: MaskSpec, lengths, scale, backend, build):
    """The chunk pipeline's block loop in one process (every needed block's forward merged per query chunk, then
    every block's backward from the final ``(out, lse)``), with ``build`` as the blocks' ``flash_build``."""
    pattern = spec.blocks(tuple(lengths), q.shape[0])
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    span = [slice(a, a + n) for a, n in zip(starts, lengths)]
    router = backend if isinstance(backend, Router) else block_router(q, backend, build)  # a resolved one, or this
    kw = {"softcap": spec.softcap}
    outs, lses = [], []
    for i in range(len(lengths)):
        o = lse = None
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            bo, bl = router.forward(q[:, span[i]], k[:, span[j]], v[:, span[j]], causal, scale, mask=mask, **kw)
            o, lse = merge_rows(o, lse, bo, bl)  # earliest block first: rows may have seen no key yet
        outs.append(o.to(q.dtype))
        lses.append(lse)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            causal, mask = pattern.block(i, j, CPU)
            g = router.backward(
                dout[:, span[i]], q[:, span[i]], k[:, span[j]], v[:, span[j]], outs[i], lses[i], causal, scale,
                mask=mask, **kw,
            )  # fmt: skip
            dq[:, span[i]] += g[0]
            dk[:, span[j]] += g[1]
            dv[:, span[j]] += g[2]
    return torch.cat(outs, 1), dq, dk, dv


def _inputs(batch: int, total: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(batch, total, heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, total, kv_heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def _expected_calls(pattern, lengths) -> list:
    """The varlen calls the document-cut blocks must make: per block and window group, ``(causal, window, query
    lengths, key lengths)``."""
    want = []
    for i in range(len(lengths)):
        for j in pattern.keys(i):
            keep = pattern.cut(i, j, CPU)
            if keep is None or keep.docs_q is None:
                continue
            segs = keep.documents()
            groups: dict = {}
            for s in segs.segments:
                groups.setdefault(s.window, []).append(s)
            for window, group in groups.items():
                want.append((segs.causal, window, tuple(s.r1 - s.r0 for s in group), tuple(s.c1 - s.c0 for s in group)))
    return want


@pytest.mark.parametrize("style", ["fa2", "fa2_25", "fa3"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_document_blocks_run_on_the_varlen_calls(monkeypatch, style, config, window):
    """Every document-cut block goes to the build's varlen calls, forward and backward, with its segments' lengths
    (one call per window group); no block runs on ``math``; the merged output and gradients equal the dense float64
    reference to 1e-10."""
    backend, seen = install(monkeypatch, style)
    build = flash_calls(backend)
    assert isinstance(build, FlashCalls) and build.varlen is not None
    assert build.varlen.padded_lse == (style == "fa2_25")
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec(config, window)
    q, k, v, dout = _inputs(spec.docs.shape[0], sum(lengths))
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, backend, build)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3g}"
    assert math_calls == []
    want = _expected_calls(spec.blocks(lengths, q.shape[0]), lengths)
    assert want, "the config has document-cut blocks"
    assert sorted(c[1:] for c in seen if c[0] == "fwd") == sorted(want)
    assert sorted(c[1:] for c in seen if c[0] == "bwd") == sorted(want)


@pytest.mark.parametrize("style", ["fa2", "fa3"])
def test_softcapped_document_blocks_run_on_the_varlen_calls(monkeypatch, style):
    backend, seen = install(monkeypatch, style)
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec("batch2", 20, softcap=2.5)
    q, k, v, dout = _inputs(2, sum(lengths))
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, backend, flash_calls(backend))
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3g}"
    assert math_calls == [] and any(c[0] == "fwd" for c in seen)


def test_a_softcap_the_varlen_calls_cannot_take_leaves_the_block_to_math(monkeypatch):
    """FA2 2.5 has varlen but no softcap: softcapped blocks (documents or not) run on ``math``."""
    backend, seen = install(monkeypatch, "fa2_25")
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec("batch2", None, softcap=2.5)
    q, k, v, dout = _inputs(2, sum(lengths))
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, backend, flash_calls(backend))
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, ref))
    assert seen == [] and math_calls


def test_a_build_without_varlen_leaves_document_blocks_to_math(monkeypatch):
    """No ``flash_attn_varlen_func``: the document-cut blocks run on ``math``, the uncut ones on the build."""
    backend, seen = install(monkeypatch, "fa2_no_varlen")
    build = flash_calls(backend)
    assert isinstance(build, FlashCalls) and build.varlen is None
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec("short-docs", None)
    q, k, v, dout = _inputs(1, sum(lengths))
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, backend, build)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, ref))
    cut = len(_expected_calls(spec.blocks(lengths, 1), lengths))
    assert len([c for c in math_calls if c[0] == "fwd"]) == cut > 0
    assert all(c[0].startswith("dense") for c in seen)


def _cudnn_stand_in(monkeypatch) -> list:
    """``cudnn``'s dense kernels as float64 ``math`` calls that record themselves (no cuDNN on the CPU): ``"fwd"`` /
    ``"bwd"`` per block."""
    calls = record_kernel(monkeypatch, "cudnn", runs_as="math")

    class Tags(list):  # the recorded calls' tags, read live
        def __iter__(self):
            return iter([c[0] for c in calls])

        def __contains__(self, tag):
            return any(c[0] == tag for c in calls)

    return Tags()


@pytest.mark.parametrize("window", [None, 20])
def test_with_cudnn_as_the_backend_masked_blocks_take_the_second_backend(monkeypatch, window):
    """``cudnn`` has no masks: with the runtime's flash-attn build, every document-cut block runs on the build's
    varlen calls and the uncut blocks on ``cudnn``; nothing on ``math``; the result is the reference's. Without the
    build, the cut blocks go to ``math``."""
    backend, seen = install(monkeypatch, "fa2")
    cudnn = _cudnn_stand_in(monkeypatch)
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec("batch2", window)
    q, k, v, dout = _inputs(2, sum(lengths))
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, "cudnn", flash_calls(backend))
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, ref))
    pattern = spec.blocks(lengths, 2)
    want = _expected_calls(pattern, lengths)
    assert math_calls == [] and sorted(c[1:] for c in seen if c[0] == "fwd") == sorted(want)
    blocks = sum(len(pattern.keys(i)) for i in range(len(lengths)))
    windowed = [c for c in seen if c[0] == "dense"]  # blocks cut by the window alone: the build's band
    assert len([c for c in cudnn if c == "fwd"]) + len(windowed) + len({c for c in _cut(pattern, lengths)}) == blocks
    seen.clear()
    _run_blocks(q, k, v, dout, spec, lengths, 0.35, "cudnn", None)
    assert seen == [] and len([c for c in math_calls if c[0] == "fwd"]) == len(_cut(pattern, lengths)) + len(windowed)


def _cut(pattern, lengths) -> list:
    return [
        (i, j)
        for i in range(len(lengths))
        for j in pattern.keys(i)
        if (c := pattern.cut(i, j, CPU)) is not None and c.docs_q is not None
    ]


def test_masked_backend_takes_a_probed_flash_build_beside_cudnn(caplog):
    """Which build masked blocks run on, by backend: a flash-attn backend itself; beside ``cudnn`` / ``torch_flash``
    the first of FA3, FA2 that can run and passes its probe (one INFO line); none on the CPU or for ``math``."""
    hopper = DeviceCapability("cuda", (9, 0), 90100, True, flash_attn=True, flash_attn3=True)
    ampere = DeviceCapability("cuda", (8, 0), 90100, False, flash_attn=True)
    ok = lambda name: None  # noqa: E731
    half = torch.bfloat16
    assert masked_backend("flash_attn", CPU, half, 64) == "flash_attn"
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        assert masked_backend("cudnn", CPU, half, 64, hopper, ok) == "flash_attn3"
    assert "'flash_attn3'" in caplog.text and "'cudnn'" in caplog.text
    assert masked_backend("cudnn", CPU, half, 64, hopper, lambda n: "wrong" if n == "flash_attn3" else None) == (
        "flash_attn"
    )
    assert masked_backend("torch_flash", CPU, half, 64, ampere, ok) == "flash_attn"
    assert masked_backend("cudnn", CPU, half, 64, hopper, lambda n: "wrong") is None
    assert masked_backend("cudnn", CPU, torch.float32, 64, hopper, ok) is None  # FA takes half precision only
    assert masked_backend("math", CPU, half, 64, hopper, ok) is None
    assert masked_backend("cpu_flash", CPU, half, 64) is None


def test_the_runtime_resolves_the_build_once(monkeypatch, caplog):
    """``FPDTRuntime.masked_flash``: decided once per (device, dtype, head dim) after the probe (the stand-in build
    passes it on the CPU), logged once, the build's signatures read once and held, not per block."""
    backend, _ = install(monkeypatch, "fa2")
    cuda = DeviceCapability("cuda", (9, 0), 90100, True, flash_attn=True)
    monkeypatch.setattr(routes, "probe_device", lambda device: cuda)
    reads: list = []

    def counted(name, *a):
        reads.append(name)
        return flash_calls(name, *a)

    monkeypatch.setattr(routes, "flash_calls", counted)
    rt = FPDTRuntime(FPDTConfig(chunk_size=16, offload=False, backend="math"))
    real = routes.resolve_backend  # what a Hopper GPU resolves for half precision: cudnn
    monkeypatch.setattr(
        routes, "resolve_backend", lambda r, d, dt, h: "cudnn" if dt == torch.bfloat16 else real(r, d, dt, h)
    )
    monkeypatch.setattr(routes, "masked_cudnn", lambda *a, **k: False)
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        first = rt.router(CPU, torch.bfloat16, 64).flash
        again = rt.router(CPU, torch.bfloat16, 64).flash
    assert isinstance(first, FlashCalls) and first.backend == backend and again is first
    assert reads == ["flash_attn"]
    assert len([r for r in caplog.records if "masked and softcapped" in r.getMessage()]) == 1
    assert rt.router(CPU, torch.float64, 64).flash is None  # backend math: no build
    clone = pickle.loads(pickle.dumps(rt))  # torch.save(model): the build's functions are not pickled, read again
    assert clone._routers == {} and len(rt._routers) == 2


def test_the_chunk_pipeline_runs_document_blocks_on_the_runtime_build(monkeypatch):
    """``fpdt_attention`` end to end with ``cudnn`` as the backend and the runtime's flash-attn build: the
    document-cut blocks go to the varlen calls (forward and backward), nothing to ``math``, and the output and
    gradients equal the dense float64 reference."""
    install(monkeypatch, "fa3")
    cudnn = _cudnn_stand_in(monkeypatch)
    math_calls = count_math(monkeypatch)
    spec, lengths = _spec("batch2", None)
    q, k, v, dout = _inputs(2, sum(lengths))
    rt = FPDTRuntime(FPDTConfig(chunk_size=16, offload=False, backend="math"))
    rt._routers[(str(CPU), torch.float64, 8)] = Router("cudnn", flash_calls("flash_attn3"))  # as on a Hopper GPU
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fpdt_attention(*inputs, rt, scale=0.35, spec=spec)
    out.backward(dout)
    ref = _dense_reference(q, k, v, dout, spec, 0.35)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in inputs)), ref):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3g}"
    assert math_calls == [] and "fwd" in cudnn and "bwd" in cudnn


class _HostCopies(torch.overrides.TorchFunctionMode):
    """Every tensor made from host numbers straight onto a device (``torch.tensor(..., device=...)``, a copy from
    pageable memory: a host synchronisation on CUDA) and every blocking move onto a device (``.to(device)`` without
    ``non_blocking``) while active."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and kwargs.get("device") is not None:
            self.seen.append(f"torch.tensor(..., device={kwargs['device']})")
        if func is torch.Tensor.to and not kwargs.get("non_blocking", False):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device)) and args[0].device != torch.device(target):
                self.seen.append(f".to({target}) blocking")
        return func(*args, **kwargs)


@pytest.mark.parametrize("style", ["fa2", "fa2_25", "fa3"])
@pytest.mark.parametrize("window", [None, 20])
def test_document_blocks_make_no_blocking_host_copies(monkeypatch, style, window):
    """A document-cut block's varlen packing (``cu_seqlens``, row indices) and FA2 < 2.6's padded log-sum-exp reach the
    device in one non-blocking copy from one buffer (pinned on CUDA), never as ``torch.tensor(list, device=...)`` (a
    pageable copy: a host synchronisation per block, forward and backward)."""
    backend, seen = install(monkeypatch, style)
    spec, lengths = _spec("batch2", window)
    q, k, v, dout = _inputs(2, sum(lengths))
    copies = _HostCopies()
    for name in ("forward", "backward"):  # the blocks alone (the call's mask structure is built once, outside)
        real = getattr(Router, name)

        def under_mode(self, *a, _real=real, **kw):
            with copies:
                return _real(self, *a, **kw)

        monkeypatch.setattr(Router, name, under_mode)
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, backend, flash_calls(backend))
    assert copies.seen == []
    assert any(c[0] == "fwd" for c in seen)  # the varlen calls ran
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, _dense_reference(q, k, v, dout, spec, 0.35)))


def _kinds_router(monkeypatch, style: str) -> Router:
    """``cudnn`` (its dense blocks stood in by float64 math) with a flash-attn stand-in beside it, as on a Hopper GPU
    with FA installed; the masked cuDNN bias off (no cuDNN on the CPU)."""
    backend, _ = install(monkeypatch, style)
    _cudnn_stand_in(monkeypatch)
    return Router("cudnn", flash_calls(backend))


def test_each_fused_kind_passes_its_probe_block(monkeypatch):
    """``routes.probe_kinds``: a build that runs every kind right (dense at batch 2 on the backend, a softcap, a window
    band, documents) passes them all; FA2 2.5's padded LSE layout too."""
    for style in ("fa2", "fa2_25", "fa3"):
        assert routes.probe_kinds(_kinds_router(monkeypatch, style), CPU, torch.float64, 8) == {}, style


@pytest.mark.parametrize("broken", ["varlen_forward", "varlen_backward", "forward"])
def test_a_kind_its_build_gets_wrong_fails_alone_and_runs_on_math(monkeypatch, broken, caplog):
    """A build whose varlen calls (or its windowed plain call) compute wrong numbers fails that kind's probe block and
    no other: the router resolved with it sends that kind to ``math`` (one WARNING naming it) and keeps the others."""
    router = _kinds_router(monkeypatch, "fa2")
    real = getattr(FlashCalls, broken)

    def wrong(self, *a, **kw):
        res = real(self, *a, **kw)
        return (res[0] * 1.5, *res[1:])

    monkeypatch.setattr(FlashCalls, broken, wrong)
    problems = routes.probe_kinds(router, CPU, torch.float64, 8)
    kind = "documents" if broken.startswith("varlen") else None
    if kind is None:  # the plain call: the window band and the softcapped blocks use it
        assert set(problems) == {"window band", "softcap"}, problems
    else:
        assert set(problems) == {kind}, problems
    monkeypatch.setattr(routes, "resolve_backend", lambda *a, **k: "cudnn")
    monkeypatch.setattr(routes, "masked_backend", lambda *a, **k: "flash_attn")
    monkeypatch.setattr(routes, "masked_cudnn", lambda *a, **k: False)
    with caplog.at_level(logging.WARNING, logger="hf_fpdt"):
        resolved = routes.resolve_router(None, CPU, torch.float64, 8, kinds=routes.probe_kinds)
    assert resolved.off == frozenset(problems) and len(caplog.records) == 1
    spec, lengths = _spec("batch2", 20)
    q, k, v, dout = _inputs(2, sum(lengths))
    math_calls = count_math(monkeypatch)
    got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, resolved, None)
    if kind is None:  # these blocks are document-cut; a softcapped block takes the broken plain call
        resolved.forward(q[:, :16], k[:, :16], v[:, :16], True, 0.35, softcap=30.0)
    monkeypatch.setattr(FlashCalls, broken, real)  # the reference below is math's
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, _dense_reference(q, k, v, dout, spec, 0.35)))
    assert len(math_calls) > 0


def test_a_kind_that_raises_on_a_real_block_falls_back_to_math_once(monkeypatch, caplog):
    """A fused route raising on a real block (a kernel rejecting a layout its probe did not have) is not a crash: that
    block and every later one of its kind run on ``math`` (the same numbers), one WARNING line, the build not tried
    again for that kind; other kinds keep the build; running out of memory stays an error."""
    router = _kinds_router(monkeypatch, "fa2")
    calls: list = []

    def raising(self, *a, **kw):
        calls.append(1)
        raise RuntimeError("cu_seqlens layout not supported")

    monkeypatch.setattr(FlashCalls, "varlen_forward", raising)
    spec, lengths = _spec("batch2", None)
    q, k, v, dout = _inputs(2, sum(lengths))
    with caplog.at_level(logging.WARNING, logger="hf_fpdt"):
        got = _run_blocks(q, k, v, dout, spec, lengths, 0.35, router, None)
    assert router.failed == {"documents"} and calls == [1]
    assert len([r for r in caplog.records if "run on math from now on" in r.getMessage()]) == 1
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, _dense_reference(q, k, v, dout, spec, 0.35)))

    def oom(self, *a, **kw):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(FlashCalls, "forward", oom)
    with pytest.raises(torch.OutOfMemoryError):
        router.forward(q[:, :16], k[:, :16], v[:, :16], True, 0.35, softcap=30.0)
