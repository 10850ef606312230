"""Offload of checkpointed layer inputs: what is packed, prefetch order, round trips, exactness."""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import tiny_model
from torch import nn

import hf_fpdt
from hf_fpdt.integrations.layer_wrappers import offload_layer_inputs
from hf_fpdt.memory.checkpointing import LayerInputOffloader
from hf_fpdt.memory.host_store import HostStore


class _RecordingStore(HostStore):
    """A host store that really copies (even on CPU) and logs every put/fetch by tensor tag."""

    def __init__(self, log: list) -> None:
        super().__init__(torch.device("cpu"), enabled=True)
        self.log = log

    def put(self, t, slot=None, lasting=False):
        self.log.append(("put", float(t.flatten()[0])))
        return super().put(t, slot, lasting=lasting)

    def fetch(self, slot):
        self.log.append(("fetch", float(slot.host.flatten()[0])))
        return super().fetch(slot)


class _RecordingOffloader(LayerInputOffloader):
    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self._store = _RecordingStore(self.log)

    def store(self, device):
        return self._store


def test_cpu_path_keeps_the_tensor_and_passes_parameters_through():
    off = LayerInputOffloader()
    t = torch.randn(3, 4)
    assert off.unpack(off.pack(t)) is t  # CPU: no copy, same code path
    p = nn.Parameter(torch.randn(2))
    assert off.pack(p) is p
    empty = torch.empty(0)
    assert off.pack(empty) is empty


def test_unpack_prefetches_the_previous_layer_input_and_pools_buffers():
    off = _RecordingOffloader()
    tensors = [torch.full((8,), float(i)) for i in range(3)]
    packed = [off.pack(t) for t in tensors]
    assert off.log == [("put", 0.0), ("put", 1.0), ("put", 2.0)]
    assert all(torch.equal(off.unpack(p), t) for p, t in zip(reversed(packed), reversed(tensors)))
    # layer 2's unpack fetched its own input, then started layer 1's; layer 1's unpack started layer 0's
    assert off.log[3:] == [("fetch", 2.0), ("fetch", 1.0), ("fetch", 0.0)]
    assert off._store.pooled_bytes() == 3 * 8 * 4  # every host buffer is back in the pool
    assert torch.equal(off.unpack(packed[0]), tensors[0])  # a repeated unpack (retain_graph) still works
    again = off.pack(torch.full((8,), 5.0))  # the next step reuses a pooled buffer: nothing new allocated
    assert off._store.host_bytes == 3 * 8 * 4 and torch.equal(off.unpack(again), torch.full((8,), 5.0))


class _Layer(nn.Module):
    """A stand-in for an HF GradientCheckpointingLayer: checkpoints its body when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gradient_checkpointing = False

    def forward(self, x):
        if self.gradient_checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)

    def _body(self, x):
        return torch.tanh(self.lin(x)) * x


@pytest.mark.parametrize(("checkpointing", "training", "packs"), [(True, True, 1), (False, True, 0), (True, False, 0)])
def test_layer_wrapper_offloads_only_the_checkpoint_input(checkpointing, training, packs):
    layer = _Layer().train(training)
    layer.gradient_checkpointing = checkpointing
    off = _RecordingOffloader()
    offload_layer_inputs(layer, off)
    offload_layer_inputs(layer, off)  # idempotent
    x = torch.randn(3, 6, requires_grad=True)
    layer(x).sum().backward()
    assert sum(1 for kind, _ in off.log if kind == "put") == packs  # only x: the body's saves are the checkpoint's
    ref = _Layer()
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().requires_grad_()
    ref(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(layer.lin.weight.grad, ref.lin.weight.grad)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
def test_model_with_copying_offload_equals_sdpa(preset):
    """Force real host copies on CPU through a whole apply-ed model with checkpointing: still exact."""
    ref = tiny_model(preset, "sdpa")
    model = hf_fpdt.apply(copy.deepcopy(ref), hf_fpdt.FPDTConfig(chunk_size=16))
    log: list = []
    model.fpdt.layer_offloader._stores["cpu"] = _RecordingStore(log)  # copy for real, and count
    for m in (ref, model):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 29))
    ref(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    assert sum(1 for kind, _ in log if kind == "put") == 2  # one input per layer
    loss.backward()
    assert sum(1 for kind, _ in log if kind == "fetch") == 2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert float((p.grad - q.grad).abs().max() / q.grad.abs().max()) < 1e-5, name
