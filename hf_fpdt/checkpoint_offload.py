"""Layer inputs saved by activation checkpointing go to host memory, and come back one layer ahead.

With checkpointing (HF 5.x checkpoints non-reentrantly by default) every decoder layer keeps exactly
one activation for backward: its input ``[B, S, E]``, saved by the checkpoint so it can recompute the
layer. Over L layers that is ``L * B * S * E`` of device memory, the last O(S)-per-layer term once the
attention, MLP and LM head work in chunks. :class:`LayerInputOffloader` intercepts those saves with
``torch.autograd.graph.saved_tensors_hooks``, installed only around a checkpointing layer's call, so the
only tensors it sees are the checkpoint's inputs (the checkpoint's own hooks, nested inside, take every
activation of the layer body).

Backward visits layers last to first. When layer i's input is unpacked (the checkpoint is about to
recompute layer i), the copy of layer i-1's input back to the device starts on a side stream, so it
overlaps layer i's recompute and backward.

On CPU the "host" is where the tensor already lives: the store runs with ``enabled=False``, so pack keeps
the tensor itself and unpack returns it; the same bookkeeping runs, without copies.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .offload import Fetched, HostStore, Slot


class _Saved:
    """One offloaded tensor: its host slot, then (after the first unpack) the device tensor."""

    def __init__(self, store: HostStore, slot: Slot, previous: _Saved | None) -> None:
        self.store, self.slot = store, slot
        # The tensor packed just before this one: the next one backward will ask for.
        self.previous = weakref.ref(previous) if previous is not None else None
        self._fetched: Fetched | None = None
        self._tensor: torch.Tensor | None = None

    def prefetch(self) -> None:
        if self._tensor is None and self._fetched is None and self.slot is not None:
            self._fetched = self.store.fetch(self.slot)

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            self.prefetch()
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.prefetch()  # overlaps this layer's recompute and backward
            self._tensor = self._fetched.wait()
            # The host buffer goes back to the pool now; the device copy stays for a repeated unpack
            # (retain_graph) and is freed with this object when autograd drops the saved tensor.
            self.store.release(self.slot)
            self.slot, self._fetched = None, None
        return self._tensor


class LayerInputOffloader:
    """Pack/unpack hooks that park checkpointed layer inputs in a pooled host store.

    One offloader serves all layers of a model (its pool is reused across layers and steps).
    """

    def __init__(self) -> None:
        self._stores: dict[str, HostStore] = {}
        self._last: weakref.ref | None = None

    def store(self, device: torch.device) -> HostStore:
        key = str(device)
        if key not in self._stores:
            # CPU: the tensor already lives in host memory, a copy would only cost time and memory.
            self._stores[key] = HostStore(device, enabled=device.type != "cpu")
        return self._stores[key]

    def release(self) -> None:
        """Drop the host stores and their pooled buffers (re-created on next use)."""
        self._stores.clear()

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t  # parameters live anyway; empty tensors (checkpoint's dummy) cost nothing
        store = self.store(t.device)
        previous = self._last() if self._last is not None else None
        saved = _Saved(store, store.put(t), previous)
        self._last = weakref.ref(saved)
        return saved

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed.get() if isinstance(packed, _Saved) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run a checkpointing layer's call under."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _offloaded_call(forward: Callable, layer_ref: weakref.ref, offloader: LayerInputOffloader, *args, **kwargs):
    layer = layer_ref()
    if layer is not None and getattr(layer, "gradient_checkpointing", False) and layer.training:
        if torch.is_grad_enabled():
            with offloader.hooks():
                return forward(*args, **kwargs)
    return forward(*args, **kwargs)


def offload_layer_inputs(layer: nn.Module, offloader: LayerInputOffloader) -> None:
    """Wrap ``layer.forward`` (an HF ``GradientCheckpointingLayer``) so its checkpoint inputs are offloaded.

    Only active while the layer checkpoints (``layer.gradient_checkpointing`` and training), so enabling
    or disabling checkpointing after ``apply`` works. The wrapper is installed on the instance and
    calls the forward it found there (HF's checkpointing wrapper, or an accelerate hook around it).
    Idempotent.
    """
    if getattr(layer, "_fpdt_offloader", None) is not None:
        return
    layer.forward = functools.partial(_offloaded_call, layer.forward, weakref.ref(layer), offloader)
    layer._fpdt_offloader = offloader
