"""Every registered family through ``hf_fpdt.apply``: one training step equals HF eager, chunked for real.

Per family a tiny config (fp32, two layers, GQA, head_dim 8) with the family's special pieces switched
on (fused qkv and partial rotary for Phi-3, Granite's multipliers, SmolLM3's NoPE layer, ...) runs one
forward + backward with labels; loss and every parameter gradient must equal HF's eager attention. The
same step runs under a ``TorchDispatchMode`` that sees every aten op: no tensor may have the sequence
dimension together with the intermediate, 2 x intermediate or vocabulary dimension, and no attention
kernel call may take more than one chunk of queries (the check flags an untiled model, see the control).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM

import hf_fpdt

RTOL = 1e-5
BATCH, SEQ, CHUNK = 2, 45, 16  # 3 chunks, the last one short
HIDDEN, INTER, VOCAB = 32, 40, 112  # none of them equals SEQ or BATCH * SEQ
# loss tiles of 15 tokens (the default rule keeps tiles >= 64 tokens: a whole row here)
CONFIG = hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6)
ATTN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# model_type -> what the family's config turns on beyond COMMON
FAMILIES = {
    "llama": {},
    "mistral": {},  # default sliding_window 4096 > SEQ: plain causal attention
    "qwen2": {},
    "qwen3": {},  # per-head q/k norms
    "gemma": {},  # (1 + w) norms, sqrt(hidden) embedding scale
    "phi3": {"partial_rotary_factor": 0.5},  # fused qkv_proj and gate_up_proj
    "olmo2": {},  # q/k norms over the whole projection
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 3.0},
    "smollm3": {"no_rope_layers": [1, 0]},  # layer 1 without RoPE
    "starcoder2": {},  # biases, plain GELU MLP, LayerNorm
    "gpt_neox": {"rotary_pct": 0.25},
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5},  # per-head LayerNorm q/k, logits scaled
    # MoE: router over the whole sequence, experts tiled; HF's auxiliary loss (weighted 0.5 so that it
    # shows in every gradient of the routers) from the untouched router logits
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": INTER},
}
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def _config(model_type: str, **overrides):
    moe = MOE if model_type in ("mixtral", "qwen3_moe") else {}
    cfg = {**COMMON, **FAMILIES.get(model_type, {}), **moe, **overrides}
    if model_type == "gpt_neox":
        for key in ("num_key_value_heads", "head_dim"):
            cfg.pop(key)
    if model_type == "granite":
        cfg["attention_multiplier"] = 0.2
    return AutoConfig.for_model(model_type, **cfg)


def _model(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt without targets
    return {"input_ids": ids, "labels": labels}


def _step(model, batch) -> tuple[torch.Tensor, dict]:
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _rel(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))


def assert_same(ref, got) -> None:
    assert _rel(got[0], ref[0]) < RTOL, (got[0], ref[0])
    assert ref[1].keys() == got[1].keys() and ref[1]
    for name, g in ref[1].items():
        assert got[1][name] is not None, name
        assert _rel(got[1][name], g) < RTOL, f"{name}: {_rel(got[1][name], g)}"


class Recorder(TorchDispatchMode):
    """Every op output's shape, and the query lengths of the attention kernel calls."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple] = []
        self.queries: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in (ATTN_FWD, ATTN_BWD):
            self.queries.append(args[0].shape[2] if func == ATTN_FWD else args[1].shape[2])
        return out


def violations(rec: Recorder, inter: int, seq: int = SEQ, batch: int = BATCH, chunk: int = CHUNK) -> list[str]:
    """Tensors with the full sequence and a wide dimension; attention calls over more than one chunk."""
    wide, full = {inter, 2 * inter, VOCAB}, {seq, batch * seq}
    bad = [f"{s}: full sequence x wide" for s in rec.shapes if set(s) & wide and set(s) & full]
    bad += [f"{s}: [S, S]" for s in rec.shapes if sum(d >= seq for d in s) > 1]
    bad += [f"attention over {q} queries" for q in rec.queries if q > chunk]
    return bad


def recorded_step(model, batch) -> tuple[tuple, Recorder]:
    rec = Recorder()
    with rec:
        result = _step(model, batch)
    return result, rec


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_step_equals_eager_and_is_chunked(model_type):
    ref = _model(_config(model_type))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a registered family gets no partial-support warning
        model = hf_fpdt.apply(copy.deepcopy(ref), CONFIG)
    assert model.fpdt.parts == ("attention", "projection", "mlp", "loss", "layer_input_offload")
    batch = _batch()
    got, rec = recorded_step(model, batch)
    assert_same(_step(ref, batch), got)
    assert rec.queries, "no chunked attention kernel ran"
    if "router_aux_loss_coef" in ref.config:
        out = model(**batch)
        assert out.aux_loss is not None and len(out.router_logits) == ref.config.num_hidden_layers
    assert violations(rec, ref.config.intermediate_size) == []


def test_recorder_flags_an_unchunked_model():
    """Control: HF's own model (sdpa over the whole sequence, full MLP and logits) fails every check."""
    model = AutoModelForCausalLM.from_config(_config("qwen2"), attn_implementation="sdpa").train()
    _, rec = recorded_step(model, _batch())
    bad = violations(rec, INTER)
    assert any("attention over 45" in b for b in bad) and any("wide" in b for b in bad)
    assert any(s[-1] == VOCAB and BATCH * SEQ in (s[0], s[0] * s[1]) for s in rec.shapes)


def test_models_that_bypass_the_attention_interface_are_refused():
    cfg = AutoConfig.for_model("falcon", **{k: v for k, v in COMMON.items() if k != "head_dim"})
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="does not dispatch through HF's attention interface"):
        hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))


# ----------------------------------------------------------------------------- two sequence-parallel processes

SP_CASES = {  # name: (model_type, config overrides, document lengths of a packed row or None)
    "qwen3": ("qwen3", {}, None),  # dense, per-head q/k norms
    "mixtral": ("mixtral", {"output_router_logits": False}, None),  # MoE (HF's aux loss needs the whole sequence)
    "mistral-w20": ("mistral", {"sliding_window": 20}, None),  # a window shorter than the sequence, across ranks
    "llama-packed": ("llama", {}, (13, 20, 12)),  # packed documents in the Fig. 6 layout
}


def _positions(docs, batch: int) -> torch.Tensor | None:
    return None if docs is None else torch.cat([torch.arange(n) for n in docs]).expand(batch, -1)


def _sp_worker(rank: int, world_size: int, states: dict, ids, labels) -> dict:
    import torch.distributed as dist

    from hf_fpdt.core.sp_loss import global_loss, reduce_gradients
    from hf_fpdt.data.layout import shard_batch

    group = dist.group.WORLD
    results = {}
    for name, (model_type, overrides, docs) in SP_CASES.items():
        model = _model(_config(model_type, **overrides))
        model.load_state_dict(states[name])
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, loss_chunks=6), group=group).train()
        pos = _positions(docs, ids.shape[0])
        shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK, position_ids=pos)
        out = model(**shard.model_kwargs())
        out.loss.backward()
        reduce_gradients(model.parameters(), group)
        results[name] = (global_loss(out.loss, group), {n: p.grad for n, p in model.named_parameters()})
    # HF's MoE auxiliary loss averages over the whole sample: refused under SP, on every rank
    model = hf_fpdt.apply(_model(_config("mixtral")), hf_fpdt.FPDTConfig(chunk_size=CHUNK), group=group)
    try:
        model(**shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=CHUNK).model_kwargs())
    except ValueError as e:
        results["refused"] = str(e)
    return results


def test_two_sp_ranks_equal_one_process_dense_moe_windowed_packed():
    from distributed import run_distributed

    batch = _batch()
    want, states = {}, {}
    for name, (model_type, overrides, docs) in SP_CASES.items():
        ref = _model(_config(model_type, **overrides))
        pos = _positions(docs, BATCH)
        want[name] = _step(ref, {**batch, "position_ids": pos, "use_cache": False} if docs else batch)
        states[name] = ref.state_dict()
    for got in run_distributed(_sp_worker, 2, states, batch["input_ids"], batch["labels"]):
        for name in SP_CASES:
            assert_same(want[name], got[name])
        assert "output_router_logits under sequence parallelism" in got.get("refused", "")
