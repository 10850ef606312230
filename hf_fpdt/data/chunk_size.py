"""The chunk size: the one place that turns the ``chunk_size`` setting into the integer every rank uses.

``FPDTConfig.chunk_size`` is a number of tokens of the global sequence per attention chunk, or
``"auto"``. The layout (which tokens a rank holds, :mod:`hf_fpdt.data.layout`) and the attention (how a
rank cuts its tokens, :mod:`hf_fpdt.data.chunks`) must use the same integer on every rank of a
sequence-parallel group, or tokens are attended in the wrong order without any error. So:

* an integer setting is used as it is;
* ``"auto"`` is measured on each rank (:meth:`hf_fpdt.attention.autotune.Autotuner.measured_chunk_size`) and the
  ranks of ``group`` agree on the largest of their picks (one all-reduce, once: every rank of the group
  must call :func:`resolve_chunk_size` together).

Callers keep the result (:meth:`hf_fpdt.attention.runtime.FPDTRuntime.global_chunk_size` for the attention,
:meth:`hf_fpdt.trainers.accelerate_plugin.FPDTPlugin.resolved_chunk_size` for the data layout); no
one writes it back into a config object, which may be the caller's.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.distributed as dist


class ChunkTuner(Protocol):
    """What resolving ``"auto"`` needs: :class:`hf_fpdt.attention.autotune.Autotuner` is one. It is handed in (by
    ``hf_fpdt.apply`` / ``FPDTPlugin``), never imported here: ``data/`` sits below ``attention/``."""

    def measured_chunk_size(self, device: torch.device, *, sp_size: int = 1, **hints) -> int: ...


def chunk_hints(model_config, dtype: torch.dtype) -> dict:
    """The tuner's hints for an HF model config: ``dtype``, ``width`` (query heads x head dim), ``kv_ratio``."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return {"dtype": dtype, "width": heads * head_dim, "kv_ratio": kv_heads / heads}


def resolve_chunk_size(
    setting: int | str,
    device: torch.device,
    *,
    sp_size: int = 1,
    group: dist.ProcessGroup | None = None,
    tuner: ChunkTuner | None = None,
    **hints,
) -> int:
    """The integer chunk size (tokens of the global sequence) for ``setting``.

    Args:
        setting: an integer, or ``"auto"``.
        device: the device the attention runs on (measured under ``"auto"``; holds the all-reduce's tensor).
        sp_size: sequence-parallel size (``"auto"`` picks a multiple of ``lcm(1024, sp_size)``).
        group: the ranks that must agree (``None`` or one rank: no communication).
        tuner: the :class:`~hf_fpdt.attention.autotune.Autotuner` whose measurements resolve ``"auto"`` (required
            for ``"auto"``; ``hf_fpdt.apply`` and ``FPDTPlugin`` hand theirs in).
        hints: ``dtype``, ``width``, ``kv_ratio`` of the attention (:func:`chunk_hints`).
    """
    if setting != "auto":
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f"chunk_size={setting!r}: use a positive number of tokens or 'auto'")
        return setting
    if tuner is None:
        raise ValueError(
            "chunk_size='auto' needs measurements: pass tuner=hf_fpdt.attention.autotune.Autotuner() to "
            "resolve_chunk_size (hf_fpdt.apply and FPDTPlugin hand theirs in), or give chunk_size as a number"
        )
    device = torch.device(device)
    pick = tuner.measured_chunk_size(device, sp_size=sp_size, **hints)
    if group is not None and dist.get_world_size(group) > 1:
        agreed = torch.tensor([pick], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        pick = int(agreed.item())  # once per model, outside every chunk loop
    logging.getLogger("hf_fpdt").info(
        "hf_fpdt: chunk_size='auto' -> %d tokens per chunk (measured on %s, sp_size=%d%s)",
        pick, device, sp_size, ", the largest over the ranks" if group is not None else "",
    )  # fmt: skip
    return pick
