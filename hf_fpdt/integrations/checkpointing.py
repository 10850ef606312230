"""HF glue of :mod:`hf_fpdt.checkpointing`: wrap each ``GradientCheckpointingLayer``'s call.

Two wrappers, installed on layer *instances*: :func:`offload_layer_inputs` runs the call under the
:class:`~hf_fpdt.checkpointing.LayerInputOffloader`'s hooks, so the checkpoint's saved layer input goes
to the host store; :func:`mark_recompute` tells the runtime when the checkpoint recomputes the layer.

HF 5.x checkpoints each ``GradientCheckpointingLayer`` with ``layer._gradient_checkpointing_func``, a
``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, ...)``. Its public
``context_fn`` hook returns two context managers: one around the first forward, one around the
recomputation in backward. :func:`mark_recompute` wraps the layer's call so that, for the duration of
the call, the checkpoint function gets ``runtime.checkpointing.scopes``
(:class:`hf_fpdt.checkpointing.CheckpointState`) as its ``context_fn``: the first forward logs what its
attention stored, and the recomputation rebuilds the attention output from those chunks instead of
computing attention (and storing its chunks) a second time; for a layer over the host budget it
computes attention again and hands the chunks to the first forward's backward. Reentrant
checkpointing (whose recomputed graph *is* differentiated), custom checkpoint functions and an
existing ``context_fn`` are left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..checkpointing import LayerInputOffloader
from ..runtime import FPDTRuntime

_log = logging.getLogger("hf_fpdt")


def _with_checkpoint_scopes(func: Callable, runtime: FPDTRuntime) -> Callable | None:
    """``func`` with the recompute marker added, or None where it must not be touched."""
    if not isinstance(func, functools.partial):
        return None
    if func.keywords.get("use_reentrant", True) is not False or "context_fn" in func.keywords:
        return None
    return functools.partial(func, context_fn=runtime.checkpointing.scopes)


def _marked_call(forward: Callable, layer_ref: weakref.ref, runtime: FPDTRuntime, *args, **kwargs):
    layer = layer_ref()
    func = getattr(layer, "_gradient_checkpointing_func", None) if layer is not None else None
    marked = _with_checkpoint_scopes(func, runtime) if func is not None else None
    if marked is None or not (layer.gradient_checkpointing and layer.training):
        return forward(*args, **kwargs)
    layer._gradient_checkpointing_func = marked  # only for this call: HF's own setting is put back below
    try:
        return forward(*args, **kwargs)
    finally:
        layer._gradient_checkpointing_func = func


def mark_recompute(layer: nn.Module, runtime: FPDTRuntime) -> None:
    """Wrap ``layer.forward`` (an HF ``GradientCheckpointingLayer``) so recomputation is marked. Idempotent."""
    if getattr(layer, "_fpdt_recompute_runtime", None) is runtime:
        return
    forward = getattr(layer, "_fpdt_unmarked_forward", None) or layer.forward
    layer._fpdt_unmarked_forward = forward
    layer.forward = functools.partial(_marked_call, forward, weakref.ref(layer), runtime)
    layer._fpdt_recompute_runtime = runtime


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


def _step_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def plan_step(runtime: FPDTRuntime, layers: list, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the model (installed by ``hf_fpdt.apply``): the step's plan, before the forward.

    For each new (batch, local length) of a training forward: the host budget (resolved once), the
    :func:`hf_fpdt.planner.plan` of the step from the model's shapes and trainable parameters, the
    replay budget the attention layers follow (``runtime.checkpointing.replay_budget``), and a
    ``ValueError`` naming the numbers and the ways out when the plan does not fit. Every rank computes
    the same plan from the same shapes and the agreed budget, so every rank raises.
    """
    from ..planner import ModelShape, plan

    x = _step_tokens(args, kwargs)
    ckpt = runtime.checkpointing
    if x is None or not (model.training and torch.is_grad_enabled()):
        return
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in layers)
    key = (tuple(x.shape[:2]), checkpointing)
    if ckpt.planned == key:
        return
    budget = runtime.host_budget(x.device)
    if budget is None:
        ckpt.replay_budget, ckpt.planned = None, key
        return
    params = list(model.parameters())
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    try:
        shape = ModelShape.from_config(model.config)
    except (AttributeError, TypeError):  # a config without the usual names: no plan, the budget bounds the replay
        _log.warning("hf_fpdt: no plan for %s (config lacks standard shape names)", type(model).__name__)
        ckpt.replay_budget, ckpt.planned = budget, key
        return
    shape = dataclasses.replace(shape, params=sum(p.numel() for p in params))  # the model's real count
    cs = runtime.config.chunk_size
    settings = dict(
        batch=x.shape[0],
        sp_size=runtime.sp_size,
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        dtype=dtype,
        device=x.device.type,
        host_memory=budget,
        chunk_size=cs if isinstance(cs, int) else 65536,
        checkpointing=checkpointing,
        offload=runtime.config.offload is not False,
        offload_layer_inputs=runtime.config.offload_layer_inputs,
        optimizer=False,
    )
    p = plan(shape, x.shape[1] * runtime.sp_size, search_longest=False, **settings)
    if not p.fits:  # again, with the longest sequence that would fit, for the message
        raise ValueError(plan(shape, x.shape[1] * runtime.sp_size, **settings).error())
    ckpt.replay_budget, ckpt.planned = p.replay_budget, key
    _log.info(
        "hf_fpdt plan: %d/%d layers keep their attention replay chunks (%.1f MiB each), the rest recompute "
        "attention in backward; host kept across layers %.1f MiB of %.1f MiB",
        p.replay_layers, p.layers, p.replay_per_layer / 2**20, p.host_kept / 2**20, budget / 2**20,
    )  # fmt: skip
