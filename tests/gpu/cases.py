"""Test bodies of the CUDA suite, parametrised by device and sizes (issue 22).

``tests/gpu/test_cuda_*.py`` run them on a GPU at the sizes of :data:`CUDA`; without one, those whose tests take
``cuda_or_virtual`` run on the virtual CUDA device (``tests/virtual_cuda.py``) at the sizes of :data:`CPU` (every
number computed on the CPU; torch's cuDNN and flash attention ops and flash-attn's builds answered by the references
of ``tests/standins.py``), so the bodies and the CUDA code paths they drive run in every test run (:func:`sizes`).

Each body asserts; it returns what the race check (``FPDT_SYNC_COPIES=1`` against the asynchronous run) compares
bit for bit.

* :func:`check_attention`: ``fpdt_attention`` forward + backward with one backend against a float64 reference
  (with the same window, documents and softcap) and against sdpa in the same dtype. fp32: relative error
  <= 1e-5 against both; bf16/fp16: each of out, dq, dk, dv within twice sdpa's own error against float64
  (flash-attention's rule; softcap, which sdpa lacks, takes plain attention in the same dtype as the baseline).
* :func:`check_training_step`: a Llama training step with ``hf_fpdt.apply`` + LoRA (r 4, all linears) +
  non-reentrant checkpointing, loss and LoRA gradients each within twice the error of HF sdpa's step in the same
  dtype, both against the float64 step of the same weights, under the settings of :data:`STEP_SETTINGS` (offload
  on / off / auto, device budgets 0 / between / unlimited, segments, host budget 0).
* :func:`check_generate`: greedy ``generate()`` (left padding; prefill chunks or a static cache) equal to sdpa.
* :func:`check_autocast_step`: a training step under ``torch.autocast(bf16)`` within twice sdpa's error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from standins import install_flash
from testkit import tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention.block_mask import MaskSpec, document_ids
from hf_fpdt.attention.kernels import backend_problem, probe_device
from hf_fpdt.config import BACKENDS

NEEDS_CUDA = "needs CUDA; run on a GPU machine: see docs/gpu.md"
REAL_CUDA = torch.cuda.is_available()  # at import, outside any virtual device
NO_RACE_ON_VIRTUAL = (
    "on the virtual CUDA device every kernel computes when it is queued, so a race cannot change a number: its "
    "happens-before checker fails the test on one instead (every test on it)"
)
FLASH_STAND_INS = {"flash_attn": "2.7", "flash_attn3": "fa3"}  # the builds the virtual device's flash backends get
CUDA_BACKENDS = ("cudnn", "flash_attn3", "flash_attn", "torch_flash", "math")
CPU_BACKENDS = ("cpu_flash", "math")
assert set(CUDA_BACKENDS + CPU_BACKENDS) == set(BACKENDS)


@dataclass(frozen=True)
class AttnShape:
    """One attention case. ``seq`` is never a multiple of ``chunk``; ``docs``: lengths of packed documents."""

    batch: int
    seq: int
    chunk: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    docs: tuple[int, ...] | None = None
    softcap: float | None = None

    @property
    def id(self) -> str:
        extra = [f"w{self.window}" if self.window else "", "docs" if self.docs else "", "cap" if self.softcap else ""]
        kind = "mha" if self.heads == self.kv_heads else "mqa" if self.kv_heads == 1 else "gqa"
        return "-".join(
            x for x in (f"{kind}{self.heads}x{self.kv_heads}", f"d{self.head_dim}", f"s{self.seq}", *extra) if x
        )


@dataclass(frozen=True)
class Sizes:
    """Sizes of one device's run. ``rtol``: model-level relative tolerance against sdpa in fp32 (summation
    orders of different kernels over a longer sequence differ more on a GPU than on a tiny CPU case)."""

    attention: tuple[AttnShape, ...]
    seq: int
    chunk: int
    batch: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rtol: float
    prompt: int
    new_tokens: int
    prefill_chunk: int


def _shapes(chunk: int, seq: int, docs: tuple[int, ...]) -> tuple[AttnShape, ...]:
    return (
        AttnShape(2, seq, chunk, 8, 2, 64),  # GQA
        AttnShape(1, seq, chunk, 8, 1, 128),  # MQA, head dim 128
        AttnShape(2, seq, chunk, 4, 4, 64),  # MHA
        AttnShape(2, seq, chunk, 8, 2, 64, window=chunk // 2 + 3),  # a window shorter than a chunk
        AttnShape(2, seq, chunk, 8, 2, 128, window=chunk + chunk // 3),  # longer than a chunk
        AttnShape(1, sum(docs), chunk, 8, 2, 64, docs=docs),  # packed documents, boundaries inside chunks
        AttnShape(2, seq, chunk, 8, 2, 64, softcap=20.0),
        AttnShape(1, sum(docs), chunk, 8, 1, 64, window=chunk // 2 + 3, docs=docs, softcap=20.0),
    )


CPU = Sizes(
    attention=_shapes(16, 3 * 16 + 5, (19, 5, 23, 6)),
    seq=45, chunk=16, batch=2, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=512,
    rtol=1e-5, prompt=45, new_tokens=6, prefill_chunk=13,
)  # fmt: skip
CUDA = Sizes(
    attention=_shapes(256, 3 * 256 + 77, (300, 41, 390, 100)),
    seq=1000, chunk=256, batch=2, hidden=512, intermediate=1024, layers=4, heads=8, kv_heads=2, vocab=1024,
    rtol=1e-4, prompt=600, new_tokens=8, prefill_chunk=97,
)  # fmt: skip

# FPDTConfig settings of the training-step cases ("between": a device budget that holds about half the layer
# inputs, so the oldest spill to the host; resolved from the sizes by _step_config).
STEP_SETTINGS = {
    "offload-off": {"offload": False},
    "offload-on": {"offload": True},
    "offload-auto": {"offload": "auto"},
    "device-0": {"offload": True, "device_memory": 0, "host_memory": "unlimited"},
    "device-between": {"offload": True, "device_memory": "between", "host_memory": "unlimited"},
    "device-unlimited": {"offload": True, "device_memory": "unlimited"},
    "segments-2": {"offload": True, "checkpoint_segments": 2},
    "host-0": {"offload": True, "host_memory": 0},
    "host-0-segments-2": {"offload": True, "host_memory": 0, "checkpoint_segments": 2},
}


def sizes() -> Sizes:
    """The sizes of this machine's run: :data:`CUDA` on a GPU, :data:`CPU` on the virtual device."""
    return CUDA if REAL_CUDA else CPU


def on_virtual(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and not REAL_CUDA


def stand_in_flash(device: torch.device, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the virtual device, the flash backends' builds are ``tests/standins.py``'s (FA2 2.7, FA3)."""
    if on_virtual(device) and backend in FLASH_STAND_INS:
        install_flash(monkeypatch, FLASH_STAND_INS[backend])


def backends_for(device: torch.device) -> tuple[str, ...]:
    return CUDA_BACKENDS if torch.device(device).type == "cuda" else CPU_BACKENDS


def skip_unless_runs(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Skip (naming why) when ``backend`` cannot run these blocks on ``device``."""
    problem = backend_problem(backend, probe_device(device), dtype, head_dim)
    if problem is not None:
        pytest.skip(f"{backend}: {problem}")


# ---------------------------------------------------------------------------------------------- attention


def reference(q, k, v, scale, window=None, softcap=None, docs=None, dtype=torch.float64) -> torch.Tensor:
    """Attention over the whole sequence in ``dtype`` (HF's window rule: key u seen by t iff t-W < u <= t;
    documents: only within one), differentiable. ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]``."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_keep(q.shape[1], window, docs, q.device), float("-inf"))
    return (s.softmax(-1, dtype=torch.float32 if dtype != torch.float64 else dtype).to(dtype) @ vh).transpose(1, 2)


def _keep(seq: int, window, docs, device) -> torch.Tensor:
    t = torch.arange(seq, device=device).unsqueeze(1)
    u = torch.arange(seq, device=device).unsqueeze(0)
    keep = u <= t
    if window is not None:
        keep = keep & (u > t - window)
    keep = keep[None, None]
    if docs is not None:
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    return keep


def _sdpa(q, k, v, scale, window=None, docs=None) -> torch.Tensor:
    mask = _keep(q.shape[1], window, docs, q.device)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


def _max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    # on the host: on the virtual CUDA device autograd's gradients of the reference come back as CPU tensors
    return (a.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return _max_err(a, ref) / max(ref.double().abs().max().item(), 1e-30)


def check_attention(
    device: torch.device, backend: str, dtype: torch.dtype, shape: AttnShape, offload: bool | str = True
) -> list[torch.Tensor]:
    """fpdt attention forward + backward with ``backend`` against float64 and sdpa (see the module docstring)."""
    device = torch.device(device)
    skip_unless_runs(backend, device, dtype, shape.head_dim)
    g = torch.Generator(device="cpu").manual_seed(7)
    heads = (shape.heads, shape.kv_heads, shape.kv_heads)
    q, k, v = (
        torch.randn(shape.batch, shape.seq, h, shape.head_dim, generator=g).to(device, dtype).requires_grad_()
        for h in heads
    )
    dout = torch.randn(shape.batch, shape.seq, shape.heads, shape.head_dim, generator=g).to(device, dtype)
    docs = None
    if shape.docs is not None:
        positions = torch.cat([torch.arange(n) for n in shape.docs]).expand(shape.batch, -1)
        docs = document_ids(positions.to(device))
    scale = shape.head_dim**-0.5
    runtime = FPDTRuntime(FPDTConfig(chunk_size=shape.chunk, offload=offload, backend=backend))
    if offload == "auto":
        from hf_fpdt.attention.autotune import Autotuner

        runtime = FPDTRuntime(runtime.config, backend=backend, autotuner=Autotuner(backend=backend))
    out = fpdt_attention(q, k, v, runtime, scale, MaskSpec(window=shape.window, softcap=shape.softcap, docs=docs))
    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    assert runtime.kernel_backend(device, dtype, shape.head_dim) == backend
    ref_out = reference(q, k, v, scale, shape.window, shape.softcap, docs)
    ref = [ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout.double())]
    if shape.softcap is None:
        base_out = _sdpa(q, k, v, scale, shape.window, docs)
    else:  # sdpa has no softcap: plain attention in the same dtype is the baseline
        base_out = reference(q, k, v, scale, shape.window, shape.softcap, docs, dtype=dtype)
    base = [base_out, *torch.autograd.grad(base_out, (q, k, v), dout)]
    names = ("out", "dq", "dk", "dv")
    if dtype in (torch.float32, torch.float64):
        for name, a, r, b in zip(names, got, ref, base):
            assert _rel(a, r) <= 1e-5, f"{name} vs float64: {_rel(a, r):.2e}"
            assert _rel(a, b) <= 1e-5, f"{name} vs sdpa {dtype}: {_rel(a, b):.2e}"
    else:
        for name, a, r, b in zip(names, got, ref, base):
            err, base_err = _max_err(a, r), _max_err(b, r)
            # 2x the baseline's own error (flash-attention's rule), and a floor of one rounding of the result
            floor = 2.0 ** -(8 if dtype == torch.bfloat16 else 11) * r.abs().max().item() * 1e-2
            assert err <= 2 * base_err + floor, f"{name}: fpdt {err:.3e} > 2 x sdpa {dtype} {base_err:.3e}"
    return [t.detach() for t in got]


# ---------------------------------------------------------------------------------------------- models


def _base(device: torch.device, sizes: Sizes) -> torch.nn.Module:
    return tiny_model(
        "llama",
        "sdpa",
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=max(4 * sizes.seq, 4096),
    ).to(device)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def _step_config(sizes: Sizes, settings: dict) -> FPDTConfig:
    settings = dict(settings)
    if settings.get("device_memory") == "between":
        layer_input = sizes.batch * sizes.seq * sizes.hidden * 4
        settings["device_memory"] = layer_input * (sizes.layers // 2) + layer_input // 2
    return FPDTConfig(chunk_size=sizes.chunk, **settings)


def _batch(device: torch.device, sizes: Sizes) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), generator=g).to(device)


def _train_step(model: torch.nn.Module, ids: torch.Tensor, autocast: torch.dtype | None = None) -> list[torch.Tensor]:
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.autocast(ids.device.type, autocast, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for _, p in sorted(model.named_parameters()) if p.requires_grad]


def check_training_step(
    device: torch.device, sizes: Sizes, setting: str, check: bool = True, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """One Llama step (apply + LoRA + checkpointing) under ``STEP_SETTINGS[setting]`` as accurate as sdpa's.

    Loss and each LoRA gradient within twice the error of HF sdpa's step in ``dtype``, both against the float64 step
    of the same weights (flash-attention's rule, as for attention alone), plus a floor of ``1e-6`` (fp32) or ``1e-3``
    (bf16) of the reference's largest value. (fp32 against sdpa directly would judge the summation order: fpdt's math
    blocks and sdpa's fused kernel differ by 1e-5 relative in a gradient here, each about as far from float64.)
    """
    device = torch.device(device)
    ref = _lora(_base(device, sizes))
    model = hf_fpdt.apply(copy.deepcopy(ref).to(dtype), _step_config(sizes, STEP_SETTINGS[setting]))
    ids = _batch(device, sizes)
    got = _train_step(model, ids)
    if not check:
        return got
    want = _train_step(copy.deepcopy(ref).to(dtype), ids)
    exact = _train_step(ref.to(torch.float64), ids)
    assert len(got) == len(want) == len(exact) > 1
    floor = 1e-6 if dtype == torch.float32 else 1e-3
    for i, (a, b, r) in enumerate(zip(got, want, exact)):
        what = f"{setting}: {'loss' if i == 0 else f'grad {i}'}"
        err, base_err = _max_err(a, r), _max_err(b, r)
        bound = 2 * base_err + floor * r.abs().max().item()
        assert err <= bound, f"{what}: {err:.3e} > 2 x sdpa {dtype} {base_err:.3e} (+ floor)"
    return got


def check_bit_identical(device: torch.device, run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race check: ``run()`` with ``FPDT_SYNC_COPIES=1`` gives exactly the asynchronous run's tensors.

    When they differ, the asynchronous run is repeated: if it differs from itself too, the kernels are not
    deterministic run to run (atomics) and the check cannot judge (skipped, naming it); else it is a race. Skipped on
    the virtual device, whose checker finds races without comparing numbers (:data:`NO_RACE_ON_VIRTUAL`).
    """
    if on_virtual(device):
        pytest.skip(NO_RACE_ON_VIRTUAL)
    monkeypatch.setenv("FPDT_SYNC_COPIES", "0")
    plain = run()
    monkeypatch.setenv("FPDT_SYNC_COPIES", "1")
    assert FPDTConfig().sync_copies
    synced = run()
    monkeypatch.setenv("FPDT_SYNC_COPIES", "0")
    if all(torch.equal(a, b) for a, b in zip(plain, synced)):
        return
    again = run()
    if not all(torch.equal(a, b) for a, b in zip(plain, again)):
        pytest.skip("the asynchronous run is not deterministic run to run here; a race check needs it")
    bad = [i for i, (a, b) in enumerate(zip(plain, synced)) if not torch.equal(a, b)]
    raise AssertionError(f"FPDT_SYNC_COPIES=1 changed tensors {bad}: a missing stream/event dependency (a race)")


def check_generate(device: torch.device, sizes: Sizes, **kwargs) -> list[torch.Tensor]:
    """Greedy generation (batch 2, the second row left-padded) through an applied model equals sdpa's."""
    device = torch.device(device)
    ref = _base(device, sizes).eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=sizes.chunk, offload=True))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, sizes.vocab, (2, sizes.prompt), generator=g)
    mask = torch.ones_like(ids)
    pad = sizes.prompt // 6 + 1
    ids[1, :pad], mask[1, :pad] = 0, 0
    ids, mask = ids.to(device), mask.to(device)

    def generate(m):
        out = m.generate(
            ids, attention_mask=mask, max_new_tokens=sizes.new_tokens, do_sample=False, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
        return out.sequences, torch.stack(out.scores)

    want, want_scores = generate(ref)
    got, scores = generate(model)
    assert torch.equal(got, want)
    assert _rel(scores, want_scores) <= sizes.rtol
    return [got, scores]


def check_autocast_step(device: torch.device, sizes: Sizes) -> None:
    """A training step under ``torch.autocast(bf16)`` (fp32 weights): loss and gradients within twice the error
    of sdpa under the same autocast, both against the fp32 step."""
    device = torch.device(device)
    ref = _lora(_base(device, sizes))
    ids = _batch(device, sizes)
    exact = _train_step(copy.deepcopy(ref), ids)
    base = _train_step(copy.deepcopy(ref), ids, torch.bfloat16)
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=sizes.chunk, offload=True))
    got = _train_step(model, ids, torch.bfloat16)
    for i, (a, b, r) in enumerate(zip(got, base, exact)):
        err, base_err = _max_err(a, r), _max_err(b, r)
        assert err <= 2 * base_err + 1e-6 * r.abs().max().item(), f"{i}: {err:.3e} > 2 x {base_err:.3e}"
