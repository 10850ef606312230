"""The step's plan hook: before each new training step shape, plan the memory tiers and apply the plan.

:func:`plan_step` is a forward pre-hook of the model (installed by ``hf_fpdt.apply``). It asks the planner
(:mod:`hf_fpdt.memory.planner`) for the step's placement with the chunk size the attention really uses
(:meth:`hf_fpdt.attention.runtime.FPDTRuntime.global_chunk_size`, ``"auto"`` resolved once), sets the replay and
device budgets the attention follows, regroups checkpoint segments
(:func:`~hf_fpdt.integrations.layer_wrappers.segment_layers`) and logs one line per step shape.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from ..attention.runtime import FPDTRuntime
from ..config import format_bytes
from ..data.chunk_size import chunk_hints
from ..memory.planner import ModelShape, plan, resident_setting
from ..memory.probes import device_memory_info, host_limits, local_processes
from .layer_wrappers import segment_layers

_log = logging.getLogger("hf_fpdt")


def _step_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _device_memory(model: nn.Module, device: torch.device, params: list) -> int | None:
    """What the device has for this step: its free memory plus the weights already on it (the plan counts
    them); ``None`` on CPU (one tier) or where free memory cannot be read."""
    if device.type == "cpu":
        return None
    free, _ = device_memory_info(device)
    if not free:
        return None
    on_device = sum(p.numel() * p.element_size() for p in params if p.device == device)
    return free + on_device


def _host_capacity(device: torch.device, params: list) -> tuple[int, str]:
    """What this process may allocate on the host for the step (:meth:`HostLimits.per_process`), plus, on CPU, the
    weights already there (the plan counts them in the host's peak), and what sets the limit."""
    nbytes, source = host_limits().per_process(local_processes())
    if device.type == "cpu":
        nbytes += sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
        source += ", plus the weights already loaded"
    return nbytes, source


def _resident_setting(runtime: FPDTRuntime, device: torch.device) -> int | str | None:
    """``config.device_memory`` for the planner (:func:`hf_fpdt.memory.planner.resident_setting`)."""
    return resident_setting(runtime.config.device_memory, runtime.config.offload, device.type)


def plan_step(runtime: FPDTRuntime, layers: list, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the model (installed by ``hf_fpdt.apply``): :func:`plan_training_step` for a
    training forward; nothing for one without gradients (so a compiled evaluation traces no planning)."""
    if model.training and torch.is_grad_enabled():
        plan_training_step(runtime, layers, model, args, kwargs)


@torch.compiler.disable  # host-side planning, once per step shape: never traced
def plan_training_step(runtime: FPDTRuntime, layers: list, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The step's plan, before the forward.

    For each new (batch, local length) of a training forward, once: the host budget (resolved once), the
    device the step has (free memory plus the weights; the smallest over the SP ranks, since the replay
    decision depends on it and must agree), the :func:`hf_fpdt.memory.planner.plan` of the step from the model's
    shapes and trainable parameters, and from it

    * the replay budget the attention layers follow (``runtime.checkpointing.replay_budget``: how many
      layers keep their replay chunks, over device + host),
    * the device budget of the layer inputs and replay chunks (``runtime.residency.limit``; on CPU the
      configured bytes, which only matter where a store copies at all),
    * with ``checkpoint_segments="auto"``, checkpoint segments of the smallest k that fits when one input
      per layer does not (:func:`segment_layers`, re-applied to the model's layers; k=1 again when a
      later shape fits without),

    and one log line (rank-prefixed under SP) saying what was chosen and what it costs; or a ``ValueError``
    naming the numbers and the ways out when the plan does not fit the host. Every rank computes the same
    plan: its inputs are the step's shape (agreed by the SP step check before this hook), the config, and
    values agreed with a MIN all-reduce (the host budget once; the device's memory and the parameter counts
    per step shape), so every rank applies the same k and every rank raises.
    """
    x = _step_tokens(args, kwargs)
    ckpt = runtime.checkpointing
    if x is None or not (model.training and torch.is_grad_enabled()):
        return
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in layers)
    key = (tuple(x.shape[:2]), checkpointing)
    if ckpt.planned == key:
        return
    runtime.residency.new_shape()  # the stores free the buffers this shape does not use after its first step
    budget = runtime.host_budget(x.device)
    resident = _resident_setting(runtime, x.device)
    residency = runtime.residency
    params = list(model.parameters())
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    try:
        shape = ModelShape.from_config(model.config)
    except (AttributeError, TypeError):  # a config without the usual names: no plan, the budgets bound the step
        _log.warning("hf_fpdt: no plan for %s (config lacks standard shape names)", type(model).__name__)
        ckpt.replay_budget, ckpt.planned = budget, key
        residency.limit, residency.planned = (resident if isinstance(resident, int) or resident is None else 0), True
        return
    # What the plan depends on that a rank measures itself, agreed over the SP group in one all-reduce: the
    # device's memory (the smallest) and the parameter counts (the largest; they differ where parameters are
    # sharded). The rest is agreed already (the step's shape by the SP step check, the host budget once) or
    # the config, so every rank plans the same k, replay budget and error.
    capacity = _device_memory(model, x.device, params) if resident == "auto" else None
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    host_bytes, host_source = _host_capacity(x.device, params)
    capacity, total, trainable, agreed_host = runtime.agreed_mins([capacity, -total, -trainable, host_bytes], x.device)
    if agreed_host < host_bytes:
        host_source = "the smallest over the SP ranks"
    shape = dataclasses.replace(shape, params=-total)  # the model's real count
    seq = x.shape[1] * runtime.sp_size
    # The integer the attention uses (and the layout shards with): "auto" is resolved here, once, agreed over
    # the SP group, and kept by the runtime, so the plan never assumes a size the attention does not run.
    chunk = runtime.global_chunk_size(x.device, seq_len=seq, **chunk_hints(model.config, dtype))
    settings = dict(
        batch=x.shape[0],
        sp_size=runtime.sp_size,
        ring_degree=runtime.config.ring_degree,
        trainable_params=-trainable,
        dtype=dtype,
        device=x.device.type,
        device_memory=capacity,
        host_memory="unlimited" if budget is None else budget,
        resident_memory=resident,
        chunk_size=chunk,
        checkpointing=checkpointing,
        offload=runtime.config.offload is not False,
        offload_layer_inputs=runtime.config.offload_layer_inputs,
        optimizer=False,
        host_capacity=(agreed_host, host_source),
    )
    wanted = runtime.config.checkpoint_segments
    p = plan(shape, seq, search_longest=False, segments=wanted, **settings)  # "auto": the planner's rule
    if not p.host_fits:  # again, with the longest sequence that would fit, for the message
        raise ValueError(plan(shape, seq, segments=p.segments, **settings).error())
    regrouped = wanted == "auto" and p.segments != ckpt.segments
    if regrouped:
        segment_layers(model, runtime, p.segments)
        ckpt.segments = p.segments
    if not p.fits:  # the device estimate only: the allocator has the last word, the host budget does not
        _log.warning("hf_fpdt plan: %s", "; ".join(p.problems))
    first = ckpt.planned is None
    ckpt.replay_budget, ckpt.planned = p.replay_budget, key
    limit = p.resident_budget if x.device.type != "cpu" else (resident if resident != "auto" else 0)
    residency.limit, residency.planned = limit, True
    # The model's first plan, and one that regroups the layers, at INFO (shown by default once the plugin set up
    # the logger); another step shape (dynamic padding makes many) at DEBUG.
    ring = f", sp {runtime.sp_size} = U {runtime.sp_size // p.ring} x R {p.ring}" if p.ring > 1 else ""
    settings = f"chunk_size {chunk}{ring}, offload {runtime.config.offload}, checkpoint_segments {wanted}; "
    # on CPU, the chunked pieces' threads (decided once: hf_fpdt.attention.threads); on a GPU they change nothing
    threads = f"; {runtime.threads.describe()}" if x.device.type == "cpu" else ""
    _log.log(
        logging.INFO if first or regrouped else logging.DEBUG,
        "hf_fpdt plan: %s%s%s%s",
        f"rank {dist.get_rank()}: " if runtime.sp_size > 1 else "", settings, _placement_line(p), threads,
    )  # fmt: skip


def _placement_line(p) -> str:
    """The log line of a step's plan: segments, replay, recomputation, bytes per tier."""
    inputs = -(-p.layers // p.segments)
    text = (
        f"seq {p.seq_len} x batch {p.batch}: checkpoint segments of k={p.segments} layer(s); "
        f"{p.replay_layers}/{p.layers} layers keep their attention replay chunks "
        f"({format_bytes(p.replay_per_layer)} each), "
        f"attention recomputed in backward in {p.layers - p.replay_layers} layers"
        + (f" (each segment's {p.segments} layers recomputed from one input)" if p.segments > 1 else "")
    )
    if p.device_type == "cpu":
        text += "; device = host (CPU, one tier)"
    else:
        text += (
            f"; on the device {format_bytes(p.resident)} of budget {format_bytes(p.resident_budget)} "
            f"(the last {p.resident_inputs}"
            f"/{inputs} layer inputs, the replay chunks of the last {p.resident_replay} keeping layers)"
        )
    return text + f"; on the host {format_bytes(p.host_kept)} of host_memory {format_bytes(p.host_budget)}"
