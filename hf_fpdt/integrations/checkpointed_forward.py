"""Where HF checkpoints a decoder layer: around ``forward`` (transformers 5.23 on) or around ``__call__`` (up to 5.22).

hf_fpdt's per-layer wrappers (:mod:`.layer_wrappers`: layer-input offload, recompute marker, checkpoint segments)
are installed as the layer instance's ``forward`` and must run *outside* HF's checkpoint: they set the
checkpoint's ``context_fn`` and open the offload hooks before the checkpoint saves its inputs.

* transformers 5.23 on: ``GradientCheckpointingLayer.__init_subclass__`` wraps each layer class's ``forward``
  in the checkpoint; an instance's own ``forward`` (hf_fpdt's wrappers) calls that class forward, so the
  wrappers sit outside the checkpoint. Nothing to do here.
* transformers up to 5.22: ``GradientCheckpointingLayer.__call__`` runs ``nn.Module.__call__`` (and with it the
  instance's ``forward``) inside the checkpoint, so the wrappers would run inside it, too late.
  :func:`checkpoint_forwards` gives such a layer instance a subclass of its class that checkpoints ``forward``
  as 5.23 does (the same condition and the same cache arguments dropped as the installed HF's ``__call__``),
  with ``nn.Module.__call__``; the class keeps its name, module and every attribute, and
  :meth:`ForwardCheckpointing.remove` (``hf_fpdt.unapply``) gives the instance its class back.

Which of the two the installed transformers does is read from the code (:data:`HF_CHECKPOINTS_CALL`: whether
``GradientCheckpointingLayer`` defines ``__call__``), never from a version number.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

# transformers up to 5.22 checkpoints a layer's __call__ (5.23 on: its class's forward, and defines no __call__)
HF_CHECKPOINTS_CALL = "__call__" in vars(GradientCheckpointingLayer)

# the keywords HF's __call__ set to None under checkpointing (different names of a layer's KV cache)
_CACHE_KEYWORDS = ("past_key_value", "past_key_values", "layer_past")


def _checkpointed_forward(base: type[nn.Module]):
    """``base.forward`` checkpointed as the installed HF's ``GradientCheckpointingLayer.__call__`` checkpoints the
    call: with the layer checkpointing and training, the cache keywords off (``use_cache=False``, the cache
    ``None`` unless the layer may keep it), then ``layer._gradient_checkpointing_func(forward, *args)``."""

    def forward(self: nn.Module, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if not getattr(self, "_can_checkpoint_with_cache", False):
                for name in _CACHE_KEYWORDS:
                    if kwargs.get(name) is not None:
                        kwargs[name] = None
            return self._gradient_checkpointing_func(partial(base.forward, self, **kwargs), *args)
        return base.forward(self, *args, **kwargs)

    forward.__wrapped__ = base.forward  # inspect.signature: the layer's own parameters
    return forward


def _forward_checkpointing_class(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``base`` (an HF layer class whose checkpoint wraps ``__call__``) that checkpoints ``forward``
    instead; same name, module and qualified name (HF and Accelerate match layer classes by name)."""
    body = {
        "__call__": nn.Module.__call__,  # not GradientCheckpointingLayer's: the checkpoint moves into forward
        "forward": _checkpointed_forward(base),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "fpdt_base_class": base,
    }
    return type(base.__name__, (base,), body)


class ForwardCheckpointing:
    """The class :func:`checkpoint_forwards` gave a layer instance; :meth:`remove` gives it its class back (unless
    someone changed the class since: then theirs stays). Kept with ``apply``'s hook handles."""

    def __init__(self, layer: nn.Module, cls: type[nn.Module]) -> None:
        self.layer, self.cls, self.base = layer, cls, type(layer)
        layer.__class__ = cls

    def remove(self) -> None:
        if type(self.layer) is self.cls:
            self.layer.__class__ = self.base


def checkpoint_forwards(layers: list[nn.Module]) -> list[ForwardCheckpointing]:
    """Where the installed transformers checkpoints a layer's ``__call__``, make each of ``layers`` (HF
    ``GradientCheckpointingLayer`` instances) checkpoint its ``forward`` instead, so hf_fpdt's wrappers installed
    on the instance's ``forward`` afterwards run outside the checkpoint; one subclass per layer class. Returns
    the handles (empty where transformers already checkpoints ``forward``, or a layer already has its class)."""
    if not HF_CHECKPOINTS_CALL:
        return []
    classes: dict[type, type] = {}
    handles = []
    for layer in layers:
        base = type(layer)
        if "fpdt_base_class" in vars(base) or ("__call__" in vars(base) and base.__call__ is not nn.Module.__call__):
            continue  # ours already, or a class with its own __call__: left as it is
        cls = classes.get(base) or classes.setdefault(base, _forward_checkpointing_class(base))
        handles.append(ForwardCheckpointing(layer, cls))
    return handles
