"""A checkpointed layer input that is packed and never unpacked gives its slot back when it dies.

A forward whose graph is dropped without backward (an eval-style call under ``train()``, a step abandoned after an
exception in the forward) leaves the offloader's packed inputs unused. Their host buffers and their share of the
step's :class:`~hf_fpdt.memory.host_store.DeviceBudget` must come back then, or every later lasting put goes to the
host as if the budget were full. CPU stores that really copy (``enabled=True``), a budget of one layer input.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fpdt.integrations.layer_wrappers import offload_layer_inputs
from hf_fpdt.memory.checkpointing import LayerInputOffloader
from hf_fpdt.memory.host_store import DeviceBudget

ROWS, WIDTH = 3, 8
INPUT_BYTES = ROWS * WIDTH * 4  # one fp32 layer input


class _Layer(nn.Module):
    """A stand-in for an HF GradientCheckpointingLayer that always checkpoints its body (non-reentrant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * x


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom after the checkpointed layers")


def _model(offloader: LayerInputOffloader, fail: bool = False) -> nn.Sequential:
    layers = [_Layer(), _Layer(), _Layer()]
    for layer in layers:
        offload_layer_inputs(layer, offloader)
    return nn.Sequential(*layers, *([_Boom()] if fail else [])).train()


def _offloader() -> LayerInputOffloader:
    return LayerInputOffloader(DeviceBudget(INPUT_BYTES), enabled=True)  # copies on CPU too, as on a GPU


def _x() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, requires_grad=True)


def _assert_all_given_back(off: LayerInputOffloader) -> None:
    store = off.store(torch.device("cpu"))
    # the budget has room again: the next lasting put stays on the device instead of going to the host
    slot = store.put(torch.ones(ROWS, WIDTH), lasting=True)
    placed = "device" if slot.device_tensor is not None else "host"
    store.release(slot)
    assert placed == "device", f"a put after the dropped graph went to the {placed} (budget used {off.budget.used})"
    assert store.host_used == 0, f"{store.host_used} host bytes still charged"
    assert store.resident_used == 0 and off.budget.used == 0, f"{off.budget.used} device-budget bytes still charged"


def test_graph_dropped_without_backward_gives_the_inputs_back():
    off = _offloader()
    out = _model(off)(_x())
    assert off.placement() == ["host", "host", "device"]  # the oldest spilled: something is charged on both tiers
    store = off.store(torch.device("cpu"))
    assert store.host_used == 2 * INPUT_BYTES and off.budget.used == INPUT_BYTES
    del out  # the graph and its saved (packed) inputs go, never unpacked
    assert off.placement() == []
    _assert_all_given_back(off)


def test_exception_in_the_forward_gives_the_inputs_back():
    off = _offloader()
    model = _model(off, fail=True)
    packed = []
    with pytest.raises(RuntimeError, match="boom after the checkpointed layers") as info:
        model(_x())
    packed.append(len(off.placement()))
    del info  # the traceback held the frames, and so the partial graph
    assert packed == [3]  # the three layer inputs were packed before the error
    _assert_all_given_back(off)


def test_an_input_prefetched_but_never_unpacked_is_given_back():
    """Backward unpacks layer 2's input and prefetches layer 1's, then stops (an error in backward): the prefetched
    input holds a pending fetch and its slot; both go when the graph does."""
    off = _offloader()
    store = off.store(torch.device("cpu"))
    saved = [off.pack(torch.full((ROWS, WIDTH), float(i))) for i in range(3)]
    assert torch.equal(off.unpack(saved[2]), torch.full((ROWS, WIDTH), 2.0))  # prefetches saved[1]
    assert saved[1]._fetched is not None and store.host_used == 2 * INPUT_BYTES
    saved[1].release()
    saved[1].release()  # idempotent
    assert saved[1]._fetched is None and saved[1].slot is None and store.host_used == INPUT_BYTES
    del saved
    _assert_all_given_back(off)


def test_release_after_unpack_keeps_the_tensor():
    off = _offloader()
    saved = off.pack(torch.full((ROWS, WIDTH), 4.0))
    t = off.unpack(saved)
    saved.release()  # the slot went back at the unpack: nothing to do, and the tensor stays for a repeated unpack
    assert off.unpack(saved) is t
    del saved
    _assert_all_given_back(off)
