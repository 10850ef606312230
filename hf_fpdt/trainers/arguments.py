"""What an FPDT trainer's arguments must be: :func:`plugin_for` (the training arguments and the plugin, with
``parallelism_config``'s ``sp_size`` read as the SP size) and :func:`check_args` (the settings that would give
another loss or gradient than one process, refused)."""

from __future__ import annotations

import copy
from typing import Any

from transformers import TrainingArguments

from .accelerate_plugin import FPDTPlugin


def plugin_for(args: Any, fpdt: FPDTPlugin | None, name: str) -> tuple[Any, FPDTPlugin]:
    """The training arguments and the plugin an FPDT trainer runs with.

    ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))`` (Accelerate's sequence parallelism
    setting) is read as the FPDT SP size: the plugin is ``FPDTPlugin(sp_size=N)`` (a given ``fpdt`` with another
    ``sp_size`` is a ``ValueError``), and the trainer runs on a copy of the arguments without it (Accelerate would
    otherwise start its own DeepSpeed-Ulysses sequence parallelism on the same processes). Other parallelism
    dimensions (tensor, context, sharded or replicated data) are refused. The caller's objects are not written.
    """
    config = getattr(args, "parallelism_config", None)
    if config is None:
        return args, fpdt if fpdt is not None else FPDTPlugin()
    others = {n: getattr(config, n, None) for n in ("tp_size", "cp_size", "dp_shard_size", "dp_replicate_size")}
    others = {n: v for n, v in others.items() if v is not None and v > 1}
    if others:
        raise ValueError(
            f"{name} takes parallelism_config's sp_size only (got {others}): FPDT's data parallelism is the "
            "processes over the SP size; use DeepSpeed ZeRO or FSDP through the Accelerate config for sharding"
        )
    sp_size = getattr(config, "sp_size", None) or 1  # Accelerate's sp_size is new in 1.11
    if fpdt is not None and fpdt.sp_size != sp_size:
        raise ValueError(
            f"{name}: parallelism_config has sp_size={sp_size} and the plugin FPDTPlugin(sp_size={fpdt.sp_size}); "
            "set the sequence-parallel size once (either, or both equal)"
        )
    args = copy.copy(args)
    args.parallelism_config = None
    return args, fpdt if fpdt is not None else FPDTPlugin(sp_size=sp_size)


def check_args(args: TrainingArguments, sp_size: int) -> None:
    """Refuse settings that would silently give another loss or gradient than one process."""
    if not args.average_tokens_across_devices:
        raise ValueError(
            "FPDTTrainer needs average_tokens_across_devices=True: the loss must be divided by the valid "
            "tokens of the whole step (all ranks), not by each rank's share"
        )
    if args.label_smoothing_factor:
        raise ValueError("FPDTTrainer does not support label smoothing (labels arrive pre-shifted and sharded)")
    if args.n_gpu > 1:
        raise ValueError("FPDTTrainer needs one device per process; launch with accelerate/torchrun, not DataParallel")
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by FPDTTrainer; use "
            "'random' or 'sequential' (every rank of an SP group must draw the same samples)"
        )
