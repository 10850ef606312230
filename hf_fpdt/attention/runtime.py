"""FPDTRuntime: what the chunk pipeline of one model needs beside its tensors.

One runtime is shared by every attention layer of a model (``hf_fpdt.apply`` / ``hf_fpdt.configure`` install
it; the attention-only path makes one per model on its first call), so the host store's pool is reused
across layers and steps, and the model has one autotuner, one device budget and one chunk size. It holds
the process group explicitly; nothing here is global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..config import ENV_NAMES, FPDTConfig, sp_degrees
from ..data.chunk_size import resolve_chunk_size
from ..data.chunks import local_chunk_sizes
from ..distributed.agreement import unpicklable_group
from ..distributed.all_to_all import group_size
from ..distributed.peers import guarded
from ..distributed.ring_exchange import RingGroups, build_ring_groups
from ..memory.checkpointing import CheckpointState
from ..memory.host_store import DeviceBudget, HostStore, TransferStats
from ..memory.probes import auto_host_memory
from .block_mask import check_deterministic
from .routes import Router, resolve_router
from .sparse_patterns import SparsePattern, pattern_for_layer
from .threads import CpuThreads


@dataclass
class FPDTRuntime:
    """Settings, sequence-parallel group and host stores of one model.

    Args:
        config: the :class:`FPDTConfig`.
        group: the sequence-parallel process group (``None`` = one process).
        backend: a kernel backend that overrides ``config.backend`` (see :mod:`hf_fpdt.attention.kernels`); ``None``
            takes the config's.
        autotuner: resolves ``chunk_size="auto"`` / ``offload="auto"`` (on a GPU) and caches its measurements
            per device: an :class:`~hf_fpdt.attention.autotune.Autotuner`, handed in by ``hf_fpdt.apply`` /
            ``FPDTPlugin``.
            A runtime built by hand with an ``"auto"`` setting and none raises ``ValueError`` where it is needed.
        transfer_stats: exposed host-to-device transfer time of all stores; set ``transfer_stats.enabled``
            to measure it (CUDA; see :class:`hf_fpdt.memory.host_store.TransferStats`).
        checkpointing: the record/replay log of the running checkpoints and the step's replay budget
            (:class:`hf_fpdt.memory.checkpointing.CheckpointState`).
        residency: the step's device budget, shared by the chunk store and the layer-input offloader
            (:class:`hf_fpdt.memory.host_store.DeviceBudget`); its limit is set once per step shape by the plan
            (:func:`hf_fpdt.integrations.step_plan.plan_step`). Until a plan sets it (the attention
            used without a model), ``offload="auto"`` takes the autotuner's share of free device memory.
        threads: the CPU thread count of the chunked pieces (:class:`hf_fpdt.attention.threads.CpuThreads`), decided
            once here from ``config.cpu_threads`` unless given.
    """

    config: FPDTConfig = field(default_factory=FPDTConfig)
    group: dist.ProcessGroup | None = None
    backend: str | None = None
    autotuner: object | None = None
    transfer_stats: TransferStats = field(default_factory=TransferStats)
    checkpointing: CheckpointState = field(default_factory=CheckpointState, repr=False)
    residency: DeviceBudget = field(default_factory=DeviceBudget, repr=False)
    threads: CpuThreads | None = field(default=None, repr=False)
    _stores: dict = field(default_factory=dict, repr=False)
    _routers: dict = field(default_factory=dict, repr=False)  # (device, dtype, head dim) -> its Router
    _chunk_size: int | None = field(default=None, repr=False)  # config.chunk_size resolved (global_chunk_size)
    _host_budget: tuple | None = field(default=None, repr=False)  # (bytes or None,) once resolved
    _patterns: dict = field(default_factory=dict, repr=False)  # layer_idx -> its SparsePattern or None
    _rings: dict = field(default_factory=dict, repr=False)  # ring degree -> this rank's RingGroups (made once)

    def __post_init__(self) -> None:
        if self.threads is None:  # the thread count, decided once per runtime (apply / configure / first call)
            self.threads = CpuThreads(self.config.cpu_threads)
        sp = group_size(self.group)
        if sp != self.config.sp_size:
            if self.group is None:
                raise ValueError(
                    f"sp_size={self.config.sp_size}{_env_origin(self.config.sp_size)} needs a sequence-parallel "
                    "process group: pass group= to hf_fpdt.apply (or hf_fpdt.configure, on the attention-only path), "
                    "or use hf_fpdt.FPDTPlugin, which builds it; for one process leave sp_size at 1"
                )
            if self.config.sp_size != 1:
                raise ValueError(
                    f"config.sp_size={self.config.sp_size} but the process group has {sp} ranks: pass the group "
                    "of the SP ranks, or leave sp_size at 1 to take the group's size"
                )
            # Adopt the group's size on a copy: the caller's config object is not changed behind its back.
            self.config = replace(self.config, sp_size=sp)

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(model)``): a runtime without a process group pickles (its stores, caches and
        device budget as they are; see :meth:`DeviceBudget.__getstate__`); one with a group cannot, since a process
        group is a live connection to the other ranks (:func:`~hf_fpdt.distributed.agreement.unpicklable_group`). The
        resolved routers (:meth:`router`) are left out: they hold functions of installed extensions, and are resolved
        (probed) again on use."""
        if self.group is not None:
            raise unpicklable_group()
        state = dict(vars(self))
        state["_routers"] = {}  # the flash-attn builds' entry points: resolved again on use, not pickled
        return state

    @property
    def sp_size(self) -> int:
        return group_size(self.group)

    def ring_degree(self, num_heads: int, num_kv_heads: int) -> int:
        """R, the ring of Ulysses groups a model with ``num_heads`` query heads runs on: ``config.ring_degree`` at this
        SP size (:func:`hf_fpdt.config.sp_degrees`; ``ValueError`` naming ``ring_degree`` where it does not fit)."""
        return sp_degrees(num_heads, num_kv_heads, self.sp_size, self.config.ring_degree)[1]

    def model_ring_degree(self, model_config) -> int:
        """:meth:`ring_degree` of a model from its (HF) config's heads: the data layout's ring (1 without SP, or
        for a config that names no heads)."""
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = getattr(cfg, "num_attention_heads", None)
        if self.sp_size == 1 or not isinstance(heads, int):
            return 1
        return self.ring_degree(heads, getattr(cfg, "num_key_value_heads", None) or heads)

    def ring_groups(self, num_heads: int, num_kv_heads: int) -> RingGroups | None:
        """This rank's Ulysses and ring groups (:mod:`hf_fpdt.distributed.ring_exchange`) where the ring degree is
        above 1, made on first use (every rank of the SP group gets here at its first attention call); ``None``
        without a ring (nothing created, nothing exchanged: Ulysses alone)."""
        ring = self.ring_degree(num_heads, num_kv_heads)
        if ring == 1:
            return None
        if ring not in self._rings:
            self._rings[ring] = build_ring_groups(self.group, ring)
        return self._rings[ring]

    def head_group(self, num_heads: int, num_kv_heads: int) -> dist.ProcessGroup | None:
        """The group a call's heads split over: the SP group, or this rank's Ulysses group on a ring (the attention
        sinks' heads, :mod:`hf_fpdt.attention.sinks`)."""
        ring = self.ring_groups(num_heads, num_kv_heads)
        return self.group if ring is None else ring.ulysses

    def global_chunk_size(self, device: torch.device, **hints) -> int:
        """Tokens of the global sequence per chunk: ``config.chunk_size``, with ``"auto"`` resolved on the first
        call (:func:`hf_fpdt.data.chunk_size.resolve_chunk_size`: measured, agreed over the SP group) and kept
        here, so every layer and step uses the same chunks. ``hints``: ``dtype``, ``width``, ``kv_ratio``,
        ``seq_len`` (:meth:`hf_fpdt.attention.autotune.Autotuner.measured_chunk_size`).
        """
        if self._chunk_size is None:
            setting = self.config.chunk_size
            tuner = self.tuner() if setting == "auto" else None
            with guarded(self.group, "chunk_size='auto': all_reduce of the ranks' measured chunk sizes"):
                self._chunk_size = resolve_chunk_size(
                    setting, device, sp_size=self.sp_size, group=self.group, tuner=tuner, **hints
                )
        return self._chunk_size

    def resolved_chunk_size(self) -> int | None:
        """The global chunk size once known (a number configured, or ``"auto"`` resolved), else None."""
        return self._chunk_size or (self.config.chunk_size if isinstance(self.config.chunk_size, int) else None)

    def chunk_sizes(self, local_len: int, device: torch.device, **hints) -> list[int]:
        """This rank's local chunk lengths for ``local_len`` tokens (the chunk plan of :mod:`hf_fpdt.data.chunks`)."""
        hints.setdefault("seq_len", local_len * self.sp_size)  # what "auto" models, if it is resolved now
        return local_chunk_sizes(local_len, self.global_chunk_size(device, **hints), self.sp_size)

    def attention_pattern(self, layer_idx: int | None) -> SparsePattern | None:
        """The block-sparse pattern of layer ``layer_idx`` from ``config.attention_pattern`` (``None``: dense),
        checked once per layer (:func:`hf_fpdt.attention.sparse_patterns.pattern_for_layer`)."""
        if layer_idx not in self._patterns:
            pattern = pattern_for_layer(self.config.attention_pattern, layer_idx)
            if pattern is not None and all(p is not pattern for p in self._patterns.values()):
                check_deterministic(pattern)  # once per pattern: a mask_mod random per call is refused by name
            self._patterns[layer_idx] = pattern
        return self._patterns[layer_idx]

    def router(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> Router:
        """Where ``dtype`` blocks of ``head_dim`` on ``device`` run (:class:`hf_fpdt.attention.routes.Router`): the
        backend (``backend``, else ``config.backend``: a name, or ``"auto"`` to pick by capability; a named one that
        cannot run here raises ``ValueError`` on every rank), the flash-attn build of its masked blocks and whether
        ``cudnn`` takes the rest with a bias; resolved (probed, logged) once, then reused by the chunked, cached and
        compiled paths (:func:`hf_fpdt.attention.routes.resolve_router`)."""
        key = (str(device), dtype, head_dim)
        if key not in self._routers:
            self._routers[key] = resolve_router(self.backend or self.config.backend, device, dtype, head_dim)
        return self._routers[key]

    def kernel_backend(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        """The kernel of dense blocks of ``dtype`` / ``head_dim`` on ``device``: :meth:`router`'s backend."""
        return self.router(device, dtype, head_dim).backend

    def host_budget(self, device: torch.device) -> int | None:
        """``config.host_memory`` in bytes (``None``: unlimited), resolved once (``"auto"``: see
        :func:`hf_fpdt.memory.probes.auto_host_memory`). The ranks of a sequence-parallel group take the smallest
        of their budgets (one all-reduce, once): they must agree on which layers keep their chunks, since
        a replayed and a recomputed attention run different collectives.
        """
        if self._host_budget is None:
            raw = self.config.host_memory
            budget = None if raw == "unlimited" else auto_host_memory() if raw == "auto" else int(raw)
            self._host_budget = (self.agreed_min(budget, device),)
        return self._host_budget[0]

    def agreed_min(self, value: int | None, device: torch.device) -> int | None:
        """The smallest of the SP ranks' ``value`` (``None``: unlimited); one all-reduce, or none with one rank."""
        return self.agreed_mins([value], device)[0]

    def agreed_mins(self, values: list[int | None], device: torch.device) -> list[int | None]:
        """The smallest of the SP ranks' ``values``, element-wise (``None``: unlimited), in one all-reduce
        (none with one rank). Negate a value to agree on the largest."""
        if self.sp_size == 1:
            return list(values)
        unlimited = 1 << 62
        agreed = torch.tensor([unlimited if v is None else v for v in values], dtype=torch.int64, device=device)
        with guarded(self.group, "the step plan's budgets: all_reduce of the ranks' memory limits"):
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return [None if v >= unlimited else v for v in agreed.tolist()]

    def tuner(self):
        """The :class:`hf_fpdt.attention.autotune.Autotuner` of this runtime (its cache of measurements)."""
        if self.autotuner is None:
            raise ValueError(
                f"FPDTRuntime(autotuner=None) with chunk_size={self.config.chunk_size!r}, "
                f"offload={self.config.offload!r}: an 'auto' setting needs measurements; pass "
                "autotuner=hf_fpdt.attention.autotune.Autotuner() (hf_fpdt.apply and FPDTPlugin do), or give the "
                "setting explicitly"
            )
        return self.autotuner

    def release(self) -> None:
        """Drop the host stores and their pooled (pinned on CUDA) buffers; they are re-created on next use.

        Chunks still referenced by a live autograd graph stay valid: they hold their own buffers.
        """
        self._stores.clear()

    def store(self, device: torch.device) -> HostStore:
        """The host store of ``device`` (created on first use, then reused)."""
        key = str(device)
        if key not in self._stores:
            offload = self.config.offload
            if offload == "auto" and self.autotuner is None and torch.device(device).type == "cpu":
                offload = False  # the device is the host: nothing to measure, no tuner needed
            elif offload == "auto":
                offload, resident = self.tuner().offload(device)
                if not self.residency.planned:
                    self.residency.limit = resident
            self._stores[key] = HostStore(
                device,
                enabled=bool(offload),
                budget=self.residency,
                stats=self.transfer_stats,
                sync_copies=self.config.sync_copies,
            )
        return self._stores[key]


def _env_origin(sp_size: int) -> str:
    """Where an ``sp_size`` may have come from, for an error: the ``FPDT_SP_SIZE`` environment variable when it
    is set to that value (``FPDTConfig`` reads it when not given ``sp_size``; launchers pass it on)."""
    name = ENV_NAMES["sp_size"]
    raw = os.environ.get(name, "").strip()
    if raw.isdigit() and int(raw) == sp_size:
        return (
            f" (from the environment variable {name}={raw!r}, which FPDTConfig reads when sp_size is not given: "
            f"unset it, or pass FPDTConfig(sp_size=1))"
        )
    return ""
