"""Per-layer wrappers, the HF glue of :mod:`hf_fpdt.memory.checkpointing`: wrap each decoder layer's call.

Three wrappers (:class:`~hf_fpdt.integrations.state.InstalledForward`), installed on layer *instances*, in
this order: :func:`offload_layer_inputs` runs the call under the
:class:`~hf_fpdt.memory.checkpointing.LayerInputOffloader`'s hooks, so the checkpoint's saved layer input goes
to the host store; :func:`mark_recompute` tells the runtime when the checkpoint recomputes the layer;
:func:`segment_layers` (outermost) checkpoints k layers as one.

HF 5.x checkpoints each ``GradientCheckpointingLayer`` with ``layer._gradient_checkpointing_func``, a
``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, ...)``. Its public
``context_fn`` hook returns two context managers: one around the first forward, one around the
recomputation in backward. :func:`mark_recompute` wraps the layer's call so that, for the duration of
the call, the checkpoint function gets ``runtime.checkpointing.scopes``
(:class:`hf_fpdt.memory.checkpointing.CheckpointState`) as its ``context_fn``: the first forward logs what its
attention stored, and the recomputation rebuilds the attention output from those chunks instead of
computing attention (and storing its chunks) a second time; for a layer over the host budget it
computes attention again and hands the chunks to the first forward's backward. Reentrant
checkpointing (whose recomputed graph *is* differentiated), custom checkpoint functions and an
existing ``context_fn`` are left alone.

Under ``torch.compile`` the wrappers run eagerly (``torch.compiler.disable``: the checkpoint's ``context_fn``
and the offload hooks are not traceable) except in a call that records no gradients, where they have
nothing to do and the layer's own forward is traced (:mod:`hf_fpdt.integrations.compiled`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from ..attention.runtime import FPDTRuntime
from ..memory.checkpointing import LayerInputOffloader
from .cache_names import CACHE_NAMES
from .compiled import traced_without_grad
from .state import find_forward, install_forward, installed_forwards, remove_forward

_log = logging.getLogger("hf_fpdt")

OFFLOAD, RECOMPUTE, SEGMENT = "offload_inputs", "recompute_marker", "checkpoint_segment"  # the wrappers' kinds


def _saves_on_host(func: Callable | None) -> bool:
    """Whether a layer's checkpoint function moves what it saves to the host itself (HF 5.24's
    ``activation_checkpointing_enable(offload=True)``: ``torch.autograd.graph.save_on_cpu`` around the
    checkpoint), found from the function's code rather than a transformers version."""
    inner = func.func if isinstance(func, functools.partial) else func
    return "save_on_cpu" in getattr(getattr(inner, "__code__", None), "co_names", ())


def check_checkpointing(layers: list[nn.Module]) -> None:
    """Refuse the checkpointing settings hf_fpdt does not plan for (``ValueError``, before a training forward):

    * HF's ``offload=True`` (``activation_checkpointing_enable(offload=True)``, or ``offload`` in
      ``TrainingArguments.activation_checkpointing_kwargs``): its ``save_on_cpu`` would copy every checkpointed
      layer's saved input to pinned host memory a second time, outside ``FPDTConfig.host_memory``'s budget,
      while hf_fpdt already offloads those inputs into its host store (``offload_layer_inputs``);
    * HF's ``every_n_layers > 1`` (some decoder layers checkpoint, others not): the planner, the replay budget
      and the checkpoint segments plan for every layer checkpointed or none.
    """
    flags = [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers]
    if any(flags) and any(_saves_on_host(getattr(layer, "_gradient_checkpointing_func", None)) for layer in layers):
        raise ValueError(
            "activation checkpointing with offload=True (HF's save_on_cpu) under hf_fpdt: hf_fpdt already keeps "
            "each checkpointed layer's input in its host store, within FPDTConfig(host_memory=...); HF's offload "
            "would copy it to pinned host memory again, outside that budget. Enable checkpointing without offload "
            "(model.activation_checkpointing_enable() / activation_checkpointing=True) and keep "
            "FPDTConfig(offload_layer_inputs=True), the default"
        )
    if any(flags) and not all(flags):
        raise ValueError(
            f"activation checkpointing of {sum(flags)} of {len(flags)} decoder layers (HF's every_n_layers > 1) "
            "under hf_fpdt: its memory planner, replay budget and checkpoint segments plan for every layer "
            "checkpointed or none. Checkpoint every layer (every_n_layers=1; hf_fpdt's replay spares the "
            "recompute the attention, so it costs the MLP and projections only), or train without checkpointing"
        )


def checkpointing_pre_hook(layers: list[nn.Module], module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the model ``apply`` changed: :func:`check_checkpointing` before a training forward."""
    if module.training and torch.is_grad_enabled() and not traced_without_grad():
        check_checkpointing(layers)


def _with_checkpoint_scopes(func: Callable, runtime: FPDTRuntime) -> Callable | None:
    """``func`` with the recompute marker added, or None where it must not be touched."""
    if not isinstance(func, functools.partial):
        return None
    if func.keywords.get("use_reentrant", True) is not False or "context_fn" in func.keywords:
        return None
    return functools.partial(func, context_fn=runtime.checkpointing.scopes)


def _marked_call(runtime: FPDTRuntime, forward: Callable, layer: nn.Module, *args, **kwargs):
    if traced_without_grad():
        return forward(*args, **kwargs)
    return _marked_call_eager(forward, layer, runtime, args, kwargs)


@torch.compiler.disable  # see the module docstring: torch.compile
def _marked_call_eager(forward: Callable, layer: nn.Module, runtime: FPDTRuntime, args: tuple, kwargs: dict):
    func = getattr(layer, "_gradient_checkpointing_func", None)
    marked = _with_checkpoint_scopes(func, runtime) if func is not None else None
    if marked is None or not (layer.gradient_checkpointing and layer.training):
        return forward(*args, **kwargs)
    layer._gradient_checkpointing_func = marked  # only for this call: HF's own setting is put back below
    try:
        return forward(*args, **kwargs)
    finally:
        layer._gradient_checkpointing_func = func


def mark_recompute(layer: nn.Module, runtime: FPDTRuntime) -> None:
    """Wrap ``layer.forward`` (an HF ``GradientCheckpointingLayer``) so recomputation is marked. Idempotent;
    marking again with another runtime replaces the marker (while it is the outermost wrapper)."""
    marker = find_forward(layer, RECOMPUTE)
    if marker is not None and marker.args[0] is runtime:
        return
    if marker is not None and installed_forwards(layer)[0] is not marker:
        raise ValueError(f"{type(layer).__name__}: its recompute marker is under another hf_fpdt wrapper")
    remove_forward(layer, RECOMPUTE)
    install_forward(layer, RECOMPUTE, _marked_call, runtime)


def _offloaded_call(offloader: LayerInputOffloader, forward: Callable, layer: nn.Module, *args, **kwargs):
    if traced_without_grad():
        return forward(*args, **kwargs)
    return _offloaded_call_eager(forward, layer, offloader, args, kwargs)


@torch.compiler.disable  # see the module docstring: torch.compile
def _offloaded_call_eager(
    forward: Callable, layer: nn.Module, offloader: LayerInputOffloader, args: tuple, kwargs: dict
):
    if getattr(layer, "gradient_checkpointing", False) and layer.training:
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
    if layer_offloader(layer) is None:
        install_forward(layer, OFFLOAD, _offloaded_call, offloader)


def layer_offloader(layer: nn.Module) -> LayerInputOffloader | None:
    """The offloader :func:`offload_layer_inputs` installed on ``layer``, or None."""
    wrapper = find_forward(layer, OFFLOAD)
    return wrapper.args[0] if wrapper is not None else None


class CheckpointSegment:
    """k consecutive decoder layers checkpointed as one (``FPDTConfig.checkpoint_segments``).

    The first layer's call runs the whole segment under one non-reentrant checkpoint (HF's
    ``_gradient_checkpointing_func`` with ``context_fn=runtime.checkpointing.scopes(replay=False)``), with
    the layers' own per-layer checkpointing switched off for the duration of that call (and of its
    recomputation); the decoder loop's calls of the other layers then pass the segment's output through.
    Inside a segment no attention replay chunks are kept (``host_memory=0`` semantics): the recomputation
    computes attention again, so the record/replay log pairs one entry per attention call of the segment.
    """

    def __init__(self, layers: list[nn.Module], runtime: FPDTRuntime) -> None:
        self.layers = list(layers)  # held strongly, so a deep copy of the model gets a segment of its own layers
        self.runtime = runtime
        self.passing = 0  # calls of the segment's other layers still to pass the output through
        self.output: object = None

    def __len__(self) -> int:
        return len(self.layers)

    def call(self, forward: Callable, index: int, *args, **kwargs):
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if index > 0:
            out, passing = self.output, self.passing
            if passing and hidden is not None and hidden is (out[0] if isinstance(out, tuple) else out):
                self.passing -= 1
                if not self.passing:
                    self.output = None
                return out
            return forward(*args, **kwargs)
        layers = self.layers
        first = layers[0]
        active = (
            hidden is not None
            and torch.is_grad_enabled()
            and all(m.training and getattr(m, "gradient_checkpointing", False) for m in layers)
        )
        func = getattr(first, "_gradient_checkpointing_func", None) if active else None
        if not isinstance(func, functools.partial) or func.keywords.get("use_reentrant", True) is not False:
            return forward(*args, **kwargs)  # not checkpointing, or reentrant/custom: per-layer as HF does
        if "context_fn" in func.keywords:
            return forward(*args, **kwargs)
        for name in CACHE_NAMES:  # as HF's checkpointing layer does
            if kwargs.get(name) is not None and not first._can_checkpoint_with_cache:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        rest = args[1:]

        def run(x: torch.Tensor):
            modes = [m.gradient_checkpointing for m in layers]
            for m in layers:
                m.gradient_checkpointing = False  # only for the segment: the outer checkpoint covers the layers
            try:
                out = None
                for m in layers:
                    out = m(x, *rest, **kwargs)
                    x = out[0] if isinstance(out, tuple) else out
                return out
            finally:
                for m, mode in zip(layers, modes, strict=True):
                    m.gradient_checkpointing = mode

        scopes = functools.partial(self.runtime.checkpointing.scopes, replay=False)
        offloader = layer_offloader(first)
        with offloader.hooks() if offloader is not None else contextlib.nullcontext():
            out = functools.partial(func, context_fn=scopes)(run, hidden)
        self.passing, self.output = len(layers) - 1, out
        return out


def _segment_call(segment: CheckpointSegment, index: int, forward: Callable, layer: nn.Module, *args, **kwargs):
    if traced_without_grad():
        return forward(*args, **kwargs)
    return _segment_call_eager(segment, index, forward, args, kwargs)


@torch.compiler.disable  # see the module docstring: torch.compile
def _segment_call_eager(segment: CheckpointSegment, index: int, forward: Callable, args: tuple, kwargs: dict):
    return segment.call(forward, index, *args, **kwargs)


def _decoder_stacks(model: nn.Module) -> list[list[nn.Module]]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    stacks = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and all(isinstance(c, GradientCheckpointingLayer) for c in m):
            stacks.append(list(m))
    return stacks


def segment_layers(model: nn.Module, runtime: FPDTRuntime, k: int) -> int:
    """Group each decoder stack's layers into checkpoint segments of ``k`` (the last one may be shorter).

    A segment does not span layers of different ``attention_type`` (their masks differ). Installed on
    the layer instances, outermost; ``k=1`` removes the grouping. Returns the number of segments.
    """
    count = 0
    for stack in _decoder_stacks(model):
        groups: list[list[nn.Module]] = []
        for layer in stack:
            remove_forward(layer, SEGMENT)  # regrouped: drop the old grouping
            last = groups[-1] if groups else None
            same = last is not None and getattr(last[0], "attention_type", None) == getattr(
                layer, "attention_type", None
            )
            if last is not None and same and len(last) < k:
                last.append(layer)
            else:
                groups.append([layer])
        for group in groups:
            if k < 2:
                continue  # per-layer checkpointing, as HF does (a shorter last segment is still a segment: no replay)
            segment = CheckpointSegment(group, runtime)
            count += 1
            for index, layer in enumerate(group):
                install_forward(layer, SEGMENT, _segment_call, segment, index)
    return count
