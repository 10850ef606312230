"""``hf_fpdt.apply`` on whole models: exact against HF ``sdpa``, and free of full-sequence spikes.

Exactness (fp32, CPU): loss and every parameter gradient, odd lengths, batch 2, a prompt without
targets, gradient checkpointing on and off, several chunk sizes, Llama (GQA) and GPT-NeoX (fused
interleaved qkv, partial rotary), PEFT LoRA applied before or after ``apply``, HF's loss arguments
(``num_items_in_batch``, ``shift_labels``), and two sequence-parallel processes (gloo).

Spikes: a ``TorchDispatchMode`` records every op's outputs during an ``apply``-ed forward + backward and
checks that no ``[.., S, vocab]`` tensor exists and that every matmul reading a q/k/v projection, MLP
or LM-head weight produces at most one chunk/tile of rows. The same recorder flags the untiled model
(fpdt attention only), so the check can fail.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from peft import LoraConfig, get_peft_model
from testkit import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_fpdt
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients
from hf_fpdt.integrations.patches import loss_tiles, mlp_tiles

RTOL = 1e-5
BATCH, SEQ = 2, 77  # odd, and longer than the hidden size (64) so weight shapes never look like activations


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _data(seq: int = SEQ, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 2] = -100  # a prompt without targets
    return ids, labels


def _train(model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model: torch.nn.Module, **kwargs) -> tuple[torch.Tensor, dict]:
    out = model(**kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(ref: tuple, got: tuple) -> None:
    assert _rel(got[0], ref[0]) < RTOL, (got[0], ref[0])
    assert ref[1].keys() == got[1].keys() and ref[1]
    for name, g in ref[1].items():
        assert got[1][name] is not None, name
        assert _rel(got[1][name], g) < RTOL, f"{name}: {_rel(got[1][name], g)}"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", [16, 1000])
def test_apply_equals_sdpa(preset, checkpointing, chunk):
    ref = _train(tiny_model(preset), checkpointing)
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=chunk))
    _train(model, checkpointing)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    ids, labels = _data()
    _assert_same(_step(ref, input_ids=ids, labels=labels), _step(model, input_ids=ids, labels=labels))


# (seq, chunk, batch, kv heads, head_dim, offload): the attention tests' shape classes at model level:
# MQA / MHA / GQA, a chunk longer than the sequence, many tiny chunks, offload on and off.
SHAPES = [(63, 64, 3, 1, 18, False), (63, 8, 1, 4, 16, True), (5, 2, 3, 2, 16, True), (130, 1000, 2, 1, 16, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_apply_equals_sdpa_across_attention_shapes(shape):
    seq, chunk, batch, kv, head_dim, offload = shape
    ref = _train(tiny_model("tiny-llama", num_key_value_heads=kv, head_dim=head_dim), True)
    model = _train(hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=chunk, offload=offload)), True)
    ids = torch.randint(0, 512, (batch, seq))
    _assert_same(_step(ref, input_ids=ids, labels=ids), _step(model, input_ids=ids, labels=ids))


def test_apply_bf16_within_twice_the_error_of_sdpa_bf16():
    """bf16: the error against a float64 reference stays within twice that of HF sdpa in bf16."""
    ref64 = tiny_model("tiny-llama").to(torch.float64)
    sdpa = copy.deepcopy(ref64).to(torch.bfloat16)
    fpdt = hf_fpdt.apply(copy.deepcopy(sdpa), hf_fpdt.FPDTConfig(chunk_size=16))
    ids, labels = _data()
    (loss64, g64), errs = _step(_train(ref64, True), input_ids=ids, labels=labels), {}
    for name, model in (("sdpa", sdpa), ("fpdt", fpdt)):
        loss, grads = _step(_train(model, True), input_ids=ids, labels=labels)
        errs[name] = (abs(float(loss) - float(loss64)), max(_rel(grads[n].double(), g) for n, g in g64.items()))
    assert errs["fpdt"][0] <= 2 * errs["sdpa"][0] + 1e-4, errs
    assert errs["fpdt"][1] <= 2 * errs["sdpa"][1], errs


def test_apply_keeps_hf_loss_arguments_and_outputs():
    ref = tiny_model("tiny-llama").train()
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=16)).train()
    ids, labels = _data()
    # num_items_in_batch: sum / num_items (e.g. gradient accumulation over several micro-batches)
    items = torch.tensor(123)
    _assert_same(
        _step(ref, input_ids=ids, labels=labels, num_items_in_batch=items),
        _step(model, input_ids=ids, labels=labels, num_items_in_batch=items),
    )
    ref.zero_grad()
    model.zero_grad()
    # shift_labels (pre-shifted targets, HF 5's ForCausalLMLoss argument) instead of labels
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    _assert_same(
        _step(ref, input_ids=ids, labels=labels), _step(model, input_ids=ids, labels=labels, shift_labels=shifted)
    )
    out = model(input_ids=ids, labels=labels)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits is None  # no [S, vocab] logits with labels
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and _rel(as_tuple[0], out.loss) == 0
    # without labels: HF's behaviour, logits returned (in training without a cache: chunked attention path)
    with torch.no_grad():
        got, want = model(input_ids=ids), ref(input_ids=ids)
    assert got.loss is None and _rel(got.logits, want.logits) < RTOL
    ref.zero_grad()
    model.zero_grad()
    got, want = model(input_ids=ids), ref(input_ids=ids)
    assert got.past_key_values is None and _rel(got.logits, want.logits) < RTOL
    got.logits.square().mean().backward()
    want.logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < RTOL, name


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
def test_apply_with_lora(order):
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    base = tiny_model("tiny-llama")
    torch.manual_seed(2)
    ref = _train(get_peft_model(copy.deepcopy(base), lora), True)
    if order == "peft_then_apply":
        model = hf_fpdt.apply(get_peft_model(copy.deepcopy(base), lora), hf_fpdt.FPDTConfig(chunk_size=16))
    else:
        model = get_peft_model(hf_fpdt.apply(copy.deepcopy(base), hf_fpdt.FPDTConfig(chunk_size=16)), lora)
    model.load_state_dict(ref.state_dict())
    _train(model, True)
    ids, labels = _data()
    ref_step, got_step = _step(ref, input_ids=ids, labels=labels), _step(model, input_ids=ids, labels=labels)
    assert all("lora_" in n for n in got_step[1]) and len(got_step[1]) == 2 * 4 * 2  # A and B, 4 targets, 2 layers
    _assert_same(ref_step, got_step)


def test_other_models_keep_fpdt_attention_and_say_what_applies():
    ref = tiny_model(  # a family the registry does not list
        "phi", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    partly = r"PhiForCausalLM \(phi\) is only partly supported.*Not applied: projection, mlp"
    with pytest.warns(UserWarning, match=partly):
        model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=8))
    assert model.fpdt.parts == ("attention", "layer_input_offload")
    ids, labels = _data(seq=21, vocab=128)
    _assert_same(_step(ref, input_ids=ids, labels=labels), _step(model, input_ids=ids, labels=labels))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fully supported model gets no warning
        hf_fpdt.apply(tiny_model("tiny-llama"), hf_fpdt.FPDTConfig(chunk_size=8))


def test_tile_counts_follow_the_config():
    rt = hf_fpdt.FPDTRuntime(hf_fpdt.FPDTConfig(chunk_size=16))
    assert mlp_tiles(rt, 77, torch.device("cpu")) == 2 * 5  # twice the attention's 5 chunks
    assert mlp_tiles(rt, 3, torch.device("cpu")) == 2
    assert loss_tiles(rt, 32000, 256, 1 << 20) == 250  # 2 * vocab / hidden at long lengths
    assert loss_tiles(rt, 32000, 256, 1000) == 16  # but no tile under 64 tokens
    rt = hf_fpdt.FPDTRuntime(hf_fpdt.FPDTConfig(chunk_size=16, mlp_chunks=3, loss_chunks=7))
    assert mlp_tiles(rt, 77, torch.device("cpu")) == 3 and loss_tiles(rt, 32000, 256, 1000) == 7


# ----------------------------------------------------------------------------- dispatch-mode spike check

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class _Recorder(TorchDispatchMode):
    """Records every op output's shape, and the row count of matmuls that read watched weights."""

    def __init__(self, watched: dict[str, list[torch.Tensor]]) -> None:
        super().__init__()
        self.watched = {k: {p.untyped_storage().data_ptr() for p in ps} for k, ps in watched.items()}
        self.shapes: list[tuple] = []
        self.rows: dict[str, list[int]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.shapes += [tuple(t.shape) for t in outs]
        if func.overloadpacket in MATMULS and outs:
            ptrs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            rows = outs[0].numel() // max(outs[0].shape[-1], 1)
            for name, watched in self.watched.items():
                if ptrs & watched:
                    self.rows[name].append(rows)
        return out


def _watch(model: torch.nn.Module, family: str) -> dict[str, list[torch.Tensor]]:
    names = {
        "llama": {"qkv": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")},
        "neox": {"qkv": ("query_key_value",), "mlp": ("dense_h_to_4h", "dense_4h_to_h")},
    }[family]
    watched = {
        k: [p for n, p in model.named_parameters() if any(f".{m}." in n for m in mods)] for k, mods in names.items()
    }
    watched["lm_head"] = [model.get_output_embeddings().weight]  # GPT-NeoX: embed_out up to transformers 5.10
    assert all(watched.values())
    return watched


def _record(model: torch.nn.Module, family: str, ids, labels) -> _Recorder:
    rec = _Recorder(_watch(model, family))
    with rec:
        model(input_ids=ids, labels=labels).loss.backward()
    return rec


def _violations(rec: _Recorder, vocab: int, inter: int, limits: dict[str, int]) -> list[str]:
    bad = [f"{s} ~ [.., S, vocab]" for s in rec.shapes if s and s[-1] == vocab and math.prod(s[:-1]) >= SEQ]
    bad += [f"{s} ~ [.., S, intermediate]" for s in rec.shapes if s and s[-1] == inter and math.prod(s[:-1]) >= SEQ]
    for name, limit in limits.items():
        assert rec.rows[name], f"no matmul read the {name} weights: the recorder is blind"
        bad += [f"{name} matmul with {r} rows > {limit}" for r in rec.rows[name] if r > limit]
    return bad


@pytest.mark.parametrize(("preset", "family"), [("tiny-llama", "llama"), ("tiny-neox", "neox")])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_full_sequence_logits_projection_or_mlp(preset, family, checkpointing):
    # Llama with head_dim 24: q is 96 wide and k/v 48, neither the hidden size (64) nor the MLP's (128)
    overrides = {"head_dim": 24} if family == "llama" else {}
    chunk = 16
    ids, labels = _data()
    model = _train(hf_fpdt.apply(tiny_model(preset, **overrides), hf_fpdt.FPDTConfig(chunk_size=chunk)), checkpointing)
    cfg = model.config
    rt = model.fpdt.runtime
    limits = {
        "qkv": BATCH * chunk,
        "mlp": BATCH * math.ceil(SEQ / mlp_tiles(rt, SEQ, ids.device)),
        "lm_head": math.ceil(BATCH * SEQ / loss_tiles(rt, cfg.vocab_size, cfg.hidden_size, BATCH * SEQ)),
    }
    rec = _record(model, family, ids, labels)
    assert _violations(rec, cfg.vocab_size, cfg.intermediate_size, limits) == []

    if checkpointing:
        return
    # The same check on the untiled model (fpdt attention, HF projections/MLP/loss) must fail.
    plain = _train(tiny_model(preset, **overrides), checkpointing)
    plain.set_attn_implementation("fpdt")
    bad = _violations(_record(plain, family, ids, labels), cfg.vocab_size, cfg.intermediate_size, limits)
    for what in ("vocab", "intermediate", "qkv matmul", "mlp matmul", "lm_head matmul"):
        assert any(what in b for b in bad), what


# ----------------------------------------------------------------------------- two sequence-parallel processes


def _sp_worker(rank: int, world_size: int, state: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    group = dist.group.WORLD
    model = tiny_model("tiny-llama")
    model.load_state_dict(state)
    model = _train(hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=16), group=group), True)
    shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=16)
    out = model(**shard.model_kwargs())
    out.loss.backward()
    reduce_gradients(model.parameters(), group)
    return {"loss": global_loss(out.loss, group), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.multiprocess
def test_two_sp_ranks_with_apply_equal_one_process():
    ref = _train(tiny_model("tiny-llama"), True)
    ids, labels = _data()
    want = _step(ref, input_ids=ids, labels=labels)
    for got in run_distributed(_sp_worker, 2, ref.state_dict(), ids, labels):
        _assert_same(want, (got["loss"], got["grads"]))
