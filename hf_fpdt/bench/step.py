"""One training step of one benchmark variant: the model, the batch, the timed step and what it used.

Shared by ``python -m hf_fpdt.bench speed`` (:mod:`hf_fpdt.bench.speed`: variants over lengths, the table) and
``python -m hf_fpdt.bench acceptance`` (:mod:`hf_fpdt.bench.acceptance`: one row per worker process).
A :class:`Variant` is the baseline (HF ``sdpa`` + checkpointing) or ``hf_fpdt.apply`` with a config;
:func:`run_step` times forward + backward into its :class:`Result` (an out-of-memory error becomes
``result.error = "OOM"``), :func:`describe` fills in the chunk, offload and attention blocks it ran with.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention.block_mask import BlockMask
from ..attention.sparse_patterns import block_random
from ..config import FPDTConfig
from ..integrations.state import state_of
from .common import build_model, enable_checkpointing, format_bytes, time_call


@dataclass
class Variant:
    """One configuration to time: the baseline (``fpdt is None``) or hf_fpdt with a config; ``density``: a
    block-random attention pattern (``--sparsity``) at this density, ``None``: dense."""

    name: str
    fpdt: dict | None = None
    density: float | None = None
    compile: bool = False  # --compile: the model under torch.compile (default mode, not fullgraph)


@dataclass
class Result:
    """What was measured for one variant at one length."""

    variant: Variant
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    exposed: list[float] = field(default_factory=list)  # share of each timed step
    exposed_s: list[float] = field(default_factory=list)  # seconds of each timed step
    chunk: str = "-"
    offload: str = "-"
    error: str | None = None
    blocks: str = "-"  # attention blocks one layer computes / the dense causal count
    fetched: list[int] = field(default_factory=list)  # bytes the host store brought back, each timed step
    first_s: float | None = None  # the first (warm-up) step's seconds: compilation included with --compile
    load: tuple[float, float, float] | None = None  # 1/5/15-minute load averages when its timing ended

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


def pattern(variant: Variant, chunk: int):
    return block_random(variant.density, block=chunk, seed=0) if variant.density is not None else None


def build(variant: Variant, model_config, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """The variant's model: identical weights for every variant (same seed)."""
    import hf_fpdt

    model = build_model(model_config, dtype, device, seed)
    if variant.fpdt is not None:
        config = FPDTConfig(**variant.fpdt)
        if variant.density is not None:  # blocks of one chunk: a dropped block is a skipped chunk pair
            if not isinstance(config.chunk_size, int):
                raise ValueError("--sparsity needs a fixed --chunk-size (the pattern's blocks are one chunk)")
            config.attention_pattern = pattern(variant, config.chunk_size)
        hf_fpdt.apply(model, config)
        if device.type == "cuda":
            state_of(model).runtime.transfer_stats.enabled = True
    enable_checkpointing(model)
    return torch.compile(model) if variant.compile else model


def step_runtime(model: nn.Module):
    """The runtime of an applied model (also through a PEFT or ``torch.compile`` wrapper); None for the baseline."""
    state = state_of(model)
    return state.runtime if state is not None else None


def make_batch(vocab: int, batch: int, seq_len: int, device: torch.device, seed: int) -> dict:
    """Random token ids, ``labels = input_ids`` and explicit ``position_ids``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    pos = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, -1)
    return {"input_ids": ids, "labels": ids, "position_ids": pos}


def train_step(model: nn.Module, batch: dict) -> None:
    """Forward + backward (gradients start from None, so their memory counts in the step)."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def describe(model: nn.Module, result: Result, device: torch.device, seq_len: int) -> None:
    runtime = step_runtime(model)
    if runtime is None:
        return
    chunk = runtime.config.chunk_size  # "auto" is resolved by the steps (not re-measured after an OOM)
    result.chunk = str(runtime.global_chunk_size(device) if result.error is None else chunk)
    if result.error is None:
        size = runtime.global_chunk_size(device)
        lengths = tuple(min(size, seq_len - a) for a in range(0, seq_len, size))
        kept = BlockMask(lengths, sparse=pattern(result.variant, size))
        n = len(lengths)
        result.blocks = f"{sum(len(kept.keys(i)) for i in range(n))}/{n * (n + 1) // 2}"
    store = runtime.store(device)
    if not store.enabled:
        result.offload = "off"
    elif store.budget.limit is None or store.budget.limit:
        limit = store.budget.limit
        result.offload = f"auto({'all' if limit is None else format_bytes(limit)} resident)"
    else:
        result.offload = "on"


def run_step(model: nn.Module, batch: dict, device: torch.device, result: Result, timed: bool) -> None:
    runtime = step_runtime(model)
    stats = getattr(runtime, "transfer_stats", None)
    if stats is not None:
        stats.reset()
    fetched = runtime.store(device).fetched_bytes if runtime is not None else 0
    try:
        seconds, peak = time_call(lambda: train_step(model, batch), device, memory=device.type == "cuda")
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        result.error = "OOM"
    if result.error is not None:  # outside the handler, so the failed step's frames can be collected
        model.zero_grad(set_to_none=True)
        free(device)
        return
    if not timed:
        return
    result.seconds.append(seconds)
    if runtime is not None:
        result.fetched.append(runtime.store(device).fetched_bytes - fetched)
    if peak is not None:
        result.peak_bytes = max(result.peak_bytes or 0, peak)
    if stats is not None and stats.enabled:
        exposed = stats.collect().exposed_s
        result.exposed.append(exposed / seconds)
        result.exposed_s.append(exposed)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
