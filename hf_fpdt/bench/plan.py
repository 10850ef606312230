"""``python -m hf_fpdt.bench plan``: what goes where per rank for a model, length and budgets (nothing runs).

The model is a preset (``llama-3.1-8b``, ``small-llama``, ...), an HF ``config.json`` or a model folder;
nothing is downloaded or allocated. Prints :meth:`hf_fpdt.memory.planner.Plan.describe` for each length:
weights, gradients and optimizer state, layer inputs, replay chunks, chunk working set, loss tiles, per
tier, the placement (how many layers keep their attention replay chunks, which layer inputs and chunks
stay on the device), and the longest sequence that fits the budgets.

The host's peak is compared with what one process may allocate (``--host-capacity``). ``auto``: when this
machine is the one planned for (``--device cpu``, or the device type is present here), the smallest of its RAM
available, ``RLIMIT_AS`` and cgroup limit, RAM and cgroup shared by ``--local-processes``; otherwise (planning
a GPU machine from a laptop) not checked, and the plan says so: give that machine's bytes to check it.

With ``--trace`` the real step is traced at real scale instead (:mod:`hf_fpdt.bench.plan_trace`): hf_fpdt and HF
sdpa + checkpointing side by side, device and host peaks, predicted step time and MFU on ``--gpu``.

Exit codes: 0 every length fits; 1 at least one length does not fit (its plan says why, under
``DOES NOT FIT``); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import plan_trace
from .cli import add_length, offload_setting, plan_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m hf_fpdt.bench plan``."""
    parser.add_argument("--model", default="llama-3.1-8b", help="preset name or HF config path [llama-3.1-8b]")
    add_length(parser, "seq_len", _lengths, [131072], "comma-separated sequence lengths [131072]")
    parser.add_argument("--batch", type=_count(1), default=1, help="samples per rank [1]")
    parser.add_argument(
        "--sp", type=_count(1), default=1, help="sequence-parallel size; beyond the query heads a ring (--ring) [1]"
    )
    parser.add_argument(
        "--ring",
        type=_count(1, "auto"),
        default="auto",
        help="ring degree R: sp = U x R (FPDTConfig.ring_degree) [auto]",
    )
    parser.add_argument("--dp", type=_count(1), default=1, help="data-parallel size [1]")
    parser.add_argument("--lora-rank", type=_count(0), default=16, help="LoRA rank on every linear layer; 0: full [16]")
    parser.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 [bf16]")
    parser.add_argument("--device", default="cuda", help="cuda (device + host tiers) or cpu (one tier) [cuda]")
    parser.add_argument("--device-memory", default=None, help="device budget, e.g. 80GiB (default: not checked)")
    parser.add_argument("--host-memory", default="auto", help="host budget: bytes, 64GiB, auto, 0, unlimited [auto]")
    parser.add_argument(
        "--resident-memory",
        default="auto",
        help="device tier (FPDTConfig.device_memory): device bytes layer inputs and replay chunks may keep on the "
        "device; auto = what --device-memory leaves after the working set (0 without it; 0 with --offload on, as "
        "the runtime reads it) [auto]",
    )
    parser.add_argument(
        "--chunk-size",
        type=_count(1, "auto"),
        default=65536,
        help="attention chunk size in tokens, or auto (the largest the measured rule may pick) [65536]",
    )
    parser.add_argument("--no-checkpointing", action="store_true", help="plan without activation checkpointing")
    parser.add_argument(
        "--segments",
        type=_segments,
        default="auto",
        help="k layers per checkpoint segment (FPDTConfig.checkpoint_segments), or auto, the runtime's default: "
        "k=1 when one input per layer fits the host, else the smallest k that does [auto]",
    )
    parser.add_argument(
        "--offload",
        choices=("auto", "on", "off"),
        default="auto",
        help="FPDTConfig.offload: auto (the runtime's default: chunks on the host, the device tier as "
        "--resident-memory says), on (everything lasting to the host: --resident-memory auto is 0) or off "
        "(attention chunks stay on the device) [auto]",
    )
    parser.add_argument("--no-offload", dest="offload", action="store_const", const="off", help="same as --offload off")
    parser.add_argument(
        "--host-capacity",
        default="auto",
        help="what one process may allocate on the host, compared with the step's host peak: auto = this machine "
        "(smallest of RAM available, RLIMIT_AS, cgroup limit) when it has --device, else not checked; bytes such "
        "as 512GiB; or unlimited (not checked) [auto]",
    )
    parser.add_argument(
        "--local-processes",
        type=_count(1),
        default=None,
        help="training processes per node sharing the host's RAM and cgroup [LOCAL_WORLD_SIZE, else 1]",
    )
    plan_trace.add_arguments(parser)


def _count(least: int, word: str = "") -> Callable[[str], int | str]:
    """An argparse type: an int ``>= least`` (or ``word``); anything else is a usage error (exit code 2)."""

    def parse(raw: str) -> int | str:
        if word and raw.strip().lower() == word:
            return word
        try:
            value = int(raw)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}{f' or {word}' if word else ''}, got {raw!r}")
        return value

    return parse


_segments = _count(1, "auto")


def _lengths(raw: str) -> list[int]:
    """``--seq-len``: comma-separated ints >= 1."""
    parts = [part for part in raw.split(",") if part.strip()]
    bad = [part for part in parts if not part.strip().isdigit() or int(part) < 1]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 1, got {raw!r}")
    return [int(part) for part in parts]


def _device_present(device_type: str) -> bool:
    import torch

    module = getattr(torch, device_type, None)
    return bool(module is not None and hasattr(module, "is_available") and module.is_available())


def run(args: argparse.Namespace) -> int:
    """Print the plan of every length; exit code 1 when one does not fit (said in the last line), 2 when
    :func:`~hf_fpdt.memory.planner.plan` refuses an argument (one line on stderr, nothing planned), else 0.
    With ``--trace``: :func:`hf_fpdt.bench.plan_trace.run`."""
    if args.trace:
        return plan_trace.run(args)
    from ..memory.planner import plan, resident_setting
    from ..memory.probes import auto_host_memory, host_limits, local_processes

    offload = offload_setting(args.offload)
    capacity = args.host_capacity
    here = args.device == "cpu" or _device_present(args.device)
    if capacity == "auto":
        capacity = host_limits().per_process(args.local_processes or local_processes()) if here else None
    host_memory = args.host_memory
    if host_memory == "auto" and args.local_processes:
        host_memory = auto_host_memory(args.local_processes)
    settings = dict(
        batch=args.batch,
        sp_size=args.sp,
        ring_degree=args.ring,
        dp_size=args.dp,
        lora_rank=args.lora_rank or None,
        dtype=args.dtype,
        device=args.device,
        device_memory=args.device_memory,
        host_memory=host_memory,
        resident_memory=resident_setting(args.resident_memory, offload, args.device),
        chunk_size=args.chunk_size,
        checkpointing=not args.no_checkpointing,
        offload=offload is not False,
        segments=args.segments,
        host_capacity=capacity,
    )
    try:  # every length planned before one is printed: a bad argument prints no plan
        plans = [plan(args.model, n, **settings) for n in args.seq_len]
    except (ValueError, OSError) as err:  # an argument plan() refuses, a config file that cannot be read
        print(plan_error(err), file=sys.stderr)
        return 2
    if args.host_capacity == "auto" and not here:
        print(f"# host capacity not checked: no {args.device} device here (pass --host-capacity BYTES)")
    for p in plans:
        print(f"# model={args.model} lora_rank={args.lora_rank or 'full'} dtype={args.dtype}")
        if args.segments == "auto":
            print(f"# checkpoint_segments=auto: k={p.segments} (what the runtime applies for this step)")
        print(p.describe())
        print()
    misfits = [p.seq_len for p in plans if not p.fits]
    if misfits:
        print(f"# exit code 1: {', '.join(map(str, misfits))} tokens do not fit (see DOES NOT FIT above)")
        return 1
    return 0
