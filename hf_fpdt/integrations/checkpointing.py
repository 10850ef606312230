"""Tell the FPDT runtime when non-reentrant activation checkpointing recomputes a layer.

HF 5.x checkpoints each ``GradientCheckpointingLayer`` with ``layer._gradient_checkpointing_func``, a
``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, ...)``. Its public
``context_fn`` hook returns two context managers: one around the first forward, one around the
recomputation in backward. :func:`mark_recompute` wraps the layer's call (on the instance, like
:mod:`hf_fpdt.checkpoint_offload`) so that, for the duration of the call, the checkpoint function gets
:meth:`FPDTRuntime.checkpoint_scopes` as its ``context_fn``: the first forward logs what its attention
stored, and the recomputation rebuilds the attention output from those chunks instead of computing
attention (and storing its chunks) a second time. Reentrant checkpointing (whose recomputed graph *is*
differentiated), custom checkpoint functions and an existing ``context_fn`` are left alone.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

from torch import nn

from ..runtime import FPDTRuntime


def _with_checkpoint_scopes(func: Callable, runtime: FPDTRuntime) -> Callable | None:
    """``func`` with the recompute marker added, or None where it must not be touched."""
    if not isinstance(func, functools.partial):
        return None
    if func.keywords.get("use_reentrant", True) is not False or "context_fn" in func.keywords:
        return None
    return functools.partial(func, context_fn=runtime.checkpoint_scopes)


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
