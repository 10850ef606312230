"""``torch.compile`` on fpdt models (issue 20, item 4).

The chunk pipeline (attention with its host store, the tiled MLP and LM head + loss, the layer wrappers that
mark recomputation and offload layer inputs, the step's plan) runs eagerly: those entry points are
``torch.compiler.disable``-d, so Dynamo compiles the code around them (embeddings, norms, projections outside
``apply``'s chunked parts) and breaks the graph at them. Training compiled that way, with non-reentrant
activation checkpointing, equals the uncompiled model, and a run over many sequence lengths stays under
Dynamo's recompile limit.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fpdt
from hf_fpdt.bench import speed
from hf_fpdt.models.presets import preset_config

CHUNK = 32


def _model(use_apply: bool, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        preset_config("tiny-llama"), attn_implementation="sdpa" if use_apply else "fpdt"
    )
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
    assert copy.copy(model.fpdt_runtime) is not None  # the runtime is reachable through the compiled module
