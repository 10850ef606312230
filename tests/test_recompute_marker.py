"""Under non-reentrant checkpointing the attention's recomputation stores no q/o/lse chunks again.

Backward runs on the chunks the first forward stored; `hf_fpdt.apply` marks the checkpoint's
recomputation (torch.utils.checkpoint's `context_fn`) so the attention skips the second copy. Reentrant
checkpointing differentiates the recomputed graph itself and must keep storing.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fpdt
from hf_fpdt.presets import preset_config

SEQ, CHUNK = 150, 32


def _step(use_reentrant: bool | None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, offload=True))
    if use_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    runtime = model.fpdt_runtime
    store = runtime.store(torch.device("cpu"))
    new_puts = {"first forward": 0, "recompute": 0}
    put = store.put

    def counting_put(t, slot=None):
        if slot is None:
            new_puts["recompute" if runtime.recomputing else "first forward"] += 1
        return put(t, slot)

    store.put = counting_put
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return new_puts, grads, runtime.recomputing


def test_recompute_stores_only_the_kv_its_own_chunks_need():
    layers, chunks = 2, math.ceil(SEQ / CHUNK)
    plain, plain_grads, _ = _step(None)
    marked, marked_grads, depth = _step(False)
    assert depth == 0  # the scope is closed again after backward
    # forward stores q, k, v, o, lse per chunk and layer; backward parks dO and the dq accumulators
    assert marked["first forward"] == plain["first forward"]
    # the recomputation parks only k, v (later chunks of the same forward read them), nothing for backward
    assert marked["recompute"] == 2 * chunks * layers
    for name, grad in plain_grads.items():
        torch.testing.assert_close(marked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.filterwarnings("ignore")
def test_reentrant_checkpointing_is_left_alone_and_exact():
    plain, plain_grads, _ = _step(None)
    reentrant, reentrant_grads, _ = _step(True)
    assert reentrant["recompute"] == 0  # not marked: its recomputed graph is the one differentiated
    for name, grad in plain_grads.items():
        torch.testing.assert_close(reentrant_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
