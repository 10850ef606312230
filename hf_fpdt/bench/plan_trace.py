"""``python -m hf_fpdt.bench plan --trace``: will it fit, and how fast. For each length, hf_fpdt's training step and
HF ``sdpa`` + checkpointing (without hf_fpdt) are traced at real scale on a shape-only device
(:mod:`hf_fpdt.bench.trace`) and timed on a GPU of the table (:mod:`hf_fpdt.bench.timeline`,
:mod:`hf_fpdt.bench.gpus`): fits or not (which tier, by how much), device and host peaks, predicted step time and
MFU (HF sdpa, which has no sequence parallelism, on one GPU with the whole sequence whatever ``--sp`` says), the
compute stream's busy share and its three largest causes of idle time, and the planner's own peaks beside
the traced ones. Every time and MFU is a prediction.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config import FPDTConfig, format_bytes, parse_bytes
from .cli import offload_setting, plan_error

CONTEXT_BYTES = 512 << 20  # the CUDA context and its kernels' images, per process, outside the allocator (assumed)
GIB = 1 << 30
DEFAULT_HOST = 128 * GIB  # --host-capacity auto with --trace: the machine planned for is not this one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``--trace`` adds to ``plan``."""
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace the real step (hf_fpdt and HF sdpa + checkpointing) at real scale on a shape-only device and "
        "predict its step time and MFU on --gpu; the device's memory is the GPU's unless --device-memory says, the "
        "host's is --host-capacity (default 128GiB with --trace)",
    )
    parser.add_argument("--gpu", default="h100", help="with --trace: h100, h200 or a100 [h100]")
    parser.add_argument("--backend", default="cudnn", help="with --trace: hf_fpdt's attention kernel [cudnn]")
    parser.add_argument("--json", action="store_true", help="with --trace: one JSON object per line, no table")
    parser.add_argument("--no-baseline", action="store_true", help="with --trace: trace hf_fpdt only, not HF sdpa")


def _say(text: str) -> None:
    end = "\r" if sys.stderr.isatty() else "\n"
    print(f"# {text}" + (" " * 20 if end == "\r" else ""), end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Trace and time every length and variant; print the table (or JSON). Exit code 1 when hf_fpdt's step does not
    fit at some length, 2 on a bad argument."""
    from ..memory.planner import plan, resident_setting
    from ..memory.probes import AUTO_HOST_SHARE
    from ..models.presets import load_model_config
    from .common import parse_dtype
    from .gpus import gpu as gpu_row

    try:
        gpu = gpu_row(args.gpu)
        model_config = load_model_config(args.model)
        device_memory = parse_bytes(args.device_memory) if args.device_memory else gpu.memory
        capacity = args.host_capacity  # the traced machine's, not this one's: "auto" is 128 GiB here
        host_capacity = {"auto": DEFAULT_HOST, "unlimited": None}.get(capacity, None)
        if capacity not in ("auto", "unlimited"):
            host_capacity = parse_bytes(capacity)
        host_memory = args.host_memory
        if host_memory == "auto":
            host_memory = int(AUTO_HOST_SHARE * host_capacity) if host_capacity else "unlimited"
        chunk = args.chunk_size if isinstance(args.chunk_size, int) else 16384
        dtype = parse_dtype(args.dtype)
        FPDTConfig(backend=args.backend)  # its refusal of a name, before anything is traced
        offload = offload_setting(args.offload)
        plans = {  # every length planned before one is traced: a refused argument (an SP size...) traces nothing
            n: plan(args.model, n, sp_size=args.sp, lora_rank=args.lora_rank or None, dtype=args.dtype,
                    device="cuda", device_memory=device_memory, host_memory=host_memory, chunk_size=chunk,
                    segments=args.segments, host_capacity=host_capacity, offload=offload is not False,
                    resident_memory=resident_setting(args.resident_memory, offload, "cuda"))
            for n in args.seq_len
        }  # fmt: skip
        ring = max(p.ring for p in plans.values())
        if ring > 1:  # the traced step shards and runs Ulysses alone
            raise ValueError(
                f"sp_size={args.sp}: beyond the model's query heads it runs with a ring (R {ring}), which --trace does "
                "not trace yet: plan it without --trace, or trace an sp of at most the query heads"
            )
    except (ValueError, OSError) as err:
        print(plan_error(err), file=sys.stderr)
        return 2
    variants = ["fpdt"] if args.no_baseline else ["fpdt", "sdpa"]
    rows, misfit = [], False
    for n in args.seq_len:
        planned = plans[n]
        for variant in variants:
            row = _one(args, model_config, n, variant, gpu, dtype, device_memory, host_memory, host_capacity, chunk)
            if variant == "fpdt":
                row["planner_device_peak"] = sum(planned.device.values())
                row["planner_host_peak"] = planned.host_need
                misfit |= not row["fits"]
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print(_table(args, gpu, rows, device_memory, host_capacity))
    return 1 if misfit else 0


def _one(args, model_config, n: int, variant: str, gpu, dtype, device_memory: int, host_memory, host_capacity,
         chunk: int) -> dict:  # fmt: skip
    from .common import step_flops
    from .timeline import play
    from .trace import REFUSAL, trace_step

    sp = args.sp if variant == "fpdt" else 1  # HF sdpa has no sequence parallelism: one GPU, the whole sequence
    _say(f"tracing {variant} at {n} tokens (sp {sp}) ...")
    trace = trace_step(
        model_config, n, variant=variant, sp_size=sp, lora_rank=args.lora_rank or None, dtype=dtype,
        device_memory=device_memory, host_memory=host_memory, host_capacity=host_capacity, chunk_size=chunk,
        backend=args.backend, segments=args.segments, offload=offload_setting(args.offload),
        device_tier=args.resident_memory,
        progress=lambda text: _say(f"{variant} {n}: {text}"),
    )  # fmt: skip
    _say(f"{variant} at {n} tokens traced in {trace.trace_seconds:.0f} s; timing it on {gpu.name}")
    timeline = play(trace.log.events, gpu)
    device_peak = trace.device_peak_reserved + CONTEXT_BYTES
    device_over = max(device_peak - device_memory, trace.device_short_by if trace.device_failures else 0)
    host_over = max(0, trace.host_peak - host_capacity) if host_capacity else 0
    flops = step_flops(model_config, trace.n_params, 1, n) / sp
    mfu = flops / (timeline.step_s * gpu.peak) if timeline.step_s else 0.0
    why = []
    if device_over > 0:
        why.append(f"device short by {format_bytes(device_over)}")
    if host_over > 0:
        why.append(f"host short by {format_bytes(host_over)}")
    if trace.error:  # hf_fpdt's own refusal names the shortfall and the ways out: printed under the table
        why.append("hf_fpdt refuses the step (below)" if trace.error.startswith(REFUSAL) else "out of memory")
    return {
        "variant": "hf_fpdt" if variant == "fpdt" else "HF sdpa + ckpt", "seq_len": n, "sp": sp,
        "gpu": gpu.name, "fits": not why, "why": "; ".join(why), "device_peak": device_peak,
        "device_peak_allocated": trace.device_peak_allocated, "host_peak": trace.host_peak,
        "host_pinned": trace.host_pinned, "step_s": timeline.step_s, "mfu": mfu,
        "compute_busy": timeline.busy_share("compute"), "gaps_over_1ms": timeline.gaps, "host_syncs": trace.syncs,
        "stand_ins": trace.stand_ins, "kernels": trace.log.kernels,
        "idle_causes": [[c, s] for c, s in timeline.top_idle(3)], "trace_s": trace.trace_seconds,
        "refused": trace.error is not None, "error": trace.error,
        "compute_s_by_kind": timeline.kind_s, "copy_bytes": timeline.copy_bytes, "busy_s": timeline.busy_s,
        "peak_holders": [list(h) for h in trace.peak_holders],
    }  # fmt: skip


def _table(args, gpu, rows: list[dict], device_memory: int, host_capacity) -> str:
    from .common import format_table

    headers = ["tokens", "variant", "fits", "device peak", "host peak", "step (pred.)", "MFU (pred.)",
               "compute busy", "gaps>1ms", "syncs", "traced in"]  # fmt: skip
    body = []
    for r in rows:
        fits = "yes" if r["fits"] else f"NO: {r['why']}"
        ran = not r["refused"]
        body.append([
            str(r["seq_len"]), r["variant"], fits, format_bytes(r["device_peak"]) if ran else "-",
            format_bytes(r["host_peak"]) if ran else "-", f"{r['step_s']:.2f} s" if ran else "-",
            f"{100 * r['mfu']:.1f}%" if ran else "-", f"{100 * r['compute_busy']:.0f}%" if ran else "-",
            str(r["gaps_over_1ms"]), str(r["host_syncs"]), f"{r['trace_s']:.0f} s",
        ])  # fmt: skip
    host = format_bytes(host_capacity) if host_capacity else "not checked"
    lines = [
        f"# model={args.model} lora_rank={args.lora_rank or 'full'} dtype={args.dtype} sp={args.sp} gpu={gpu.name} "
        f"device={format_bytes(device_memory)} host={host}; step times and MFU are predictions",
        format_table(headers, body),
    ]
    for r in rows:
        if r["refused"]:
            lines.append(f"# {r['seq_len']} ({r['variant']}): {r['error']}")
        elif r["variant"] == "hf_fpdt":
            causes = "; ".join(f"{c} {s:.2f} s" for c, s in r["idle_causes"]) or "none"
            lines.append(f"# {r['seq_len']}: compute stream idle, largest causes: {causes}")
            lines.append(
                f"# {r['seq_len']}: planner (bench plan): device {format_bytes(r['planner_device_peak'])}, host "
                f"{format_bytes(r['planner_host_peak'])}; traced: device {format_bytes(r['device_peak'])} "
                f"(allocated {format_bytes(r['device_peak_allocated'])}), host {format_bytes(r['host_peak'])}"
            )
            top = r["peak_holders"][:4]
            held = "; ".join(f"{format_bytes(b)} in {n} x {what} ({where})" for b, n, what, where in top)
            lines.append(f"# {r['seq_len']}: at the allocated peak the largest holders: {held}")
    return "\n".join(lines)
