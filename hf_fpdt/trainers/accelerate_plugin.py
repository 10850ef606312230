"""``FPDTPlugin``: FPDT for an Accelerate program (custom training loops, and the base of ``FPDTTrainer``).

What the plugin does, in the order a program needs it::

    accelerator = Accelerator()                       # or Accelerator(cpu=True) on a CPU-only machine
    fpdt = FPDTPlugin()                               # sp_size, chunk_size, offload: args or FPDT_* env
    model, optimizer, loader = fpdt.prepare(accelerator, model, optimizer, loader)
    for batch in loader:                              # this rank's shard of its SP group's batch
        n = fpdt.num_items_in_batch(batch)            # valid targets of the whole step, all ranks
        loss = model(**batch, num_items_in_batch=n).loss
        accelerator.backward(loss * fpdt.loss_scale)  # DDP/ZeRO/FSDP average over the world
        optimizer.step(); optimizer.zero_grad()
        print(fpdt.global_loss(loss))                 # the true loss of the step
    fpdt.release()                                    # host buffers go back now, not at exit

* **Groups.** ``setup`` splits the Accelerator's world into SP groups of ``sp_size`` consecutive ranks
  and DP groups across them (:mod:`hf_fpdt.distributed.groups`); ``sp_size`` must divide the world. Rank 0 logs
  where they sit on the nodes, and warns when an SP group spans nodes.
* **Model.** ``apply`` runs :func:`hf_fpdt.apply` with the SP group, and fixes one integer chunk size
  for all ranks (an ``"auto"`` chunk size is measured on every rank and agreed over the world by
  :func:`hf_fpdt.data.chunk_size.resolve_chunk_size`, then handed to the model on a copy of the config).
* **Data.** ``prepare_dataloader`` shards the sampler over the *DP* world (``num_processes=dp``,
  ``process_index=dp_rank``: every rank of an SP group draws the same samples) and collates with
  :class:`hf_fpdt.data.collate.SPCollator`, which keeps this rank's tokens in FPDT's layout with pre-shifted
  labels and global position ids.
* **Loss and gradients.** Each rank's loss is its token-loss sum divided by ``N``, the valid targets
  of the whole step over *all* ranks (every SP rank and DP replica), so the losses of all ranks add
  up to the one-process loss of the global batch. The attention's all-to-alls carry gradients across
  the SP group, so each rank holds partial gradients whose sum is the true one; a wrapper that
  averages over the world then needs ``loss * world_size`` (:attr:`FPDTPlugin.loss_scale`). This is
  HF Trainer's ``average_tokens_across_devices`` rule. :mod:`hf_fpdt.distributed.sp_loss` states the per-SP-group
  variant (``N`` of the group's batch, scale ``sp_size``); both agree when every DP replica has the
  same number of targets, and only the world rule equals one process when they differ.
* **Host memory.** The pools of the models it applied to are dropped by :meth:`FPDTPlugin.release`
  (also on ``with plugin:`` exit, and by ``FPDTTrainer`` at the end of training).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..attention.autotune import Autotuner
from ..config import FPDTConfig
from ..data.chunk_size import chunk_hints, resolve_chunk_size
from ..data.collate import SPCollator
from ..distributed.groups import ParallelGroups, build_groups, group_ranks
from ..distributed.peers import CollectiveWatch
from ..distributed.sp_loss import ddp_loss_scale, global_loss, global_num_items
from ..distributed.timeouts import DEFAULT_TIMEOUT, check_timeout, set_group_timeout
from ..integrations.apply import apply as apply_fpdt
from ..integrations.state import state_of
from .compat_accelerate import is_prepared, mark_prepared
from .logs import show_info


class FPDTPlugin:
    """FPDT settings plus the process groups and host memory of one Accelerate program.

    Args:
        config: a complete :class:`FPDTConfig`; or leave it out and pass its fields (``sp_size=2``,
            ``chunk_size=65536``, ``offload=True``, ...). Unset fields come from ``FPDT_*`` environment
            variables, which ``accelerate launch`` passes on to every process.
        pad_token_id: token id of the padding the layout appends so every SP rank holds as many
            tokens (the padding has label -100 and sits after the real tokens).
        sp_timeout: seconds any collective waits for a missing rank before it fails (positive and finite,
            600 by default; ``0`` is a ``ValueError``, not "no timeout"): the SP and DP groups are created
            with it, and the world group's timeout (Accelerate's or Trainer's ``ddp_timeout``, 30 minutes by
            default) is set to it first, which bounds the set-up (the ranks' arrival, the group creation,
            ``accelerator.prepare``'s parameter broadcast, the ``chunk_size="auto"`` measure), DDP's buffer sync
            and gradient reduction, the token count and Trainer's gathers too (also its barriers around
            checkpoint saves: keep it above the longest save). When one rank raises, dies or stalls, its
            peers stop after this long with an :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming that
            rank, the collective and the timeout (:mod:`hf_fpdt.distributed.agreement`).
    """

    def __init__(
        self,
        config: FPDTConfig | None = None,
        *,
        pad_token_id: int = 0,
        sp_timeout: float = DEFAULT_TIMEOUT,
        **config_fields: Any,
    ) -> None:
        if config is not None and config_fields:
            raise ValueError(f"pass either config or its fields, not both (got config and {sorted(config_fields)})")
        check_timeout(sp_timeout, "sp_timeout")
        self.config = config if config is not None else FPDTConfig(**config_fields)
        self.pad_token_id = pad_token_id
        self.sp_timeout = float(sp_timeout)
        self.groups: ParallelGroups | None = None
        self.world_size: int | None = None
        self.device: torch.device | None = None
        self._world: dist.ProcessGroup | None = None
        self._world_timeout: timedelta | None = None  # the world's own timeout, put back by release()
        self.watch: CollectiveWatch | None = None  # names late/dead peers in world collectives
        self._pools: list = []  # runtimes / offloaders of the models this plugin applied to
        self._chunk_size: int | None = None  # config.chunk_size resolved by apply (self.config is never written)
        self._ring: int | None = None  # config.ring_degree resolved by apply, from the model's heads

    # ---- groups -------------------------------------------------------------------------------

    def setup(self, state: Any) -> FPDTPlugin:
        """Build the SP and DP groups from an ``Accelerator`` or ``PartialState`` (collective; idempotent).

        Raises ``ValueError`` when ``sp_size`` does not divide the number of processes.
        """
        if self.world_size is not None:
            return self
        world = int(state.num_processes)
        group_ranks(world, self.config.sp_size)  # ValueError naming the divisors
        self.device = torch.device(state.device)
        if world > 1:
            if not dist.is_initialized():
                raise ValueError(f"{world} processes but torch.distributed is not initialised; launch with accelerate")
            self._world = dist.group.WORLD
            show_info(main_process=dist.get_rank() == 0)  # build_groups logs the placement on rank 0
            # set-up's, DDP's and Trainer's collectives run on it; release() gives the world its own timeout back
            self._world_timeout = set_group_timeout(self._world, self.sp_timeout)
            self.watch = CollectiveWatch(self._world, self.sp_timeout)
            # Every rank arrives first (a watched collective names one that died or is late), then the groups.
            self.world_sync("FPDTPlugin.setup (every rank's arrival, before creating the SP and DP groups)")
            with self.watch.guard("FPDTPlugin.setup: build_groups (creating the SP and DP groups)"):
                self.groups = build_groups(self.config.sp_size, timeout=self.sp_timeout)
        self.world_size = world
        return self

    def _require_setup(self) -> None:
        if self.world_size is None:
            from accelerate import PartialState

            self.setup(PartialState())

    @property
    def sp_size(self) -> int:
        return self.config.sp_size

    @property
    def dp_size(self) -> int:
        self._require_setup()
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return 0 if self.groups is None else self.groups.sp_rank

    @property
    def dp_rank(self) -> int:
        return 0 if self.groups is None else self.groups.dp_rank

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The SP group (``None`` with one process); pass it wherever a group is asked for."""
        return None if self.groups is None or self.sp_size == 1 else self.groups.sp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.groups is None or self.dp_size == 1 else self.groups.dp

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """The group of every process (``None`` with one process): token counts and logged losses."""
        return self._world

    # ---- model --------------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Run :func:`hf_fpdt.apply` on ``model`` with this plugin's config and SP group (same object back)."""
        self._require_setup()
        show_info(main_process=self._world is None or dist.get_rank() == 0)  # the plan's line, shown once
        config = self.config
        tuner = Autotuner(backend=config.backend)  # one set of measurements for the layout and the attention
        if config.chunk_size == "auto":
            # Every rank measures; the world agrees (the data layout of every SP group uses the same chunks).
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            hints = chunk_hints(model.config, dtype) if hasattr(model, "config") else {"dtype": dtype}
            with self._guard("FPDTPlugin.apply: chunk_size='auto' (all_reduce of the ranks' measured chunk sizes)"):
                chunk = resolve_chunk_size(
                    "auto", self.device, sp_size=self.sp_size, group=self._world, tuner=tuner, **hints
                )
            config = replace(config, chunk_size=chunk)
        apply_fpdt(model, config, self.sp_group, autotuner=tuner)
        state = state_of(model)
        self._chunk_size = state.runtime.global_chunk_size(self.device)
        self._ring = state.runtime.model_ring_degree(model.config) if hasattr(model, "config") else 1
        holders = [state.runtime] + ([state.layer_offloader] if state.layer_offloader is not None else [])
        for holder in holders:
            if all(h() is not holder for h in self._pools):
                self._pools.append(weakref.ref(holder))
        return model

    def resolved_chunk_size(self) -> int:
        """The integer chunk size the layout and the attention share (resolved by :meth:`apply` if ``auto``)."""
        if self._chunk_size is not None:
            return self._chunk_size
        if isinstance(self.config.chunk_size, int):
            return self.config.chunk_size
        raise ValueError(
            f"chunk_size={self.config.chunk_size!r} is resolved when the model is applied: call "
            "plugin.apply(model) (or plugin.prepare with the model) before preparing data loaders"
        )

    def resolved_ring_degree(self) -> int:
        """The SP group's ring degree the layout follows: the applied model's (:meth:`apply`), else an integer
        ``config.ring_degree``, else 1 (``"auto"`` before the model is applied: Ulysses alone; a model that needs a
        ring refuses such a layout by name at its first forward)."""
        if self._ring is not None:
            return self._ring
        return self.config.ring_degree if isinstance(self.config.ring_degree, int) else 1

    # ---- data ---------------------------------------------------------------------------------

    def collator(self, inner: Any = None) -> SPCollator:
        """The collate function that keeps this rank's share of a batch collated by ``inner``."""
        self._require_setup()
        return SPCollator(
            sp_rank=self.sp_rank,
            sp_size=self.sp_size,
            chunk_size=self.resolved_chunk_size(),
            pad_token_id=self.pad_token_id,
            inner=inner,
            ring=self.resolved_ring_degree(),
        )

    def prepare_dataloader(
        self, dataloader: DataLoader, accelerator: Any, *, shard_sequences: bool = True
    ) -> DataLoader:
        """Shard ``dataloader`` over the DP world and collate each batch into this rank's FPDT shard.

        Use it *instead of* ``accelerator.prepare(dataloader)`` (which shards over every process); the
        result is registered with ``accelerator`` like one it prepared itself (gradient accumulation,
        ``gather_for_metrics``, checkpointing), and passing it to ``accelerator.prepare`` later is a no-op.
        The settings (``split_batches``, ``even_batches``, seedable sampler, device placement) are the
        Accelerator's. ``shard_sequences=False``: every rank of an SP group gets the whole batches (for a
        forward that shards them itself, :mod:`hf_fpdt.trainers.trl_fused_head`).
        """
        from accelerate.data_loader import prepare_data_loader

        self.setup(accelerator)
        if is_prepared(dataloader):
            raise ValueError(
                "this data loader was already prepared by the Accelerator (sharded over every process); "
                "pass the plain DataLoader to FPDTPlugin.prepare_dataloader instead"
            )
        # A shallow copy collating with the layout (the caller's loader stays as it was); accelerate
        # rebuilds its loader from this one's settings, collate_fn included.
        source = copy.copy(dataloader)
        if shard_sequences:
            source.collate_fn = self.collator(dataloader.collate_fn)
        prepared = prepare_data_loader(
            source,
            accelerator.device,
            num_processes=self.dp_size,
            process_index=self.dp_rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,  # every rank reads its own batches; dispatching would cross SP groups
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        mark_prepared(prepared)
        return accelerator.prepare_data_loader(prepared)  # registers it, returns it unchanged

    def prepare(self, accelerator: Any, *objects: Any) -> Any:
        """``accelerator.prepare`` with FPDT: models get :meth:`apply`, data loaders :meth:`prepare_dataloader`.

        Returns the objects in the order given (one object: the object), like ``accelerator.prepare``.
        Everything is then passed to ``accelerator.prepare`` in one call (DeepSpeed needs model,
        optimizer and loaders together).
        """
        self.setup(accelerator)
        for obj in objects:
            if isinstance(obj, nn.Module):
                self.apply(obj)
        objs = [self.prepare_dataloader(o, accelerator) if isinstance(o, DataLoader) else o for o in objects]
        with self._guard("FPDTPlugin.prepare: accelerator.prepare (DDP's parameter broadcast)"):
            out = accelerator.prepare(*objs)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, nn.parallel.DistributedDataParallel):
                obj.register_forward_pre_hook(self._before_ddp_forward)
        return out

    def _before_ddp_forward(self, module: nn.Module, args: Any) -> None:
        """Meet the other ranks before DDP's own collectives (buffer sync, then the gradient reduction):
        a late or dead peer is then named here within ``sp_timeout`` instead of failing inside DDP."""
        self.world_sync("DDP forward (before its buffer sync)")

    def _guard(self, where: str):
        """:meth:`CollectiveWatch.guard` over the world, or nothing with one process."""
        return self.watch.guard(where) if self.watch is not None else contextlib.nullcontext()

    def world_sync(self, where: str) -> None:
        """One tiny collective of every rank, watched (a late or dead peer raises ``SPPeerFailure``)."""
        if self._world is None:
            return
        with self.watch.guard(where):
            dist.all_reduce(torch.zeros(1, device=self.device), group=self._world)

    # ---- loss ---------------------------------------------------------------------------------

    def num_items_in_batch(self, *batches: dict) -> torch.Tensor:
        """Valid targets (``shift_labels != -100``) of these micro-batches over every rank: a 0-d int64 tensor
        (:func:`hf_fpdt.distributed.sp_loss.global_num_items` over the world).

        Pass all micro-batches of one optimizer step (gradient accumulation); every rank must call it.
        """
        if not batches:
            raise ValueError("num_items_in_batch needs at least one batch")
        self._require_setup()
        if any(batch.get("shift_labels") is None for batch in batches):
            raise ValueError("batch has no shift_labels: prepare the data loader with FPDTPlugin.prepare_dataloader")
        labels = [batch["shift_labels"].to(self.device) for batch in batches]
        return global_num_items(labels, self._world, guard=self._world_guard("num_items_in_batch"))

    @property
    def loss_scale(self) -> int:
        """Multiply the loss by this before backward when gradients are averaged over all processes
        (:func:`hf_fpdt.distributed.sp_loss.ddp_loss_scale` of the world: the valid targets are counted over it)."""
        self._require_setup()
        return ddp_loss_scale(self._world)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The true loss of the step from every rank's share (normalised by :meth:`num_items_in_batch`):
        :func:`hf_fpdt.distributed.sp_loss.global_loss` over the world."""
        return global_loss(loss, self._world, guard=self._world_guard("global_loss"))

    def _world_guard(self, name: str):
        """The world's collectives of the SP loss rules, watched (a late or dead peer is named)."""
        return lambda what: self._guard(f"FPDTPlugin.{name}: {what}, over the world")

    # ---- host memory --------------------------------------------------------------------------

    def release(self) -> None:
        """Free the host pools (pinned on CUDA) of every model this plugin applied to (they refill on next use),
        and give the world group back the timeout it had before :meth:`setup` set ``sp_timeout`` on it."""
        for ref in self._pools:
            holder = ref()
            if holder is not None:
                holder.release()  # FPDTRuntime / LayerInputOffloader: pools re-created on next use
        if self._world_timeout is not None and self._world is not None:
            set_group_timeout(self._world, self._world_timeout)
            self._world_timeout = None

    def __enter__(self) -> FPDTPlugin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        where = "not set up" if self.world_size is None else f"world={self.world_size} dp={self.dp_size}"
        return f"FPDTPlugin({self.config}, {where})"
