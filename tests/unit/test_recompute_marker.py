"""Under non-reentrant checkpointing the attention's recomputation replays the first forward's output.

Backward runs on the chunks the first forward stored, output included; `hf_fpdt.apply` marks the
checkpoint (torch.utils.checkpoint's `context_fn`) so the recomputation rebuilds the attention output
from those chunks: no attention kernel runs and nothing is stored a second time. Reentrant
checkpointing differentiates the recomputed graph itself and must keep computing and storing.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.attention.routes import Router

SEQ, CHUNK = 150, 32


def _step(monkeypatch, use_reentrant: bool | None, lora_dropout: float | None = None):
    """One training step; returns (new host-store puts, attention kernel calls, grads, final recompute depth)."""
    model = tiny_model("tiny-llama", None, dtype=None)
    if lora_dropout is not None:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(model, cfg)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, offload=True))
    if use_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    runtime = model.fpdt.runtime
    store = runtime.store(torch.device("cpu"))
    puts = {"first forward": 0, "recompute": 0}
    kernels = {"first forward": 0, "recompute": 0}
    put, block_forward = store.put, Router.forward

    def phase() -> str:
        return "recompute" if runtime.checkpointing.recomputing else "first forward"

    def counting_put(t, slot=None, **kwargs):
        if slot is None:
            puts[phase()] += 1
        return put(t, slot, **kwargs)

    def counting_block_forward(*args, **kwargs):
        kernels[phase()] += 1
        return block_forward(*args, **kwargs)

    store.put = counting_put
    monkeypatch.setattr(Router, "forward", counting_block_forward)
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # LoRA dropout draws from here on
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    monkeypatch.undo()
    return puts, kernels, grads, runtime.checkpointing.recomputing


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_recompute_replays_the_stored_output(monkeypatch):
    plain_puts, plain_kernels, plain_grads, _ = _step(monkeypatch, None)
    puts, kernels, grads, depth = _step(monkeypatch, False)
    assert depth == 0  # the scope is closed again after backward
    # the first forward is the plain one: q, k, v, o, lse per chunk and layer, the same kernel calls
    assert puts["first forward"] == plain_puts["first forward"]
    assert kernels["first forward"] == plain_kernels["first forward"] > 0
    # the recomputation computes no attention and parks nothing
    assert puts["recompute"] == 0 and kernels["recompute"] == 0
    _assert_same_grads(grads, plain_grads)


def test_replay_leaves_the_random_stream_where_attention_left_it(monkeypatch):
    """LoRA dropout inside the chunked projection draws random numbers; the recomputation skips it.

    The o_proj and MLP adapters' dropout after the attention must still draw the masks the first
    forward drew, or their gradients differ from the step without checkpointing.
    """
    _, _, plain_grads, _ = _step(monkeypatch, None, lora_dropout=0.2)
    _, kernels, grads, _ = _step(monkeypatch, False, lora_dropout=0.2)
    assert kernels["recompute"] == 0
    _assert_same_grads(grads, plain_grads)


@pytest.mark.filterwarnings("ignore")
def test_reentrant_checkpointing_is_left_alone_and_exact(monkeypatch):
    _, plain_kernels, plain_grads, _ = _step(monkeypatch, None)
    _, kernels, grads, _ = _step(monkeypatch, True)
    # not marked (runtime.checkpointing.recomputing stays 0): its recomputed graph is the one differentiated, so the
    # recomputation computes attention again, as a second forward
    assert kernels["recompute"] == 0 and kernels["first forward"] == 2 * plain_kernels["first forward"]
    _assert_same_grads(grads, plain_grads)
