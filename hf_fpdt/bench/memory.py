"""Peak memory of one training step (forward + backward) against sequence length.

Two configurations of the same model, both with activation checkpointing (non-reentrant, HF's
default): HF ``sdpa``, and hf_fpdt (``attn_implementation="fpdt"`` + ``hf_fpdt.apply`` with offload).
Every point runs in a fresh subprocess, so allocator caches and earlier points do not leak into it:

* CPU: growth of the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the
  model and its inputs exist; ``ru_maxrss`` growth where that is unavailable);
* CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step.

It then reports the longest length that fits ``--budget-gib``: the longest measured one, and a linear
fit of peak against length (both configurations grow linearly once attention is blockwise).

With ``--layers 2,6`` (the model's layer count overridden), ``--host-memory 0,64MiB,unlimited``
(``FPDTConfig.host_memory``) and ``--segments 1,2`` (``FPDTConfig.checkpoint_segments``) it also prints,
per length, budget and segment setting, the peak growth per added layer against one layer input, the
:mod:`hf_fpdt.memory.planner`'s predicted peak against the measured one, and whether the budget held (measured
growth over the floor's within the budget + 10%). With segments of k, compare layer counts of two
segments or more (``--layers 4,8`` for k=2): a model of one segment peaks lower, before the attention
backward's dO/dq buffers join the chunk store's pool, which keeps them for every later segment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .cli import add_length
from .common import byte_sizes, count, counts, device_name, dtype_name, model_name, one_of, positive

MODES = ("sdpa", "fpdt")
# One DPO step (policy forward and backward, reference forward, TRL's fused LM head on both) on a pair of
# ``length`` tokens (chosen and rejected ``length / 2`` each): TRL's DPOTrainer with sdpa + checkpointing, and
# FPDTDPOTrainer's forward at SP 1 and SP 2 (the peak of the larger rank; two processes, gloo).
DPO_MODES = ("dpo-sdpa", "dpo-fpdt", "dpo-fpdt-sp2")
GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m hf_fpdt.bench memory``."""
    parser.add_argument(
        "--model",
        type=model_name,
        default="small-llama",
        help="preset name (hf_fpdt.models.presets) or an HF config path [small-llama]",
    )
    add_length(
        parser, "lengths", counts(1), "2048,4096,8192,16384", "comma-separated sequence lengths [2048,4096,8192,16384]"
    )
    parser.add_argument("--batch", type=count(1), default=1, help="batch size [1]")
    parser.add_argument(
        "--modes",
        type=one_of(MODES + DPO_MODES),
        default=",".join(MODES),
        help=f"comma-separated subset of {MODES + DPO_MODES} (dpo-*: one DPO step on pairs of LENGTH tokens)",
    )
    parser.add_argument("--chunk-size", type=count(1), default=4096, help="FPDT attention chunk size in tokens [4096]")
    parser.add_argument("--no-offload", action="store_true", help="hf_fpdt without host offload")
    parser.add_argument("--budget-gib", type=positive, default=1.0, help="memory budget for the 'longest fit' [1.0]")
    parser.add_argument("--device", type=device_name, default="auto", help="cpu, cuda or auto [auto]")
    parser.add_argument(
        "--dtype", type=dtype_name, default="auto", help="float32, bfloat16 or auto (fp32 on CPU, bf16 on CUDA)"
    )
    parser.add_argument("--threads", type=count(0), default=0, help="torch threads per point (0 = torch default)")
    parser.add_argument("--timeout", type=positive, default=1800.0, help="seconds per point [1800]")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=count(0),
        default=None,
        help="CPU: set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in every point's process, so freed large blocks "
        "return to the OS and RSS tracks live tensors rather than allocator retention (off by default)",
    )
    parser.add_argument(
        "--layers",
        type=counts(1, empty=True),
        default="",
        help="comma-separated decoder layer counts to compare (default: the model's)",
    )
    parser.add_argument(
        "--host-memory",
        type=byte_sizes,
        default="auto",
        help="comma-separated FPDTConfig.host_memory values for hf_fpdt (0, 64MiB, auto, unlimited) [auto]",
    )
    parser.add_argument(
        "--segments",
        type=counts(1, ("auto",)),
        default="auto",
        help="comma-separated FPDTConfig.checkpoint_segments values for hf_fpdt (1, 2, ..., auto) [auto]",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--point", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- one point (child process)


def _point_setup(args: argparse.Namespace) -> tuple:
    """A measured point's threads, device, dtype name and model config (``--layers`` applied)."""
    import torch

    from ..models.presets import load_model_config

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    cfg = load_model_config(args.model)
    if args.layers:
        cfg.num_hidden_layers = int(args.layers)
    return device, dtype_name, cfg


def _dpo_step(args: argparse.Namespace, mode: str, length: int, group=None) -> dict:
    """Peak memory of one DPO step of ``mode`` (a :data:`DPO_MODES` entry) in this process (an SP rank if
    ``group``): the policy and the reference, TRL's fused LM head on both (as its DPOTrainer adds them), the
    sigmoid loss of the per-sequence log-probability sums, backward."""
    import torch
    import torch.nn.functional as F
    from trl.trainer.utils import add_fused_lm_head

    import hf_fpdt

    from ..trainers.trl_fused_head import install_sp_fused_head
    from .common import PeakMemory, build_model, enable_checkpointing, parse_dtype

    device, dtype_name, cfg = _point_setup(args)
    policy = build_model(cfg, parse_dtype(dtype_name), device)
    ref = build_model(cfg, parse_dtype(dtype_name), device).eval().requires_grad_(False)
    if mode != "dpo-sdpa":
        fcfg = hf_fpdt.FPDTConfig(chunk_size=args.chunk_size, offload=not args.no_offload)
        for model in (policy, ref):
            hf_fpdt.apply(model, fcfg, group=group)
    enable_checkpointing(policy)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    if mode != "dpo-sdpa":  # as FPDTDPOTrainer installs it: hf_fpdt's tiled head (and SP sharding under a group)
        for model in (policy, ref):
            install_sp_fused_head(model, group, args.chunk_size)
    half = length // 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2 * args.batch, half), generator=gen).to(device)  # [chosen; rejected]
    labels = ids.clone()
    labels[:, : half // 4] = -100  # the prompt
    mask = torch.ones_like(ids)
    mask[args.batch :, half - half // 8 :] = 0  # the rejected completions are shorter: right padding, as TRL pads pairs
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        logps = policy(**batch, fused_lm_head=True).log_probs.sum(-1)
        with torch.no_grad():
            ref_logps = ref(**batch, fused_lm_head=True).log_probs.sum(-1)
        chosen, rejected = (logps - ref_logps).chunk(2)
        loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {
        "layers": cfg.num_hidden_layers,
        "host_memory": "-",
        "segments": "-",
        "mode": mode,
        "length": length,
        "host_store_bytes": 0,
        "batch": args.batch,
        "peak_bytes": int(mem.bytes or 0),
        "seconds": time.perf_counter() - t0,
        "loss": float(loss.detach()),
        "device": str(device),
        "dtype": dtype_name,
        "measure": mem.how,
    }


def _dpo_rank(rank: int, args: argparse.Namespace, length: int, out: str) -> None:
    """One SP rank of ``dpo-fpdt-sp2`` (spawned): its point written to ``out.<rank>``."""
    import torch.distributed as dist

    from ..distributed.groups import build_groups

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        point = _dpo_step(args, "dpo-fpdt-sp2", length, group=build_groups(2).sp)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(point, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure_dpo_sp2(args: argparse.Namespace, length: int) -> dict:
    """``dpo-fpdt-sp2``: two spawned ranks over gloo; the larger rank's peak (memory per rank)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "point")
        mp.spawn(_dpo_rank, args=(args, length, out), nprocs=2)
        points = []
        for rank in range(2):
            with open(f"{out}.{rank}") as f:
                points.append(json.load(f))
    return {**max(points, key=lambda p: p["peak_bytes"]), "rank_peaks": [p["peak_bytes"] for p in points]}


def _measure_point(args: argparse.Namespace, mode: str, length: int) -> dict:
    if mode == "dpo-fpdt-sp2":
        return _measure_dpo_sp2(args, length)
    if mode in DPO_MODES:
        return _dpo_step(args, mode, length)
    import torch

    import hf_fpdt

    from ..integrations.state import state_of
    from .common import PeakMemory, build_model, enable_checkpointing, parse_dtype

    device, dtype_name, cfg = _point_setup(args)
    model = build_model(cfg, parse_dtype(dtype_name), device)  # HF sdpa; apply switches it to fpdt
    host_memory = args.host_memory
    if mode == "fpdt":
        segments = "auto" if args.segments == "auto" else int(args.segments)
        fcfg = hf_fpdt.FPDTConfig(
            chunk_size=args.chunk_size,
            offload=not args.no_offload,
            host_memory=host_memory,
            checkpoint_segments=segments,
        )
        hf_fpdt.apply(model, fcfg)
    enable_checkpointing(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, length), device=device)
    pos = torch.arange(length, device=device).expand(args.batch, length)

    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, position_ids=pos).loss
        print(f"    forward done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    peak, how = mem.bytes or 0, mem.how
    host, planned = 0, {}
    if mode == "fpdt":  # what FPDT parks in its host stores: host memory on a GPU, part of the RSS on CPU
        state = state_of(model)
        host = state.runtime.store(device).host_bytes + state.layer_offloader.store(device).host_bytes
        planned = _planned(model, cfg, length, args, dtype_name, device)
    return {
        **planned,
        "layers": cfg.num_hidden_layers,
        "host_memory": host_memory if mode == "fpdt" else "-",
        "segments": args.segments if mode == "fpdt" else "-",
        "mode": mode,
        "length": length,
        "host_store_bytes": int(host),
        "batch": args.batch,
        "peak_bytes": int(peak),
        "seconds": time.perf_counter() - t0,
        "loss": float(loss.detach()),
        "device": str(device),
        "dtype": dtype_name,
        "measure": how,
    }


def _planned(model, cfg, length: int, args: argparse.Namespace, dtype_name: str, device) -> dict:
    """The planner's figures for this point (what the runtime followed), beside the measured ones."""
    from ..integrations.state import state_of
    from ..memory.planner import plan

    runtime = state_of(model).runtime
    budget = runtime.host_budget(device)
    k = runtime.config.checkpoint_segments
    p = plan(
        cfg,
        length,
        batch=args.batch,
        trainable_params=sum(q.numel() for q in model.parameters() if q.requires_grad),
        dtype=dtype_name,
        device=device.type,
        host_memory="unlimited" if budget is None else budget,
        chunk_size=args.chunk_size,
        offload=not args.no_offload,
        optimizer=False,
        search_longest=False,
        segments=runtime.checkpointing.segments if k == "auto" else k,  # what the runtime applied
    )
    return {
        "plan_segments": p.segments,
        "plan_peak_bytes": p.peak,
        "plan_replay_layers": p.replay_layers,
        "layer_input_bytes": p.layer_input,
        "host_budget_bytes": budget,
    }


# ----------------------------------------------------------------------------- driver (parent process)


def _child_argv(args: argparse.Namespace, mode: str, length: int) -> list[str]:
    argv = [sys.executable, "-m", "hf_fpdt.bench.memory", "--point", mode, str(length)]
    for opt in ("model", "batch", "chunk_size", "device", "dtype", "threads", "layers", "host_memory", "segments"):
        argv += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    if args.no_offload:
        argv.append("--no-offload")
    return argv


def _child_env(args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    return env


def _run_point(args: argparse.Namespace, mode: str, length: int) -> dict:
    where = {"mode": mode, "length": length, "layers": args.layers, "host_memory": args.host_memory}
    where["segments"] = args.segments
    try:
        proc = subprocess.run(
            _child_argv(args, mode, length),
            stdout=subprocess.PIPE,
            stderr=None,  # the child's progress lines go straight to the terminal
            text=True,
            timeout=args.timeout,
            env=_child_env(args),
        )
    except subprocess.TimeoutExpired:
        return {**where, "error": f"timed out after {args.timeout:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        # Out of memory shows up as a killed child (-9) or a RuntimeError: either way it did not fit.
        return {**where, "error": f"exit code {proc.returncode}"}
    return json.loads(lines[-1])


def longest_fit(points: list[dict], budget_bytes: float) -> tuple[int | None, int | None]:
    """(longest measured length within budget, linear-fit estimate of the longest length) for one mode."""
    ok = [p for p in points if "peak_bytes" in p]
    fits = [p["length"] for p in ok if p["peak_bytes"] <= budget_bytes]
    measured = max(fits) if fits else None
    if len(ok) < 2:
        return measured, None
    xs = [p["length"] for p in ok]
    ys = [p["peak_bytes"] for p in ok]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return measured, None
    longest = int((budget_bytes - (my - slope * mx)) / slope)
    return measured, longest if longest > 0 else None  # the fixed cost alone is over the budget: no length fits


def format_table(results: list[dict], modes: list[str], lengths: list[int]) -> str:
    """Markdown table: one row per length, peak GiB per mode, the sdpa / fpdt ratio, and how much of
    hf_fpdt's peak is its host stores (offloaded chunks and layer inputs: host, not device, memory on a GPU)."""
    by = {(r["mode"], r["length"]): r for r in results}
    ratio = ["sdpa / fpdt"] if set(MODES) <= set(modes) else []
    host = ["fpdt host-store GiB"] if "fpdt" in modes else []
    head = ["seq len"] + [f"{m} peak GiB" for m in modes] + ratio + host
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in lengths:
        cells = [str(n)]
        for m in modes:
            r = by.get((m, n), {})
            cells.append(f"{r['peak_bytes'] / GIB:.3f}" if "peak_bytes" in r else r.get("error", "-"))
        a, b = by.get(("sdpa", n), {}), by.get(("fpdt", n), {})
        if ratio:
            ok = "peak_bytes" in a and "peak_bytes" in b and b["peak_bytes"] > 0
            cells.append(f"{a['peak_bytes'] / b['peak_bytes']:.1f}x" if ok else "-")
        if host:
            cells.append(f"{b['host_store_bytes'] / GIB:.3f}" if "host_store_bytes" in b else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_dpo_table(results: list[dict], lengths: list[int]) -> str:
    """Markdown table of the DPO step: peak GiB per DPO mode (per rank at SP 2), and TRL's over FPDT's."""
    by = {(r["mode"], r["length"]): r for r in results}
    modes = [m for m in DPO_MODES if any(r["mode"] == m for r in results)]
    ratios = [m for m in modes if m != "dpo-sdpa"] if "dpo-sdpa" in modes else []
    head = ["tokens per pair"] + [f"{m} peak GiB" for m in modes] + [f"dpo-sdpa / {m}" for m in ratios]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in lengths:
        cells = [str(n)]
        for m in modes:
            r = by.get((m, n), {})
            cells.append(f"{r['peak_bytes'] / GIB:.3f}" if "peak_bytes" in r else r.get("error", "-"))
        base = by.get(("dpo-sdpa", n), {})
        for m in ratios:
            r = by.get((m, n), {})
            ok = "peak_bytes" in base and r.get("peak_bytes", 0) > 0
            cells.append(f"{base['peak_bytes'] / r['peak_bytes']:.1f}x" if ok else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def layer_growth_table(results: list[dict]) -> str:
    """Markdown table of hf_fpdt's points by (length, host_memory, checkpoint segments): peak per layer count,
    the growth per added layer against one layer input, the planner's worst prediction error, and the
    budget check (peak above the floor's, ``host_memory=0`` with the same segments, at the most layers,
    within the budget + 10%). ``segments`` is the setting, with the k the runtime applied (``auto``)."""
    ok = [r for r in results if r["mode"] == "fpdt" and "peak_bytes" in r]
    layers = sorted({r["layers"] for r in ok})
    by = {(r["length"], _setting(r), r["layers"]): r for r in ok}
    head = ["seq len", "host_memory", "segments", "layer input MiB"] + [f"peak L={n} MiB" for n in layers]
    head += [
        "per added layer MiB",
        "x layer input",
        "replay layers kept",
        "plan / measured",
        "over floor MiB",
        "budget",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length, setting in sorted({(r["length"], _setting(r)) for r in ok}):
        hm, seg = setting
        pts = [by[(length, setting, n)] for n in layers if (length, setting, n) in by]
        applied = "/".join(str(p.get("plan_segments", "?")) for p in pts)
        cells = [str(length), hm, f"{seg} (k={applied})", _mib(pts[0]["layer_input_bytes"])]
        cells += [_mib(by[(length, setting, n)]["peak_bytes"]) if (length, setting, n) in by else "-" for n in layers]
        lo, hi = pts[0], pts[-1]
        per = (hi["peak_bytes"] - lo["peak_bytes"]) / (hi["layers"] - lo["layers"]) if len(pts) > 1 else None
        cells += [_mib(per), f"{per / lo['layer_input_bytes']:.2f}x" if per is not None else "-"]
        cells.append(", ".join(f"{p['plan_replay_layers']}/{p['layers']}" for p in pts))
        ratios = [p["plan_peak_bytes"] / p["peak_bytes"] for p in pts if p["peak_bytes"]]
        cells.append(max(ratios, key=lambda x: abs(x - 1)).__format__(".2f") if ratios else "-")
        floor = by.get((length, ("0", seg), hi["layers"]))
        budget = hi.get("host_budget_bytes")
        over = hi["peak_bytes"] - floor["peak_bytes"] if floor is not None else None
        cells.append(_mib(over))
        if hm == "0":
            cells.append("floor")
        elif budget is None or floor is None:
            cells.append("unlimited" if budget is None else "-")
        else:
            cells.append(f"{'ok' if over <= 1.1 * budget else 'OVER'} (B={_mib(budget)})")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _setting(r: dict) -> tuple[str, str]:
    return str(r["host_memory"]), str(r.get("segments", "auto"))


def run(args: argparse.Namespace) -> int:
    """Measure every (mode, length) point in its own process and print the table."""
    if args.point:
        mode, length = args.point[0], int(args.point[1])
        print(json.dumps(_measure_point(args, mode, length)), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES + DPO_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES + DPO_MODES}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    layer_counts = [x for x in args.layers.split(",") if x] or [""]
    budgets = [x for x in args.host_memory.split(",") if x]
    segment_settings = [x for x in args.segments.split(",") if x]
    jobs = [
        (n, m, layers, hm if m == "fpdt" else "auto", k if m == "fpdt" else "auto")
        for n in lengths
        for layers in layer_counts
        for m in modes
        for hm in (budgets if m == "fpdt" else budgets[:1])
        for k in (segment_settings if m == "fpdt" else segment_settings[:1])
    ]
    results, t0 = [], time.perf_counter()
    for n, m, layers, hm, k in jobs:
        what = f"{m} seq={n}" + (f" layers={layers}" if layers else "")
        what += f" host_memory={hm} segments={k}" if m == "fpdt" else ""
        print(f"[{len(results) + 1}/{len(jobs)}] {what} ...", file=sys.stderr, flush=True)
        point = argparse.Namespace(**{**vars(args), "layers": layers, "host_memory": hm, "segments": k})
        r = _run_point(point, m, n)
        results.append(r)
        status = f"{r['peak_bytes'] / GIB:.3f} GiB in {r['seconds']:.1f}s" if "peak_bytes" in r else r["error"]
        print(f"    {status} (elapsed {time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    first = next((r for r in results if "peak_bytes" in r), {})
    print(
        f"# peak step memory (fwd+bwd, activation checkpointing), model={args.model} batch={args.batch} "
        f"device={first.get('device', '?')} dtype={first.get('dtype', '?')} measure={first.get('measure', '?')} "
        f"fpdt chunk_size={args.chunk_size} offload={not args.no_offload}"
        + (f" MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold is not None else "")
    )

    def first_group(r: dict) -> bool:  # the classic table: the first layer count and budget
        same_layers = not layer_counts[0] or str(r.get("layers")) == layer_counts[0]
        first_fpdt = _setting(r) == (budgets[0], segment_settings[0])
        return same_layers and (r["mode"] != "fpdt" or first_fpdt)

    classic = [m for m in modes if m in MODES]
    if classic:
        print(format_table([r for r in results if first_group(r) and r["mode"] in MODES], classic, lengths))
    if any(m in DPO_MODES for m in modes):
        print("\n# DPO step (policy fwd+bwd, reference fwd, TRL's fused LM head), length = tokens per pair")
        print(format_dpo_table([r for r in results if r["mode"] in DPO_MODES], lengths))
    if any("plan_peak_bytes" in r for r in results):
        print("\n# hf_fpdt per added layer, planner prediction, host budget")
        print(layer_growth_table(results))
    budget = args.budget_gib * GIB
    print(f"\n# longest sequence within {args.budget_gib:g} GiB")
    for m in modes:
        measured, fitted = longest_fit([r for r in results if r["mode"] == m], budget)
        fit = f"~{fitted} tokens (linear fit)" if fitted is not None else "no fit"
        print(f"{m}: measured {measured if measured is not None else 'none'}; {fit}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if all("peak_bytes" in r for r in results) else 1


if __name__ == "__main__":  # the per-point child process (and a standalone entry point)
    _parser = argparse.ArgumentParser(prog="python -m hf_fpdt.bench.memory", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
