"""``torch.compile`` on fpdt models (issue 20, item 4).

The chunk pipeline (attention with its host store, the tiled MLP and LM head + loss, the layer wrappers that
mark recomputation and offload layer inputs, the step's plan) runs eagerly: those entry points are
``torch.compiler.disable``-d, so Dynamo compiles the code around them (embeddings, norms, projections outside
``apply``'s chunked parts) and breaks the graph at them. Training compiled that way, with non-reentrant
activation checkpointing, equals the uncompiled model, and a run over many sequence lengths stays under
Dynamo's recompile limit.

Inference (no gradients, one process) is traced instead (:mod:`hf_fpdt.integrations.compiled`): the mask is
sdpa's, the attention the cached attention's blocks without host syncs, ``apply``'s pieces give way to HF's
forwards. So ``fullgraph=True`` compiles a forward with a padding mask and labels, and generate()'s own
compilation of a static cache's decode step builds one graph for every position, with sdpa's tokens.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from testkit import tiny_model
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import hf_fpdt
from hf_fpdt.bench import speed
from hf_fpdt.models.presets import preset_config

CHUNK = 32


def _model(use_apply: bool, checkpointing: bool) -> torch.nn.Module:
    model = tiny_model("tiny-llama", "sdpa" if use_apply else "fpdt")
    if use_apply:
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _train(model: torch.nn.Module, run, lengths: list[int]) -> list[tuple[float, list[torch.Tensor]]]:
    """SGD steps of ``run`` (the model or its compiled form), one per length: each step's loss and gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        optimizer.step()
    return out


def _assert_same(got, want) -> None:
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert len(grads) == len(ref_grads)
        for g, r in zip(grads, ref_grads):
            assert (g - r).abs().max() <= 1e-5 * max(1.0, float(r.abs().max()))


@pytest.mark.parametrize(
    "use_apply,checkpointing", [(True, True), (False, True), (False, False)], ids=["apply+ckpt", "ckpt", "plain"]
)
def test_compiled_training_equals_uncompiled(use_apply, checkpointing):
    torch._dynamo.reset()
    lengths = [150, 150]  # no chunk divides 150
    eager = _model(use_apply, checkpointing)
    want = _train(eager, eager, lengths)
    model = _model(use_apply, checkpointing)
    got = _train(model, torch.compile(model), lengths)
    _assert_same(got, want)


def test_many_lengths_stay_under_the_recompile_limit(caplog):
    torch._dynamo.reset()
    lengths = [64, 96, 100, 128, 150, 160, 192, 200, 224, 256]  # more than Dynamo's limit of 8 per frame
    eager = _model(True, True)
    want = _train(eager, eager, lengths)
    model = _model(True, True)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        got = _train(model, torch.compile(model), lengths)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()], caplog.text
    _assert_same(got, want)


def test_bench_speed_compile_adds_compiled_variants():
    import argparse

    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    names = [v.name for v in speed.variants(parser.parse_args(["--chunk-size", "64", "--compile"]))]
    assert names == ["sdpa+ckpt", "fpdt+ckpt", "sdpa+ckpt+compile", "fpdt+ckpt+compile"]
    variant = speed.variants(parser.parse_args(["--chunk-size", "64", "--compile", "--no-baseline"]))[-1]
    model = speed.build(variant, preset_config("tiny-llama"), torch.float32, torch.device("cpu"), 0)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert copy.copy(model.fpdt.runtime) is not None  # the runtime is reachable through the compiled module


def _inference_model(use_apply: bool) -> torch.nn.Module:
    return _model(use_apply, checkpointing=False).eval()


def _left_padded(batch: int = 2, n: int = 70) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, : CHUNK + 5] = 0  # a whole key block of padding and part of the next
    return ids, mask


@pytest.mark.parametrize("use_apply", [False, True, "auto"], ids=["attention", "apply", "apply-chunk-auto"])
def test_fullgraph_inference_equals_sdpa(use_apply):
    """``torch.compile(fullgraph=True)`` of a no-grad forward with left padding and labels: sdpa's logits and loss
    (also as the model's first call, with ``chunk_size="auto"`` not yet measured: nothing is resolved in a trace)."""
    model = _inference_model(bool(use_apply))
    if use_apply == "auto":
        model = hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size="auto"))
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids, mask = _left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    torch._dynamo.reset()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits.shape == want.logits.shape
    assert (got.logits - want.logits).abs().max() <= 1e-5 * want.logits.abs().max()
    assert abs(float(got.loss) - float(want.loss)) <= 1e-5 * float(want.loss)


def _compiled_generate(model: torch.nn.Module, ids, mask) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """generate() with a static cache and generate's own compilation of the decode step (on CPU too)."""
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # generate compiles on GPUs only unless told
    torch._dynamo.reset()
    counters.clear()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        cache_implementation="static",
        compile_config=config,
        return_dict_in_generate=True,
        output_scores=True,
    )
    return out.sequences, torch.stack(out.scores), dict(counters["stats"])


@pytest.mark.parametrize("use_apply", [False, True], ids=["attention", "apply"])
def test_static_cache_decode_compiles_once(use_apply):
    """A static cache decodes every position with one fullgraph graph (was: a recompile per position, then
    Dynamo's limit) and generates sdpa's tokens, scores within 1e-5."""
    model = _inference_model(use_apply)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids, mask = _left_padded(n=40)
    want, want_scores, ref_stats = _compiled_generate(ref, ids, mask)
    got, scores, stats = _compiled_generate(model, ids, mask)
    assert ref_stats["unique_graphs"] == 1
    assert stats["unique_graphs"] == 1, stats  # one graph for 9 decode positions
    assert torch.equal(got, want)
    assert (scores - want_scores).abs().max() <= 1e-5 * want_scores.abs().max()


def _sp_compiled_eval(rank: int, world_size: int) -> list[float]:
    """sp 2, no gradients, left padding: the group's loss of the compiled model and of the model itself."""
    import torch.distributed as dist

    from hf_fpdt.config import IGNORE_INDEX
    from hf_fpdt.data.collate import SPCollator

    model = tiny_model("tiny-llama", "sdpa", dtype=None)
    model = hf_fpdt.apply(model.eval(), hf_fpdt.FPDTConfig(chunk_size=CHUNK, sp_size=2), group=dist.group.WORLD)
    ids, mask = _left_padded(n=4 * CHUNK)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}
    shard = SPCollator(rank, world_size, CHUNK, inner=lambda f: f[0])([batch])
    shard["num_items_in_batch"] = (shard["shift_labels"] != IGNORE_INDEX).sum()
    dist.all_reduce(shard["num_items_in_batch"])
    losses = []
    with torch.no_grad():
        for run in (torch.compile(model), model):
            loss = run(**shard).loss
            dist.all_reduce(loss)
            losses.append(float(loss))
    return losses


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sp_inference_under_compile_runs_eagerly():
    """Under SP a compiled no-grad forward (an SP evaluation) keeps the eager pipeline with the group's key mask:
    the loss equals the uncompiled one and the one-process sdpa loss."""
    from distributed import run_distributed

    compiled, eager = run_distributed(_sp_compiled_eval, 2, timeout=300)[0]
    ref = _inference_model(False)
    ref.set_attn_implementation("sdpa")
    ids, mask = _left_padded(n=4 * CHUNK)
    with torch.no_grad():
        want = float(ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
    assert abs(compiled - eager) <= 1e-5 * abs(eager)
    assert abs(eager - want) <= 1e-5 * abs(want)
