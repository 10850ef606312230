"""A ``mask_mod`` that is not a pure function is refused by name (issue 38 item 4), and an applied model pickles
after a step (item 2a): a random mask per call gave another loss on each of two identical forwards (4.8368 and
4.8347), and ``torch.save(model)`` raised ``TypeError: cannot pickle 'weakref.ReferenceType' object``."""

from __future__ import annotations

import io

import pytest
import torch
from testkit import tiny_model

import hf_fpdt


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(0))


def _coin_mask(b, h, q, kv):
    return (kv <= q) & ((kv == q) | (torch.rand(torch.broadcast_shapes(q.shape, kv.shape)) < 0.5))


def _window_mask(b, h, q, kv):
    return (kv <= q) & (q - kv < 8)


def test_a_random_mask_mod_is_refused_by_name() -> None:
    model = hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=16, attention_pattern=_coin_mask))
    with pytest.raises(ValueError, match=r"mask_mod _coin_mask returns different values .* on two evaluations"):
        model(input_ids=_ids(), labels=_ids())


class _Flipping:
    """A band of 7 keys, or 3 on every other call (state that changes between calls)."""

    calls = 0

    def __call__(self, b, h, q, kv):
        self.calls += 1
        return (kv <= q) & (q - kv < (3 if self.calls % 2 else 7))


def test_a_mask_mod_with_changing_state_is_refused_by_name() -> None:
    model = hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=16, attention_pattern=_Flipping()))
    with pytest.raises(
        ValueError,
        match=r"mask_mod _Flipping returns different values .* \(b=0, h=0, q_idx=3, kv_idx=0: False, then True\)",
    ):
        model(input_ids=_ids(), labels=_ids())


def test_a_pure_mask_mod_gives_the_same_loss_twice() -> None:
    model = hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=16, attention_pattern=_window_mask))
    first, second = (model(input_ids=_ids(), labels=_ids()).loss for _ in range(2))
    assert torch.equal(first, second)


def test_an_applied_model_pickles_after_a_step() -> None:
    """Gradient checkpointing with the layer inputs offloaded: the device budget and the offloader held weak
    references to the step's tensors. The copy computes the same loss and is applied (its own runtime)."""
    model = tiny_model()
    model.gradient_checkpointing_enable()
    model.disable_input_require_grads()  # HF's input hook is a local function: HF's own model would not pickle
    model.train()
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=16, offload_layer_inputs=True, checkpoint_segments=1))
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    assert copy.fpdt is not None and copy.fpdt.runtime is not model.fpdt.runtime
    again = copy(input_ids=_ids(), labels=_ids()).loss
    again.backward()
    assert torch.equal(again, loss)
