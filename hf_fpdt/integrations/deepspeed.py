"""DeepSpeed ZeRO-3: how FPDT's tiled pieces hand the gradients of partitioned parameters back.

ZeRO-3 keeps every parameter partitioned (``p.data`` of shape ``[0]``, the full shape in ``p.ds_shape``)
except while a module that owns it runs: its forward pre-hook gathers the parameter, its post-hook
releases it, and in backward the same happens around the module's backward. An autograd Function that
took such a parameter as an input would record the partitioned shape and refuse its gradient
(``returned an invalid gradient ... expected shape compatible with [0]``). So under ZeRO-3 the tiled
pieces (:mod:`hf_fpdt.memory.tiling`, :mod:`hf_fpdt.attention.projection`) get their parameters as
:class:`~hf_fpdt.memory.replay.DeliveredParams`:

* forward and the per-piece backward call the modules, whose hooks gather the parameters; the pieces'
  gradients are summed in float32 as for any parameter;
* at the end of the Function's backward, :func:`deliver_gathered` gathers the parameters once more
  (``deepspeed.zero.GatheredParameters``: their shape is whole again) and accumulates the sums through
  autograd (``torch.autograd.backward(params, sums)``). ZeRO-3's gradient hooks fire there, once per
  parameter and call, as after an ordinary module's backward; a parameter with no gradient on this rank
  gets zeros, so every rank reduces the same parameters in the same order.

Because each of those module calls is a collective gather, every rank of ZeRO-3's partition group (data-
parallel ranks too, not only one SP group) must make the same calls: the same number of tiles, so the same
local sequence length, batch size and chunk size. ``hf_fpdt.apply`` checks that once per forward, only when
ZeRO-3 manages the model (:func:`partition_group`, :data:`ZERO3_ADVICE`): a mismatch is a ``ValueError`` on
every rank instead of gloo's abort or NCCL's hang.

DeepSpeed is imported only when a gradient is delivered (this module is imported with the patches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..memory.replay import DeliveredParams, trainable


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is managed by ZeRO-3 (it carries DeepSpeed's partition id)."""
    return hasattr(param, "ds_id")


ZERO3_ADVICE = (
    "Under DeepSpeed ZeRO-3 every tiled piece gathers its parameters collectively, so every rank must run the "
    "same number of tiles: give every rank the same batch size and pad every batch to one length (a fixed "
    "sequence length, or the collator's pad_to_multiple_of with the longest length of the run; drop an uneven "
    "last batch with dataloader_drop_last=True), and build the same FPDTConfig on every rank"
)


def partition_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group ZeRO-3 partitions ``model``'s parameters over, or None when ZeRO-3 does not manage it."""
    for p in model.parameters():
        if is_partitioned(p):
            return getattr(p, "ds_process_group", None)
    return None


def zero3_params(modules: Sequence[nn.Module]) -> Sequence[torch.Tensor] | DeliveredParams:
    """The trainable parameters of ``modules`` as a tiled piece should take them: delivered when ZeRO-3
    manages the modules (frozen parameters count: the piece must not read them outside their modules
    either, e.g. a frozen LM head's weight), else as a plain list."""
    params = trainable(modules)
    if any(is_partitioned(p) for m in modules for p in m.parameters()):
        return DeliveredParams(tuple(params), deliver_gathered)
    return params


def deliver_gathered(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Accumulate ``grads`` (full-shaped; None: zeros) into ZeRO-3 parameters through autograd."""
    import deepspeed

    params = list(params)
    full = [
        torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device=p.device) if g is None else g
        for p, g in zip(params, grads)
    ]
    with deepspeed.zero.GatheredParameters(params):  # whole again: autograd checks a root's shape
        torch.autograd.backward(params, full)
