"""A LoRA training step on the virtual CUDA device (``tests/virtual_cuda.py``; issue 49, item 1): ``hf_fpdt.apply``
on a tiny model, PEFT LoRA, non-reentrant gradient checkpointing, ``offload=True`` and ``device_memory=0`` (every chunk
and layer input through the host), on the block routes a Hopper GPU takes:

* ``causal``: every block dense or causal, on ``cudnn``;
* ``documents``: packed documents (``position_ids`` restarting per document), the document-cut blocks on a flash-attn
  build's varlen calls (``cudnn`` the backend, FA3 beside it);
* ``padding``: left padding (``attention_mask`` zeros), the cut blocks on ``cudnn`` with an additive bias;
* ``window``: a Mistral with ``sliding_window`` shorter than the sequence, the window-cut blocks on FA3's band.

No cuDNN or flash-attn runs on the CPU: ``cudnn``'s op pair is a float64 stand-in of its documented semantics that
runs on the virtual device (``cudnn_blocks.CUDNN_OPS``), flash-attn is the stand-in FA3 build of
``tests/standins.py``, and the runtime's router of the step's (device, dtype, head dim) is the one a Hopper GPU
resolves. Checked, per case, on the step after the first (which probes and plans):

* the host syncs are the same at 4 and at 16 chunks per sequence (none per block, none per chunk; each has its kind
  and where it came from in the failure message);
* no race (the context raises at exit);
* loss and gradients equal the CPU path's (``math``) to float32 rounding (the stand-ins compute in float64);
* the device peak with the host 1 chunk ahead of the device (``host_lead``: a chunk's share of the step's kernels)
  and with it 50 chunks ahead (past the whole step) are equal, or differ by at most the copies held for their
  completion (``WRITES_IN_FLIGHT`` chunks).

``python tests/unit/test_virtual_step.py`` prints the table (syncs at 4 / 16 chunks, peak at lead 1 / 50).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # run as a script: tests/ and tests/unit on the path, as pytest's pythonpath does
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from peft import LoraConfig, get_peft_model
from test_flash_varlen_blocks import install
from testkit import count_math, tiny_model
from virtual_cuda import VirtualCuda

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.attention import cudnn_blocks
from hf_fpdt.attention.block_mask import BlockMask
from hf_fpdt.attention.cudnn_blocks import CudnnOps
from hf_fpdt.attention.flash_builds import flash_calls
from hf_fpdt.attention.routes import Router
from hf_fpdt.memory.staging import WRITES_IN_FLIGHT
from hf_fpdt.memory.tiling import tiled_lm_loss

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
CHUNK = 16  # tokens per chunk
CASES = ("causal", "documents", "padding", "window")
HEAD_DIM, HIDDEN = 8, 32
REAL_OPS = cudnn_blocks.CUDNN_OPS
STAND_IN = "standins.py"  # where the stand-in builds live (tests/standins.py)


def _scores(q, k, bias, is_causal, scale):
    """float64 scores ``[B, H, n, Sk]`` of heads-first q, k (GQA), with the op's top-left causal mask and bias; on
    q's device."""
    g = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
    if is_causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s if bias is None else s + bias.double()


class _Op:
    def __init__(self, fn, real) -> None:
        self.fn, self._schema = fn, real.default._schema  # the installed torch's schema (it takes attn_bias)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _cudnn_forward(q, k, v, attn_bias, compute_lse, dropout_p=0.0, is_causal=False, debug=False, *, scale=None):
    s = _scores(q, k, attn_bias, is_causal, scale)
    lse = s.logsumexp(-1, keepdim=True)
    out = (s - lse).exp() @ v.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    return out.to(q.dtype), lse.float(), seed, seed, q.shape[2], k.shape[2], seed, seed, seed


def _cudnn_backward(do, q, k, v, out, lse, seed, off, bias, cq, ck, max_q, max_k, dropout_p, is_causal, *, scale):
    g = q.shape[1] // k.shape[1]
    ke, ve = (t.double().repeat_interleave(g, 1) for t in (k, v))
    p = (_scores(q, k, bias, is_causal, scale) - lse.double()).exp()
    do, o = do.double(), out.double()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ ve.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk = ds @ ke * scale, ds.transpose(-1, -2) @ q.double() * scale
    b, hkv = k.shape[:2]
    dk, dv = (t.view(b, hkv, g, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _model(case: str) -> torch.nn.Module:
    kw = {
        "vocab_size": 128, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    }  # fmt: skip
    if case == "window":
        model = tiny_model("mistral", "sdpa", sliding_window=CHUNK + CHUNK // 2, head_dim=HEAD_DIM, **kw)
    else:
        model = tiny_model("llama", "sdpa", **kw)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    return get_peft_model(model, lora)


def _batch(case: str, tokens: int, device: torch.device) -> dict:
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if case == "documents":  # three documents of unequal lengths, cut across chunks
        cuts = [0, tokens // 3 + 5, 2 * tokens // 3 - 3, tokens]
        batch["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]
    if case == "padding":  # left padding: not a multiple of a chunk
        mask = torch.ones(1, tokens, dtype=torch.long)
        mask[:, : CHUNK + 5] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    return {k: v.to(device) for k, v in batch.items()}


def _router(case: str) -> Router:
    """The route a Hopper GPU resolves: cuDNN for dense blocks, with its masked probe passed (padding) or FA3 beside
    it (documents, windows)."""
    if case in ("documents", "window"):
        return Router("cudnn", flash_calls("flash_attn3"))
    return Router("cudnn", cudnn_bias=case == "padding")


def step(case: str, chunks: int, device: torch.device, vdev: VirtualCuda | None = None) -> dict:
    """Two training steps of ``case``'s LoRA model (a fresh copy on ``device``) over ``chunks`` chunks; the second's
    loss, LoRA gradients and, on ``vdev``, host syncs (``(kind, where)``) and device peak over its base."""
    torch.manual_seed(0)
    model = _model(case).to(device)
    config = FPDTConfig(chunk_size=CHUNK, offload=True, device_memory=0, backend="math")
    model = hf_fpdt.apply(model, config)
    if device.type == "cuda":
        model.fpdt.runtime._routers[(str(device), torch.float32, HEAD_DIM)] = _router(case)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = _batch(case, chunks * CHUNK, device)
    model(**batch).loss.backward()
    model.zero_grad()
    if vdev is not None:
        syncs, launches = vdev.sync_count, vdev.launches
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = model(**batch).loss
    loss.backward()
    result = {}
    if vdev is not None:  # before the results' copies to the host below
        result["peak"] = torch.cuda.max_memory_allocated() - base
        # the stand-in FA3 build reads its cu_seqlens on the host (a real kernel reads them on the device)
        ours = [s for s in vdev.syncs[syncs:] if not s.stack or STAND_IN not in s.stack[0]]
        result["syncs"] = [(s.kind, _where(s.stack)) for s in ours]
        result["launches"] = vdev.launches - launches
        assert model.fpdt.runtime.store(device).host_bytes > 0  # the chunks went through the host
        assert model.fpdt.layer_offloader.store(device).host_bytes > 0  # and the layer inputs
    grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
    result["tensors"] = [loss.detach().cpu(), *grads]
    return result


def _where(stack: tuple[str, ...]) -> str:
    """The innermost frame of hf_fpdt or transformers (else the innermost)."""
    for frame in stack:
        if "/hf_fpdt/" in frame or "/transformers/" in frame:
            return frame.rpartition("/")[2]
    return stack[0].rpartition("/")[2] if stack else "?"


def virtual_step(case: str, chunks: int, host_lead: int | None = None) -> dict:
    with VirtualCuda(host_lead=host_lead) as vdev:  # a race fails at exit
        return step(case, chunks, CUDA, vdev)


def _on_the_inputs_device(fn):
    """``fn`` (a stand-in kernel written for the CPU) with the tensors it makes on its first argument's device."""

    @functools.wraps(fn)  # its signature: what the build takes is read from it
    def run(*args, **kwargs):
        with torch.device(args[0].device):
            return fn(*args, **kwargs)

    return run


def install_stand_ins(monkeypatch) -> dict[str, list]:
    """cuDNN's op pair and an FA3 build, as stand-ins that run on the virtual device: ``test_flash_varlen_blocks``'
    FA3 build, its entry points making their tensors on the inputs' device."""
    cudnn: list[str] = []

    def recorded(fn, tag: str):
        def run(*args, **kwargs):
            cudnn.append(tag)
            return fn(*args, **kwargs)

        return _Op(run, getattr(REAL_OPS, "forward" if tag == "fwd" else "backward"))

    ops = CudnnOps(recorded(_cudnn_forward, "fwd"), recorded(_cudnn_backward, "bwd"))
    monkeypatch.setattr(cudnn_blocks, "CUDNN_OPS", ops)
    _, flash = install(monkeypatch, "fa3")
    build = sys.modules["flash_attn_interface"]
    for name in ("_flash_attn_forward", "_flash_attn_backward"):
        monkeypatch.setattr(build, name, _on_the_inputs_device(getattr(build, name)))
    return {"cudnn": cudnn, "flash": flash}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6)


def _kinds(syncs: list[tuple[str, str]]) -> list[str]:
    return [kind for kind, _ in syncs]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_syncs_per_step_do_not_grow_with_chunks(case, monkeypatch):
    calls = install_stand_ins(monkeypatch)
    math_calls = count_math(monkeypatch)
    steps = {chunks: virtual_step(case, chunks) for chunks in (4, 16)}
    print(f"\n{case}: syncs at 4 chunks {steps[4]['syncs']}\n{case}: syncs at 16 chunks {steps[16]['syncs']}")
    assert _kinds(steps[4]["syncs"]) == _kinds(steps[16]["syncs"]), (steps[4]["syncs"], steps[16]["syncs"])
    # the blocks ran where the case says (cuDNN's, FA3's), none on math
    assert math_calls == [] and calls["cudnn"], (len(math_calls), calls["cudnn"][:3])
    if case == "documents":
        assert {c[0] for c in calls["flash"]} >= {"fwd", "bwd"}  # the varlen calls
    if case == "window":
        assert any(c[2] != (-1, -1) for c in calls["flash"])  # the window's bands
    for chunks in (4, 16):
        _same(steps[chunks]["tensors"], step(case, chunks, CPU)["tensors"])


def _new_syncs(vdev: VirtualCuda, since: int) -> list[str]:
    return [s.kind for s in vdev.syncs[since:]]


def test_the_tiled_loss_reads_its_targets_in_one_sync(virtual_cuda):
    """The tiled LM loss's one look at its targets (every tile's count, the smallest and largest label): one
    ``tolist``, the tiles' ends reaching the device in one non-blocking copy from pinned memory, never a pageable
    ``torch.tensor(..., device=cuda)`` (a second host sync)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 16).to(CUDA)
    hidden = torch.randn(40, 8, generator=g).to(CUDA).requires_grad_()
    labels = torch.randint(0, 16, (40,), generator=g).to(CUDA)
    since = virtual_cuda.sync_count
    loss, _ = tiled_lm_loss(hidden, head, labels, tiles=5, params=tuple(head.parameters()))
    loss.backward()
    assert _new_syncs(virtual_cuda, since) == ["tolist"]
    ref = torch.nn.functional.cross_entropy(head(hidden).cpu(), labels.cpu(), reduction="sum")
    torch.testing.assert_close(loss.cpu(), ref)


def test_a_document_mask_reads_its_documents_in_one_sync(virtual_cuda):
    """The block mask of a call with packed documents copies the document ids to the host once (its one sync) and
    reads every chunk's first and last document there: no pageable copy of the chunks' edges to the device, no second
    read."""
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14]).to(CUDA)
    since = virtual_cuda.sync_count
    mask = BlockMask(lengths=(16, 16, 16, 16), docs=docs)
    assert _new_syncs(virtual_cuda, since) == ["pageable D2H copy"]
    assert [tuple(map(tuple, e)) for e in mask._edges] == [((0,), (0,)), ((0,), (1,)), ((1,), (1,)), ((1,), (2,))]
    assert mask.keys(3) == [1, 2, 3]  # chunk 0 holds none of documents 1 and 2


def peaks(case: str, chunks: int = 4) -> tuple[int, int, int]:
    """The device peak of ``case``'s step with the host 1 and 50 chunks ahead of the device (``host_lead`` in
    kernels: a chunk's share of the step's), and that share."""
    per_chunk = virtual_step(case, chunks, host_lead=0)["launches"] // chunks
    near = virtual_step(case, chunks, host_lead=per_chunk)["peak"]
    far = virtual_step(case, chunks, host_lead=50 * per_chunk)["peak"]
    return near, far, per_chunk


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_device_peak_does_not_grow_with_the_host_lead(case, monkeypatch):
    """Equal, or more by at most the copies held for their completion (``WRITES_IN_FLIGHT`` chunks of one layer
    input; padding: 256 bytes more 50 chunks ahead)."""
    install_stand_ins(monkeypatch)
    near, far, _ = peaks(case)
    print(f"\n{case}: device peak {near} B one chunk ahead, {far} B fifty chunks ahead")
    assert 0 <= far - near <= WRITES_IN_FLIGHT * CHUNK * HIDDEN * 4, (near, far)


def table() -> str:
    """The measured table: host syncs per step at 4 / 16 chunks (with their kinds and where) and the device peak with
    the host 1 / 50 chunks ahead (4 chunks), per case."""
    rows = [
        "| case | syncs, 4 chunks | syncs, 16 chunks | the syncs (16 chunks) | peak, 1 chunk ahead | 50 chunks ahead |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        four, sixteen = virtual_step(case, 4), virtual_step(case, 16)
        near, far, per_chunk = peaks(case)
        kinds = "; ".join(f"{k} ({w})" for k, w in sixteen["syncs"])
        rows.append(f"| {case} | {len(four['syncs'])} | {len(sixteen['syncs'])} | {kinds} | {near} B | {far} B |")
    return "\n".join(rows)


if __name__ == "__main__":
    with pytest.MonkeyPatch.context() as mp:
        install_stand_ins(mp)
        print(table())
