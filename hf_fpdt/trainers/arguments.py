"""What an FPDT trainer's arguments must be: :func:`plugin_for` (the training arguments and the plugin, with
``parallelism_config``'s ``sp_size`` read as the SP size), :func:`check_args` (the settings that would give
another loss or gradient than one process, refused) and :func:`agree_on_args` (every process holds the same:
*every* dataclass field of the ``TrainingArguments`` / TRL config -- ``beta``, ``loss_type``, ``temperature``,
``learning_rate``, ``gradient_accumulation_steps``, ``bf16``, ``seed``, ...; new fields of later versions too --
except :data:`ARGS_EXCLUDED`, the fields that name where this process writes, logs or reports, or that the
launcher sets per process, which change no number of the step; compared as digests by
:func:`hf_fpdt.distributed.agreement.agree`)."""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

import torch.distributed as dist
from transformers import TrainingArguments

from ..distributed.agreement import agree
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


def check_args(args: TrainingArguments, sp_size: int, name: str = "FPDTTrainer") -> None:
    """Refuse settings that would silently give another loss or gradient than one process; ``name``: the trainer
    in use (``type(trainer).__name__``), which each message names."""
    if not args.average_tokens_across_devices:
        raise ValueError(
            f"{name} needs average_tokens_across_devices=True: the loss must be divided by the valid "
            "tokens of the whole step (all ranks), not by each rank's share"
        )
    if args.label_smoothing_factor:
        raise ValueError(f"{name} does not support label smoothing (labels arrive pre-shifted and sharded)")
    if args.n_gpu > 1:
        raise ValueError(f"{name} needs one device per process; launch with accelerate/torchrun, not DataParallel")
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by {name}; use "
            "'random' or 'sequential' (every rank of an SP group must draw the same samples)"
        )


# Fields of the arguments that differ between processes of one job without changing any number of the step, or
# name per-process places; every other field is compared. Each entry says why.
ARGS_EXCLUDED: dict[str, str] = {
    "output_dir": "a path (a process may write under its own)",
    "logging_dir": "a path (older transformers: timestamped per process)",
    "run_name": "a label for trackers (defaults to output_dir)",
    "local_rank": "set per process by the launcher",
    "report_to": "where metrics go, not what they are",
    "project": "a tracker's project name",
    "trackio_space_id": "a tracker's space",
    "trackio_bucket_id": "a tracker's bucket",
    "trackio_static_space_id": "a tracker's space",
    "hub_token": "a credential (never exchanged)",
    "push_to_hub_token": "a credential (older transformers; never exchanged)",
    "hub_model_id": "where the Hub copy goes",
    "hub_strategy": "when the Hub copy is pushed",
    "hub_private_repo": "the Hub copy's visibility",
    "hub_always_push": "Hub pushes",
    "hub_revision": "the Hub copy's branch",
    "push_to_hub": "whether rank 0 pushes a copy",
    "log_level": "console verbosity",
    "log_level_replica": "console verbosity of the other processes",
    "log_on_each_node": "console verbosity per node",
    "disable_tqdm": "a progress bar (its default follows each process's log level)",
    "skip_memory_metrics": "a memory report",
    "num_completions_to_print": "console output (TRL)",
    "log_completions_hub_repo": "where completions are logged (TRL)",
}


def args_values(args: object) -> dict[str, object]:
    """Every field of ``args`` (a dataclass such as ``TrainingArguments`` or a TRL config; another object: its
    attributes) except :data:`ARGS_EXCLUDED`, by name. Nested dataclasses (``accelerator_config``) become dicts of
    their fields, so :func:`~hf_fpdt.distributed.agreement.fingerprint` compares their contents."""
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        names = [f.name for f in dataclasses.fields(args)]
    else:
        names = sorted(k for k in vars(args) if not k.startswith("_"))
    return {n: _plain(getattr(args, n, None)) for n in names if n not in ARGS_EXCLUDED}


def _plain(value: object, depth: int = 0) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 4:
        return {f.name: _plain(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):  # e.g. lr_scheduler_type, save_strategy: by value, not by class
        return value.value
    return value


ARGS_ADVICE = (
    "Every process must train with the same arguments: build them from the same command line or config file on "
    "every rank (only the fields named in hf_fpdt.trainers.arguments.ARGS_EXCLUDED may differ)"
)


def agree_on_args(group: dist.ProcessGroup | None, args: object, what: str = "the training arguments") -> None:
    """The ranks of ``group`` (the world; ``None``: one process, nothing to do) hold equal ``args``
    (:func:`args_values`), or every rank raises the same ``SPAgreementError`` naming each differing field and every
    rank's value. One all-gather of one int64 per field, plus the differing values when some differ."""
    if group is None or dist.get_world_size(group) < 2:
        return
    agree(group, args_values(args), what=f"{what} ({type(args).__name__})", advice=ARGS_ADVICE, scope="world")
