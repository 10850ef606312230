"""A dry run of the real training step at real scale: :func:`trace_step` runs one step (forward, backward,
optimizer) of an HF causal LM given by its config (a preset or a ``config.json``; no weights) on the shape-only
CUDA device of :mod:`hf_fpdt.bench.trace_device`, and returns every allocation and free on the device (through the
caching allocator's rules), the pinned and pageable host memory, every kernel with its FLOPs and bytes, every copy,
collective and host synchronisation (:class:`Trace`). Nothing the size of a weight or an activation is allocated:
Llama-3.1-8B at 128K tokens traces in a few minutes on a laptop's CPU.

Two variants: ``fpdt`` (``hf_fpdt.apply`` with the given :class:`~hf_fpdt.config.FPDTConfig` settings and HF's
non-reentrant checkpointing, as ``bench speed`` runs it) and ``sdpa`` (HF ``attn_implementation="sdpa"`` and
checkpointing, no hf_fpdt). With ``sp_size > 1`` the step is one rank's of an SP group of that size, made in one
process by a fake process group (``torch.testing``'s ``FakeStore``): the collectives hf_fpdt calls
(``all_to_all_single``, ``all_reduce``, ``all_gather``, ``broadcast``, ``all_gather_object``, ``barrier``) are
recorded with their bytes and group and leave their outputs as they are (an exchange's output keeps the input's
values where those are real).

What the trace cannot see, and what it assumes instead:

* values computed from weights or activations: each one read (``loss.item()``, a finite check, an optimizer's
  step count) is answered with 0 / ``False`` / zeros and listed as a stand-in (``Trace.stand_ins``). Token ids,
  labels and positions are real (a causal step with every label valid), and so is everything computed from them
  alone while it is small (the loss tiles' target counts, the SP layout, document boundaries).
* the attention kernel: the backend is forced (``backend``, default ``cudnn``) and its probe block, which compares
  numbers, is skipped; the baseline's ``F.scaled_dot_product_attention`` is recorded as a flash kernel.
* durations: the trace orders events, :mod:`hf_fpdt.bench.timeline` times them; a storage freed after
  ``record_stream`` leaves the allocated bytes at its free (as CUDA's allocator counts them) but its block is reused
  only at the next host synchronisation or 1024 kernels and copies later (``trace_device.LAUNCH_QUEUE``).
* the CUDA context (about 0.5 GiB per process), the allocator's own rounding of pinned blocks already cached by an
  earlier step, the host's RSS beyond the traced tensors (Python, torch, transformers: 1-3 GiB), and kernels
  torch would fuse or split differently on a GPU (a CPU build's composite ops are recorded as they decompose).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from ..memory import compat_torch
from .trace_device import META, TraceDevice, TraceTensor
from .trace_events import Collective, CollectiveWait, EventLog

GIB = 1 << 30
REFUSAL = "hf_fpdt: the plan for this step does not fit"  # how integrations.step_plan's refusal begins


@dataclass
class Trace:
    """One traced step: its events and the memory figures (bytes) of the allocator models."""

    variant: str
    seq_len: int
    sp_size: int
    log: EventLog
    n_params: int  # N of the MFU formula (hf_fpdt.bench.common.matmul_params)
    model_config: object
    device_peak_allocated: int
    device_peak_reserved: int
    device_failures: int  # allocations that did not fit the device even after releasing its cache
    device_short_by: int
    host_pinned: int
    host_pageable_peak: int
    syncs: int
    stand_ins: int
    trace_seconds: float
    error: str | None = None  # an OOM or hf_fpdt's refusal that ended the step early (the figures are up to it)
    notes: list[str] = field(default_factory=list)
    peak_holders: list = field(default_factory=list)  # the device storages alive at the allocated peak, grouped
    # by what made them: (bytes, count, "op dtype [shape]", where), largest first (TraceDevice.peak_holders)

    @property
    def host_peak(self) -> int:
        return self.host_pinned + self.host_pageable_peak


class _Work:
    """What an ``async_op=True`` collective returns in the trace: ``wait()`` orders the current stream after it."""

    def __init__(self, dev: TraceDevice, uid: int) -> None:
        self.dev, self.uid = dev, uid

    def wait(self, timeout: object = None) -> bool:
        self.dev.log.add(CollectiveWait(self.uid, self.dev.current.sid))
        return True

    def is_completed(self) -> bool:
        return True


def _peer_value(x: torch.Tensor, peers: list[list[torch.Tensor]], rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s value of ``x`` where ``x`` holds this rank's (rank 0's) values of one of the batch's own
    tensors (``peers``: each tensor's value on every rank), else ``None``."""
    flat = x.reshape(-1)
    for values in peers:
        mine = values[0].reshape(-1)
        if mine.numel() == flat.numel() and mine.dtype == flat.dtype and torch.equal(mine, flat):
            return values[rank].reshape(x.shape)
    return None


@contextlib.contextmanager
def _collectives(dev: TraceDevice, peers: list[list[torch.Tensor]]) -> Iterator[None]:
    """``torch.distributed``'s data collectives recorded on ``dev`` (see the module docstring); an ``all_gather`` of
    the batch's own tensors (``peers``: each one's value on every rank) answers with every rank's values."""
    counter = iter(range(1 << 62))

    def record(op: str, nbytes: int, group: object, async_op: bool) -> _Work | None:
        uid = next(counter)
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        dev.log.add(Collective(op, dev.current.sid, nbytes, size, uid, async_op))
        work = _Work(dev, uid)
        if async_op:
            return work
        work.wait()
        return None

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        if isinstance(output, TraceTensor) and isinstance(input, TraceTensor) and not output._elem.is_meta:
            if not input._elem.is_meta and output.numel() == input.numel():
                output._elem.copy_(input._elem.reshape(output._elem.shape))
        return record("all_to_all", nbytes(input), group, async_op)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return record("all_reduce", nbytes(tensor), group, async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        real = isinstance(tensor, TraceTensor) and not tensor._elem.is_meta
        for rank, out in enumerate(tensor_list):
            if real and isinstance(out, TraceTensor) and not out._elem.is_meta:
                value = _peer_value(tensor._elem, peers, rank)
                out._elem.copy_(tensor._elem if value is None else value)
        return record("all_gather", nbytes(tensor), group, async_op)

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        return record("broadcast", nbytes(tensor), group, async_op)

    def all_gather_object(object_list, obj, group=None):
        for i in range(len(object_list)):
            object_list[i] = obj
        dev.sync("all_gather_object")

    def barrier(group=None, async_op=False, device_ids=None):
        dev.sync("barrier")

    patches = {
        "all_to_all_single": all_to_all_single, "all_reduce": all_reduce, "all_gather": all_gather,
        "broadcast": broadcast, "all_gather_object": all_gather_object, "barrier": barrier,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        for name, fn in patches.items():
            stack.enter_context(mock.patch.object(dist, name, fn))
        yield


@contextlib.contextmanager
def _fake_world(sp_size: int) -> Iterator[dist.ProcessGroup | None]:
    """A process group of ``sp_size`` ranks in this process (rank 0), or ``None`` for one process."""
    if sp_size == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("trace with sp_size > 1 makes its own fake process group: run it outside a distributed job")
    dist.init_process_group("fake", store=compat_torch.fake_store(), rank=0, world_size=sp_size)
    try:
        yield dist.new_group(list(range(sp_size)))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _target_host(capacity: int | None) -> Iterator[None]:
    """The step's own host check (``integrations.step_plan``) made against the traced machine's host memory
    (``capacity`` bytes for this one process; ``None``: unlimited), not this one's."""
    from ..integrations import step_plan
    from ..memory.probes import HostLimits

    limits = HostLimits(ram=capacity if capacity is not None else 1 << 50, address_space=None, cgroup=None)
    with (
        mock.patch.object(step_plan, "host_limits", lambda: limits),
        mock.patch.object(step_plan, "local_processes", lambda: 1),
    ):
        yield


@contextlib.contextmanager
def _no_probes() -> Iterator[None]:
    """The named backend taken without its probe block (which compares numbers the trace does not compute)."""
    from ..attention import kernels, routes

    def prober(device: object, dtype: object, head_dim: object) -> Callable[[str], None]:
        return lambda name: None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(kernels, "prober", prober))
        stack.enter_context(mock.patch.object(routes, "prober", prober))
        stack.enter_context(mock.patch.object(routes, "probe_kinds", lambda router, device, dtype, head_dim: {}))
        stack.enter_context(mock.patch.object(routes, "probe_cudnn_bias", lambda device, dtype, head_dim: None))
        yield


def _to_device(dev: TraceDevice, model: nn.Module) -> None:
    """Every parameter and buffer of a meta ``model`` as a device tensor of the trace (in the order they appear:
    the allocation order of a model loaded onto the GPU)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(dev.wrap(p.detach(), True), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = dev.wrap(b.detach().to(META), True)


def _build(model_config, variant: str, dtype: torch.dtype, lora_rank: int | None) -> nn.Module:
    """The model on the meta device, as the bench builds it (HF ``sdpa``; hf_fpdt is applied later), with LoRA."""
    from .common import build_model

    if variant not in ("fpdt", "sdpa"):
        raise ValueError(f"variant={variant!r}: use 'fpdt' or 'sdpa'")
    model = build_model(model_config, dtype, META)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"))
    return model


def trace_step(
    model_config,
    seq_len: int,
    *,
    variant: str = "fpdt",
    sp_size: int = 1,
    lora_rank: int | None = 16,
    dtype: torch.dtype = torch.bfloat16,
    device_memory: int = 80 * GIB,
    host_memory: int | str = "unlimited",
    host_capacity: int | None = None,
    chunk_size: int = 65536,
    backend: str = "cudnn",
    offload: bool | str = "auto",
    device_tier: int | str = "auto",
    segments: int | str = "auto",
    optimizer: bool = True,
    capability: tuple[int, int] = (9, 0),
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Trace one training step of ``model_config`` at ``seq_len`` tokens (the whole sequence; one rank's share of it
    under ``sp_size``) on a ``device_memory``-byte GPU whose host lets the process allocate ``host_capacity`` bytes
    (``None``: 1 PiB; ``host_memory`` is hf_fpdt's budget, ``FPDTConfig.host_memory``; see the module docstring).
    ``lora_rank`` ``None`` or 0: full finetuning. ``offload`` and ``device_tier`` are ``FPDTConfig``'s ``offload``
    and ``device_memory``. ``optimizer``: AdamW's step included (its state is made at the first step, as in
    training)."""
    import hf_fpdt

    from .common import enable_checkpointing, matmul_params

    say = progress or (lambda text: None)
    start = time.perf_counter()
    log = EventLog(on_kernels=lambda n: say(f"{n} kernels traced"))
    dev = TraceDevice(log, total_memory=device_memory, capability=capability)
    error = None
    say("building the model on the meta device")
    model = _build(model_config, variant, dtype, lora_rank)
    n_params = matmul_params(model)
    shards = _shards(model_config, seq_len, sp_size, chunk_size)
    peers = [[shard[k] for shard in shards] for k, v in shards[0].items() if isinstance(v, torch.Tensor)]
    with _fake_world(sp_size) as group, dev, _collectives(dev, peers), _no_probes(), _target_host(host_capacity):
        _to_device(dev, model)
        if variant == "fpdt":
            config = hf_fpdt.FPDTConfig(
                chunk_size=chunk_size, offload=offload, backend=backend, host_memory=host_memory,
                checkpoint_segments=segments, sp_size=sp_size, device_memory=device_tier,
            )  # fmt: skip
            hf_fpdt.apply(model, config, group=group)
        enable_checkpointing(model)
        batch = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in shards[0].items()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-5, foreach=True) if optimizer else None
        say(f"tracing the {variant} step ({seq_len} tokens)")
        try:
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            say(f"tracing the {variant} step's backward ({log.kernels} kernels so far)")
            loss.backward()
            if opt is not None:
                opt.step()
        except torch.OutOfMemoryError as err:
            error = f"OutOfMemoryError: {err}"
        except ValueError as err:  # the step's own plan refuses a step that does not fit the host (step_plan)
            if not str(err).startswith(REFUSAL):
                raise
            error = str(err)
        del batch
        loss = opt = model = trainable = None
    a = dev.allocator
    return Trace(
        variant, seq_len, sp_size, log, n_params, model_config, a.peak_allocated, a.peak_reserved, a.failures,
        a.short_by, dev.host.pinned_reserved, dev.host.peak_pageable, dev.syncs, dev.stand_ins,
        time.perf_counter() - start, error, peak_holders=dev.peak_holders(),
    )  # fmt: skip


def _shards(model_config, seq_len: int, sp_size: int, chunk_size: int) -> list[dict]:
    """One sample of ``seq_len`` token ids with ``labels = input_ids`` (every label valid), as each rank's model
    arguments (host tensors): the whole sample, or every rank's shard in FPDT's layout under SP."""
    ids = torch.randint(0, model_config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    if sp_size == 1:
        return [{"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq_len).unsqueeze(0)}]
    from ..data.layout import shard_batch

    return [
        shard_batch(ids, ids, rank=r, sp_size=sp_size, chunk_size=chunk_size).model_kwargs() for r in range(sp_size)
    ]
