"""The trainers' one data-parallel seam: under sequence parallelism an SP group of processes is one data-parallel
rank of TRL / Accelerate, so their collectives run over the mesh's DP group, never over the world.

* :class:`DPCollectives`: the DP group's collectives as Accelerate's are called (``gather``,
  ``gather_for_metrics`` with the last batch's cut, ``gather_object``, ``reduce``, ``pad_across_processes``), from
  the mesh (:class:`~hf_fpdt.distributed.groups.ParallelGroups`, built once by the plugin). One DP rank: no
  collective (as Accelerate's with one process).
* :class:`FPDTAccelerator`: the accelerator every FPDT trainer holds, installed once when the trainer creates its
  accelerator: ``prepare`` of a data loader is the plugin's DP sharding (so the library's own loaders are FPDT's),
  everything else is the accelerator's.
* :class:`DPAccelerator`: the one a whole-batch trainer (DPO, KTO, GRPO, RLOO) holds under SP, for its whole life: it
  also answers the collectives above over the DP group, ``process_index`` / ``num_processes`` as the DP rank and
  size, and forwards everything else (``backward``, ``prepare`` of models, ``autocast``,
  barriers, ...) to the accelerator. TRL's own calls of Accelerate's module-level ``gather`` / ``gather_object``
  (GRPO's and RLOO's rewards and completion logs) are redirected to the same collectives for the time the trainer
  runs its loop (:func:`hf_fpdt.trainers.compat_trl.module_collectives`, the one place).

What stays world-wide is world-wide by design: HF Trainer's own bookkeeping (the logged loss's mean of equal copies,
``total_flos`` of each rank's share), DDP's gradient average, TRL's reference-precompute cache (one file for every
rank, written by world rank 0 behind a world barrier). ``tests/integration/test_collective_groups.py`` runs a GRPO
and a DPO step with every ``torch.distributed`` collective recorded and fails on any that runs over another group.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from torch.utils.data import DataLoader

from ..distributed.groups import ParallelGroups
from ..distributed.peers import gather_rows, guarded


def _as_row(data: Any) -> Any:
    """A rank's scalar is one row, as Accelerate gathers it."""
    return recursively_apply(lambda t: t.reshape(1) if t.dim() == 0 else t, data)


class DPCollectives:
    """The collectives TRL and Accelerate run, over the mesh's DP group (one copy per SP group, DP rank order).

    Args:
        groups: the mesh (``None``: one process); every SP rank of a group holds the same values.
        gradient_state: Accelerate's ``GradientState`` (the last batch's ``remainder`` for ``gather_for_metrics``).
    """

    def __init__(self, groups: ParallelGroups | None, gradient_state: Any) -> None:
        self.group = groups.dp if groups is not None and groups.dp_size > 1 else None
        self.size = 1 if groups is None else groups.dp_size
        self.rank = 0 if groups is None else groups.dp_rank
        self.gradient_state = gradient_state

    def gather(self, tensor: Any) -> Any:
        """``accelerate.utils.gather`` over DP: the DP ranks' rows concatenated (a scalar is one row)."""
        if self.group is None:
            return _as_row(tensor)
        return recursively_apply(partial(gather_rows, self.group, what="all_gather over the DP group"), tensor)

    def gather_object(self, obj: Any) -> list:
        """``accelerate.utils.gather_object`` over DP: the DP ranks' lists (or objects) concatenated."""
        pieces: list = [obj]
        if self.group is not None:
            pieces = [None] * self.size
            with guarded(self.group, "all_gather_object over the DP group"):
                dist.all_gather_object(pieces, obj, group=self.group)
        return [x for piece in pieces for x in (piece if isinstance(piece, list | tuple) else [piece])]

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``Accelerator.gather_for_metrics`` over DP: the last batch cut to the samples it really holds (the loader's
        remainder over the DP world); objects that are no tensors are gathered as objects."""
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        data = self.gather_object(input_data) if use_gather_object else self.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            cut = state.remainder
            data = data[:cut] if use_gather_object else recursively_apply(lambda t: t[:cut], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``Accelerator.reduce`` over DP (a copy; ``"mean"`` divides by the DP size)."""

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            if self.group is not None:
                with guarded(self.group, "all_reduce over the DP group"):
                    dist.all_reduce(t, group=self.group)
            if reduction == "mean":
                t = t / self.size
            return t * scale if scale != 1.0 else t

        return recursively_apply(one, tensor)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """``Accelerator.pad_across_processes`` over DP: ``dim`` padded to the longest of the DP ranks."""
        if self.group is None:
            return tensor

        def one(t: torch.Tensor) -> torch.Tensor:
            size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
            longest = int(gather_rows(self.group, size, "all_gather of the lengths over the DP group").max())
            if longest == t.shape[dim]:
                return t
            shape = list(t.shape)
            shape[dim] = longest
            out = t.new_full(shape, pad_index)
            at = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
            out[(slice(None),) * (dim % t.dim()) + (at,)] = t
            return out

        return recursively_apply(one, tensor)


class FPDTAccelerator:
    """The trainer's ``Accelerator`` as an FPDT trainer holds it, for its whole life: ``prepare`` hands data loaders
    to ``prepare_loader`` (the plugin's DP sharding, :func:`hf_fpdt.trainers.loaders.prepare_loader`) and anything
    else to the accelerator, so the library's own ``get_*_dataloader`` build FPDT's loaders; every other name, read or
    written, is the accelerator's (its collectives over the world: a sharded trainer's per-rank shares add up there).

    Args:
        accelerator: the trainer's ``Accelerator``.
        prepare_loader: ``DataLoader -> DataLoader`` sharded over DP (each rank's shard, or whole batches).
    """

    _OWN: frozenset[str] = frozenset({"_accelerator", "_prepare_loader"})

    def __init__(self, accelerator: Any, prepare_loader: Callable[[DataLoader], DataLoader]) -> None:
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_prepare_loader", prepare_loader)

    @property
    def accelerator(self) -> Any:
        """The accelerator itself (its collectives over the world)."""
        return self._accelerator

    @property
    def over_dp(self) -> bool:
        """Whether the collectives run over the DP group (:class:`DPAccelerator`)."""
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            raise AttributeError(f"{type(self).__name__}.{name} is FPDT's; set it on the accelerator itself")
        setattr(self._accelerator, name, value)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """Data loaders sharded over DP by ``prepare_loader``, the rest through the accelerator's ``prepare``."""
        loaders = [i for i, a in enumerate(args) if isinstance(a, DataLoader)]
        out = list(args)
        rest = [i for i in range(len(args)) if i not in loaders]
        if rest:
            prepared = self._accelerator.prepare(*(args[i] for i in rest), **kwargs)
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                out[i] = obj
        for i in loaders:
            out[i] = self._prepare_loader(args[i])
        return out[0] if len(out) == 1 else tuple(out)


class DPAccelerator(FPDTAccelerator):
    """The trainer's ``Accelerator`` as one SP group sees it, held by a whole-batch trainer under SP for its whole
    life: :class:`FPDTAccelerator` whose ``gather``, ``gather_for_metrics``, ``gather_object``, ``reduce`` and
    ``pad_across_processes`` run over the DP group (:class:`DPCollectives`), ``process_index`` the DP rank and
    ``num_processes`` the DP size.

    Args:
        accelerator: the trainer's ``Accelerator``.
        groups: the mesh (the plugin's :class:`~hf_fpdt.distributed.groups.ParallelGroups`).
        prepare_loader: ``DataLoader -> DataLoader`` sharded over DP with whole batches.
    """

    _OWN = FPDTAccelerator._OWN | {"_dp", "process_index", "num_processes"}

    def __init__(self, accelerator: Any, groups: ParallelGroups, prepare_loader: Callable[[DataLoader], DataLoader]):
        super().__init__(accelerator, prepare_loader)
        object.__setattr__(self, "_dp", DPCollectives(groups, accelerator.gradient_state))
        object.__setattr__(self, "process_index", groups.dp_rank)
        object.__setattr__(self, "num_processes", groups.dp_size)

    @property
    def over_dp(self) -> bool:
        return True

    @property
    def dp(self) -> DPCollectives:
        """The DP group's collectives."""
        return self._dp

    def gather(self, tensor: Any) -> Any:
        return self._dp.gather(tensor)

    def gather_object(self, obj: Any) -> list:
        return self._dp.gather_object(obj)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self._dp.gather_for_metrics(input_data, use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return self._dp.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return self._dp.pad_across_processes(tensor, dim, pad_index, pad_first)
