"""Tiny Llama (GQA) and GPT-NeoX built from a config: ``attn_implementation="fpdt"`` against ``sdpa``.

Loss and every parameter gradient must agree to ~1e-5 relative in fp32 at a length no chunk divides,
with batch > 1, offload on and off, and with HF's (non-reentrant) gradient checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import rel_err, tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime

SEQ, CHUNK, BATCH = 203, 64, 2  # 203 = 3 * 64 + 11: the last chunk is short


class CountingRuntime(FPDTRuntime):
    """Counts how often the attention pipeline asks for its store: once per forward and per backward."""

    calls = 0

    def store(self, device):
        self.calls += 1
        return super().store(device)


def _attention_modules(model):
    mods = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    assert len(mods) == model.config.num_hidden_layers
    return mods


def _pair(preset: str, offload: bool):
    """The same weights twice: HF sdpa, and fpdt with one runtime shared by all attention layers."""
    ref = tiny_model(preset, "sdpa", dtype=None, seed=None).float()
    fpdt = copy.deepcopy(ref)
    fpdt.set_attn_implementation("fpdt")
    assert fpdt.config._attn_implementation == "fpdt" and ref.config._attn_implementation == "sdpa"
    runtime = CountingRuntime(FPDTConfig(chunk_size=CHUNK, offload=offload))
    hf_fpdt.configure(fpdt, runtime.config)
    fpdt.fpdt.runtime = runtime  # the model's one runtime, counting (every attention module refers to this state)
    assert {id(m.fpdt) for m in _attention_modules(fpdt)} == {id(fpdt.fpdt)}
    return ref, fpdt, runtime


def _loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def _assert_same(ref_out, fpdt_out, tol=1e-5):
    (ref_loss, ref_grads), (loss, grads) = ref_out, fpdt_out
    assert torch.isfinite(loss)
    assert rel_err(loss, ref_loss) < tol
    assert grads.keys() == ref_grads.keys()
    worst = 0.0
    for name, g in grads.items():
        assert g is not None and ref_grads[name] is not None, name
        err = rel_err(g, ref_grads[name])
        assert err < tol, (name, err)
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "device"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_fpdt_matches_sdpa(preset, offload, checkpointing):
    ref, fpdt, runtime = _pair(preset, offload)
    for model in (ref, fpdt):
        model.train()  # attention_dropout is 0 in these presets: train mode is deterministic
        if checkpointing:
            model.gradient_checkpointing_enable()  # HF 5 default: non-reentrant
            assert model.is_gradient_checkpointing
    ids = torch.randint(0, ref.config.vocab_size, (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    _assert_same(_loss_and_grads(ref, **batch), _loss_and_grads(fpdt, **batch))
    layers = ref.config.num_hidden_layers
    # the fpdt pipeline really ran: forward + backward per layer, + the recomputed forward
    assert runtime.calls >= layers * (3 if checkpointing else 2)
    store = runtime.store(torch.device("cpu"))
    assert (store.host_bytes > 0) == offload
    assert store.pooled_bytes() == store.host_bytes  # nothing left checked out after backward
    first = store.host_bytes
    _loss_and_grads(fpdt, **batch)  # the next step reuses the pool (recomputed chunks included)
    assert store.host_bytes == first and store.pooled_bytes() == first


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
def test_right_padding_matches_sdpa(preset):
    """Right padding (mask zeros after the real tokens, labels -100 there) gives sdpa's loss and grads."""
    ref, fpdt, runtime = _pair(preset, offload=True)
    ids = torch.randint(0, ref.config.vocab_size, (3, SEQ))
    lengths = [SEQ, 150, 77]
    mask = torch.zeros(3, SEQ, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    _assert_same(_loss_and_grads(ref, **batch), _loss_and_grads(fpdt, **batch))
    assert runtime.calls >= 2 * ref.config.num_hidden_layers


def test_forward_logits_match_without_labels():
    ref, fpdt, runtime = _pair("tiny-llama", offload=False)
    ids = torch.randint(0, ref.config.vocab_size, (2, 130))
    with torch.no_grad():
        assert rel_err(fpdt(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
    assert (
        runtime.calls == 0
    )  # no gradient needed: hf_fpdt.attention.cached_attention's block loop, which stores nothing
