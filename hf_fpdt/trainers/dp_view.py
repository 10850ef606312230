"""The trainer's ``Accelerator`` as one SP group sees it (:class:`DPView`): under sequence parallelism an SP group
of processes plays the part of one data-parallel process of TRL, so the collectives TRL's whole-batch trainers run
(rollout, scoring, loss, metrics) go over the DP group, not the world."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply

from ..distributed.peers import gather_rows, guarded
from .accelerate_plugin import FPDTPlugin
from .compat_accelerate import DP_VIEW_FORWARDS


class DPView:
    """The trainer's ``Accelerator`` as one SP group sees it: TRL's collectives over the DP group.

    ``gather``, ``gather_for_metrics``, ``reduce`` and ``pad_across_processes`` run over the DP group (a no-op
    with one DP rank, as Accelerate's are with one process); ``process_index`` is the DP rank and
    ``num_processes`` the DP size. It forwards to the accelerator only what TRL is known to read besides
    (:data:`~hf_fpdt.trainers.compat_accelerate.DP_VIEW_FORWARDS`): any other name is an ``AttributeError``
    naming it, so a collective a new TRL calls is never run over the world unseen.
    """

    def __init__(self, accelerator: Any, plugin: FPDTPlugin) -> None:
        self._accelerator = accelerator
        self._group = plugin.dp_group
        self.process_index = plugin.dp_rank
        self.num_processes = plugin.dp_size

    def __getattr__(self, name: str) -> Any:
        if name in DP_VIEW_FORWARDS:
            return getattr(self._accelerator, name)
        raise AttributeError(
            f"Accelerator.{name} under sequence parallelism: hf_fpdt's DP view of the accelerator (TRL's rollout, "
            f"scoring and loss run through it) does not know {name!r}, which may be a collective that must run "
            "over the DP group rather than the world; add it to hf_fpdt.trainers.compat_accelerate (DP_VIEW_FORWARDS "
            "if it is not a collective), or train at sp_size 1"
        )

    def gather(self, tensor: Any) -> Any:
        if self._group is None:
            return tensor
        return recursively_apply(partial(gather_rows, self._group, what="all_gather over DP (TRL's gather)"), tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self.gather(input_data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            if self._group is not None:
                with guarded(self._group, "all_reduce over the DP group (TRL's reduce)"):
                    dist.all_reduce(t, group=self._group)
            if reduction == "mean":
                t = t / self.num_processes
            return t * scale if scale != 1.0 else t

        return recursively_apply(one, tensor)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        if self._group is None:
            return tensor

        def one(t: torch.Tensor) -> torch.Tensor:
            size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
            sizes = [torch.empty_like(size) for _ in range(self.num_processes)]
            with guarded(self._group, "all_gather of the lengths over the DP group (TRL's pad_across_processes)"):
                dist.all_gather(sizes, size, group=self._group)
            longest = max(int(s.item()) for s in sizes)
            if longest == t.shape[dim]:
                return t
            shape = list(t.shape)
            shape[dim] = longest
            out = t.new_full(shape, pad_index)
            at = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
            out[(slice(None),) * (dim % t.dim()) + (at,)] = t
            return out

        return recursively_apply(one, tensor)
