"""``python -m hf_fpdt.bench speed``: training-step speed of hf_fpdt against HF ``sdpa`` + checkpointing.

For every sequence length, the same randomly initialised model (a preset of :mod:`hf_fpdt.models.presets` or an
HF config path) is built once per variant: HF ``sdpa`` with activation checkpointing (the baseline) and
``hf_fpdt.apply`` + activation checkpointing for every requested chunk size x offload setting. After
``--warmup`` steps each, the variants are timed in interleaved rounds (one step of each per round, so a
noisy neighbour slows all of them alike) and the median of ``--steps`` rounds is reported;
``--sequential`` times one variant after the other with only its model alive (long sequences on a GPU).

A step is forward + backward of one batch (``labels = input_ids``, explicit ``position_ids``); no
optimizer (:mod:`hf_fpdt.bench.step`: the variant's model, the batch, the timed step). Columns:

* ``step s``: median wall seconds (device synchronised); ``tokens/s``: ``batch * seq_len / step s``.
* ``MFU``: model FLOPs per second over the peak, model FLOPs being (:mod:`hf_fpdt.bench.common`)
  ``6 * N * T + 6 * B * S^2 * H * D * L`` (causal attention counted as half of the ``S^2`` term;
  recomputation not counted). Peak: the datasheet dense bf16/fp16 peak of known GPUs, else the best
  reading of a large matmul in the same dtype on the same device, sampled between the timed rounds
  (printed above the table).
* ``peak mem``: memory use of the step above the resting state (weights, inputs, everything allocated
  before it). CUDA: ``max_memory_allocated`` over the timed steps (host pools are not device memory).
  CPU: the growth of the resident-set peak over the first step of the variant in a fresh child process
  whose allocator returns freed blocks (in-process numbers would hide in retained pages); host pools
  are part of it there, since host memory is the device's.
* ``xfer exposed``: share of the step the compute stream waited for host-to-device copies of the host
  store (CUDA events around every wait; see :class:`hf_fpdt.memory.host_store.TransferStats`); ``n/a`` on CPU and
  for the baseline. Layer inputs offloaded by activation checkpointing are not part of it.
* ``load``: the machine's 1-minute load average when the variant's timing ended (runnable tasks, this run's
  threads included; the header and the last line give the 1/5/15-minute averages and the CPU count). The
  ratios hold for the load they were measured under: on a machine with other busy processes every step
  slows, and the variants do not slow alike.
* ``vs sdpa``: step time over the baseline's at the same length.

``--compile`` adds each variant again under ``torch.compile`` (name ``+compile``) and a column with each variant's
first step (compilation included; the timed steps come after it).

``--sparsity 1,0.5,0.25`` adds one hf_fpdt variant per density of a block-random attention pattern
(:func:`hf_fpdt.attention.sparse_patterns.block_random`, blocks of one chunk, every layer; the FPDT paper's Table
4 in this project's terms) and three columns: ``density``, ``blocks`` (attention blocks one layer computes,
each way, out of the dense causal count: the kernel calls are these, forward and backward, as
``tests/unit/test_sparse_patterns.py`` counts) and ``fetched`` (bytes the host store brought back per step:
with ``--offload on``; on CPU the store hands its buffers over without a copy, but the bytes are the
ones a GPU would move). The dense variants show density 1 and the causal block count.

Each row is printed as soon as its variant is measured (interleaved: when its length is done;
``--sequential``: when the variant is); meanwhile a progress bar (tqdm, on stderr where it is a terminal) counts
the steps and estimates the time left, and where stdout is not a terminal (a pipe, a log file, CI) a ``# S=...``
line per finished step (variant, warm-up or timed, its seconds) and per peak-memory child says the run moves.
Rows printed before the MFU peak is final (CPU, sampled peak) use the best reading so far; ``--json PATH`` writes
every row with the final peak (median step seconds, every timed step, exposed transfer in seconds and as a share,
peak memory) and ``--plot PATH`` draws step time and MFU against sequence length per variant to a PNG (needs
matplotlib: ``pip install hf_fpdt[plot]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from ..data.chunk_size import chunk_hints
from ..models.presets import load_model_config
from .cli import add_length
from .common import (
    MatmulPeak,
    Progress,
    build_model,
    count,
    counts,
    datasheet_peak,
    default_device,
    device_name,
    dtype_name,
    format_bytes,
    format_load,
    fractions,
    machine_load,
    matmul_params,
    model_name,
    parse_dtype,
    positive,
    run_child,
    step_flops,
    synchronize,
    time_call,
)
from .step import Result, Variant, build, describe, free, make_batch, run_step, step_runtime, train_step

COLUMNS = [
    "seq_len",
    "impl",
    "chunk",
    "offload",
    "step s",
    "tokens/s",
    "MFU",
    "peak mem",
    "xfer exposed",
    "load",
    "vs sdpa",
]


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _offload_value(raw: str) -> bool | str:
    low = raw.strip().lower()
    if low in ("on", "true", "1", "yes"):
        return True
    if low in ("off", "false", "0", "no"):
        return False
    if low == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"expected on, off, auto or a comma list of them, got {raw!r}")


def _offloads(raw: str) -> str:
    """An argparse ``type``: a comma list of on/off/auto, at least one; the text itself."""
    items = _split(raw)
    if not items:
        raise argparse.ArgumentTypeError(f"expected on, off, auto or a comma list of them, got {raw!r}")
    for item in items:
        _offload_value(item)
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``speed`` subcommand's options."""
    parser.add_argument(
        "--model", type=model_name, default="small-llama", help="preset name or HF config path (default small-llama)"
    )
    add_length(parser, "seq_lens", counts(1), "4096", "comma-separated sequence lengths (default 4096)")
    parser.add_argument("--batch-size", type=count(1), default=1)
    parser.add_argument(
        "--chunk-size",
        type=counts(1, ("auto",)),
        default=None,
        help="hf_fpdt chunk size(s): comma list of token counts and/or 'auto' (default: FPDTConfig's)",
    )
    parser.add_argument(
        "--offload",
        type=_offloads,
        nargs="?",
        const="on",
        default=None,
        help="offload chunks to host: on, off, auto, or a comma list to time several (default: FPDTConfig's)",
    )
    parser.add_argument("--no-offload", dest="offload", action="store_const", const="off", help="same as --offload off")
    parser.add_argument(
        "--dtype", type=dtype_name, default=None, help="bf16, fp16 or fp32 (default: fp32 on CPU, bf16 otherwise)"
    )
    parser.add_argument(
        "--device", type=device_name, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--steps", type=count(1), default=5, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=count(0), default=1, help="untimed steps per variant first")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip HF sdpa")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time one variant after the other instead of interleaved rounds (one model alive at a time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=count(1), default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--verbose", action="store_true", help="also print every timed step's seconds")
    parser.add_argument(
        "--no-memory", dest="memory", action="store_false", help="CPU: skip the peak-memory child processes"
    )
    parser.add_argument(
        "--peak-tflops", type=positive, default=None, help="MFU denominator in TFLOP/s (default: datasheet or measured)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows (final MFU peak) as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="draw step time and MFU vs sequence length to a PNG (matplotlib)"
    )
    parser.add_argument(
        "--sparsity",
        type=fractions(0, 1, low_open=True),
        default=None,
        help="comma list of densities in (0, 1]: also time a block-random attention pattern at each "
        "(blocks of one chunk) and show blocks computed and bytes fetched per step",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time every variant under torch.compile (name +compile) and show each variant's first step "
        "(compilation included)",
    )


def variants(args: argparse.Namespace) -> list[Variant]:
    """The baseline (unless ``--no-baseline``) and one hf_fpdt variant per chunk size x offload."""
    chunks: list[int | str | None] = [None]
    if args.chunk_size:
        chunks = [c.lower() if c.lower() == "auto" else int(c) for c in _split(args.chunk_size)]
    offloads: list[bool | str | None] = [None]
    if args.offload is not None:
        offloads = [_offload_value(o) for o in _split(args.offload)]
    densities = [float(d) for d in _split(args.sparsity)] if getattr(args, "sparsity", None) else []
    if any(not 0 < d <= 1 for d in densities):
        raise ValueError(f"--sparsity {args.sparsity}: densities must be in (0, 1]")
    out = [Variant("sdpa+ckpt")] if args.baseline else []
    for c in chunks:
        for o in offloads:
            settings = {k: v for k, v in (("chunk_size", c), ("offload", o)) if v is not None}
            out.append(Variant("fpdt+ckpt", settings))
            out.extend(Variant("fpdt+sparse", settings, d) for d in densities)
    if getattr(args, "compile", False):
        out += [Variant(v.name + "+compile", v.fpdt, v.density, compile=True) for v in out]
    return out


def memory_point(payload: dict) -> dict:
    """Child process: peak memory of one step (the first, from a clean process) of one variant.

    ``payload``: ``model, dtype, device, seq_len, batch, seed, fpdt, density, threads`` (JSON-able).
    """
    device = torch.device(payload["device"])
    dtype = parse_dtype(payload["dtype"])
    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])
    model_config = load_model_config(payload["model"])
    variant = Variant("child", payload["fpdt"], payload.get("density"), payload.get("compile", False))
    model = build(variant, model_config, dtype, device, payload["seed"])
    runtime = step_runtime(model)
    if runtime is not None:  # resolve "auto" first: its probe is not part of the step
        runtime.global_chunk_size(device, **chunk_hints(model_config, dtype))
    batch = make_batch(model_config.vocab_size, payload["batch"], payload["seq_len"], device, payload["seed"])
    _, peak = time_call(lambda: train_step(model, batch), device)
    return {"peak_bytes": peak}


def _child_memory(args: argparse.Namespace, variant: Variant, seq_len: int, dtype: torch.dtype, device) -> int | None:
    payload = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "seq_len": seq_len,
        "batch": args.batch_size,
        "seed": args.seed,
        "fpdt": variant.fpdt,
        "density": variant.density,
        "compile": variant.compile,
        "threads": args.threads,
    }
    return run_child("hf_fpdt.bench.speed", payload)["peak_bytes"]


def _report_auto(model: nn.Module, result: Result, seq_len: int) -> None:
    tuner = getattr(step_runtime(model), "autotuner", None)
    if tuner is None:
        return
    for (dev, dt), m in tuner.measurements().items():
        print(
            f"# auto at S={seq_len} on {dev} ({dt}): F = {m.flops / 1e12:.3g} TFLOP/s, "
            f"B = {m.bandwidth / 1e9:.3g} GB/s, F/B = {m.flops / m.bandwidth:.0f} tokens, "
            f"t0 = {m.fixed_s * 1e3:.3g} ms per block, "
            f"free memory {format_bytes(m.free_bytes)} -> chunk {result.chunk}, offload {result.offload}"
        )


def _label(result: Result) -> str:
    """The variant as a log line names it: its name and the settings asked for."""
    settings = " ".join(f"{k} {v}" for k, v in (result.variant.fpdt or {}).items())
    density = f" density {result.variant.density:g}" if result.variant.density is not None else ""
    return result.variant.name + (f" ({settings})" if settings else "") + density


def _step_line(result: Result, which: str, seconds: float) -> str:
    """A log line of one finished step: the variant, which step, its seconds (or the variant's error)."""
    return f"{_label(result)} {which}: " + (f"{seconds:.3f} s" if result.error is None else result.error)


def measure_length(
    args: argparse.Namespace,
    model_config,
    seq_len: int,
    device,
    dtype,
    sampler: MatmulPeak | None = None,
    emit: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Build, warm up and time every variant at ``seq_len``; ``emit(result)`` as each one is final.

    Interleaved rounds by default (every variant's model alive at once); ``--sequential`` builds, times
    and frees one variant after the other (less memory: for long sequences on a GPU).
    """
    batch = make_batch(model_config.vocab_size, args.batch_size, seq_len, device, args.seed)
    groups = [[v] for v in variants(args)] if args.sequential else [variants(args)]
    results = []
    for group in groups:
        models, group_results = [], []
        # a bar over the group's steps with an estimate of the time left (on stderr where it is a terminal; gone
        # before the group's rows print), and in a log a line per finished step
        progress = Progress(len(group) * (args.warmup + args.steps), f"S={seq_len}", "step")
        for variant in group:
            result = Result(variant)
            progress.note(f"{variant.name} warm-up")
            model = build(variant, model_config, dtype, device, args.seed)
            for i in range(args.warmup):
                start = time.perf_counter()
                if result.error is None:
                    run_step(model, batch, device, result, timed=False)
                    result.first_s = time.perf_counter() - start if i == 0 else result.first_s
                progress.done(_step_line(result, f"warm-up {i + 1}/{args.warmup}", time.perf_counter() - start))
            group_results.append(result)
            models.append(model)
        for n in range(args.steps):
            progress.note(f"round {n + 1}/{args.steps}")
            for model, result in zip(models, group_results):
                start = time.perf_counter()
                if result.error is None:
                    run_step(model, batch, device, result, timed=True)
                progress.done(_step_line(result, f"timed {n + 1}/{args.steps}", time.perf_counter() - start))
            if sampler is not None:
                sampler.sample()  # the MFU peak, read between rounds (see MatmulPeak)
        progress.close()
        load = machine_load()["loadavg"]  # what else ran meanwhile (the 1-minute average covers the rounds)
        for model, result in zip(models, group_results):
            result.load = load
            describe(model, result, device, seq_len)
            _report_auto(model, result, seq_len)
            if args.verbose:
                times = " ".join(f"{t:.3f}" for t in result.seconds)
                print(f"# S={seq_len} {result.variant.name} chunk {result.chunk} offload {result.offload}: {times}")
        results.extend(group_results)
        del models, model
        free(device)
        for result in group_results:
            if device.type == "cpu" and args.memory and result.error is None:
                start = time.perf_counter()
                result.peak_bytes = _child_memory(args, result.variant, seq_len, dtype, device)
                if progress.lines:  # a child process of several seconds per variant: say so in a log too
                    took = time.perf_counter() - start
                    print(
                        f"# S={seq_len} {_label(result)} peak memory {format_bytes(result.peak_bytes)} ({took:.1f} s)",
                        flush=True,
                    )
            if emit is not None:
                emit(result)
    return results


def row(result: Result, seq_len: int, batch: int, flops: float, peak: float, base: float | None) -> list[str]:
    """The table row of one variant at one length (``base``: the baseline's median step seconds)."""
    t = result.median
    if t is None:
        cells = [result.error or "failed"] * 5
    else:
        cells = [
            f"{t:.3f}",
            f"{batch * seq_len / t:,.0f}",
            f"{flops / t / peak:.1%}",
            format_bytes(result.peak_bytes),
            f"{statistics.median(result.exposed):.1%}" if result.exposed else "n/a",
        ]
    ratio = f"{t / base:.2f}x" if t is not None and base else "-"
    load = f"{result.load[0]:.1f}" if result.load else "-"
    return [str(seq_len), result.variant.name, result.chunk, result.offload, *cells, load, ratio]


def rows(results: list[Result], seq_len: int, batch: int, flops: float, peak: float) -> list[list[str]]:
    """Table rows of one length."""
    base = next((r.median for r in results if r.variant.fpdt is None and r.median), None)
    return [row(r, seq_len, batch, flops, peak, base) for r in results]


SPARSE_COLUMNS = ["density", "blocks", "fetched"]  # with --sparsity
_WIDTHS = (8, 11, 6, 7, 8, 10, 6, 10, 12, 4, 7, 7, 9, 10, 10)  # minimum column widths of the streamed table


def _line(cells: list[str], columns: list[str] = COLUMNS) -> str:
    return "  ".join(c.rjust(max(w, len(h))) for c, w, h in zip(cells, _WIDTHS, columns))


def sparse_cells(result: Result) -> list[str]:
    """The ``--sparsity`` columns of one variant."""
    if result.variant.fpdt is None:
        return ["-", "-", "-"]
    density = "1" if result.variant.density is None else f"{result.variant.density:g}"
    fetched = format_bytes(int(statistics.median(result.fetched))) if result.fetched else "n/a"
    return [density, result.blocks, fetched]


def record(result: Result, seq_len: int, batch: int, flops: float, peak: float, base: float | None) -> dict:
    """One JSON row: what :func:`row` prints, as numbers, plus every timed step."""
    t = result.median
    return {
        "seq_len": seq_len,
        "impl": result.variant.name,
        "settings": result.variant.fpdt,
        "chunk": result.chunk,
        "offload": result.offload,
        "step_s": t,
        "steps_s": result.seconds,
        "tokens_per_s": batch * seq_len / t if t else None,
        "mfu": flops / t / peak if t else None,
        "peak_bytes": result.peak_bytes,
        "density": result.variant.density,
        "blocks": result.blocks,
        "fetched_bytes": statistics.median(result.fetched) if result.fetched else None,
        "exposed_transfer_s": statistics.median(result.exposed_s) if result.exposed_s else None,
        "exposed_transfer_share": statistics.median(result.exposed) if result.exposed else None,
        "vs_sdpa": t / base if t and base else None,
        "loadavg": result.load,
        "compile": result.variant.compile,
        "first_step_s": result.first_s,
        "error": result.error,
    }


def plot(report: dict, path: str) -> None:
    """Step time and MFU against sequence length, one line per variant (impl, chunk, offload), to a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hf_fpdt[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float, float]]] = {}
    for r in report["rows"]:
        if r["step_s"] is not None:
            label = r["impl"]
            if r["settings"] is not None:
                asked = r["settings"].get("chunk_size")
                chunk = f"auto ({r['chunk']})" if asked == "auto" else r["chunk"]
                label = f"{label} chunk {chunk} offload {r['offload']}"
            lines.setdefault(label, []).append((r["seq_len"], r["step_s"], 100 * r["mfu"]))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in lines.items():
        points.sort()
        xs = [p[0] for p in points]
        style = {"linestyle": "--", "color": "black"} if not label.startswith("fpdt") else {}
        ax_t.plot(xs, [p[1] for p in points], marker="o", label=label, **style)
        ax_m.plot(xs, [p[2] for p in points], marker="o", label=label, **style)
    for ax, ylabel in ((ax_t, "step time (s)"), (ax_m, "MFU (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_m.set_ylim(bottom=0)
    ax_m.legend(fontsize=7)
    fig.suptitle(
        f"{report['model']} on {report['device']} ({report['dtype']}, batch {report['batch']}); "
        f"MFU of {report['peak_flops'] / 1e12:.3g} TFLOP/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Measure and print the table (a row as each variant finishes); returns the exit status."""
    device = torch.device(args.device) if args.device and args.device != "auto" else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # the key the runtime's stores use
    auto = not args.dtype or args.dtype.lower() == "auto"
    dtype = (torch.float32 if device.type == "cpu" else torch.bfloat16) if auto else parse_dtype(args.dtype)
    model_config = load_model_config(args.model)
    seq_lens = [int(s) for s in _split(args.seq_lens)]
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so before minutes of measuring
        raise ValueError("--plot needs matplotlib: pip install 'hf_fpdt[plot]' (or pip install matplotlib)")
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler = None
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    elif (known := datasheet_peak(device, dtype)) is not None:
        peak, source = known
    else:
        sampler = MatmulPeak(device, dtype)
        sampler.sample(3)
        source = f"best {sampler.n}x{sampler.n} matmul, sampled between the timed rounds"
    probe = build_model(model_config, dtype, torch.device("meta"), args.seed)
    n_params = matmul_params(probe)
    del probe
    print(
        f"# model {args.model}: {n_params / 1e6:.1f}M matmul params, {dtype}, {device}, "
        f"batch {args.batch_size}, {args.warmup} warmup + {args.steps} timed steps (median), "
        f"threads {torch.get_num_threads()}, {format_load(machine_load())}",
        flush=True,
    )
    columns = COLUMNS + (SPARSE_COLUMNS if args.sparsity else []) + (["first step"] if args.compile else [])
    print(_line(columns, columns), "\n" + _line(["-" * len(c) for c in columns], columns), sep="", flush=True)
    measured: list[tuple[int, float, Result]] = []
    for seq_len in seq_lens:
        flops = step_flops(model_config, n_params, args.batch_size, seq_len)
        done: list[Result] = []

        def emit(result: Result, seq_len: int = seq_len, flops: float = flops, done: list = done) -> None:
            done.append(result)
            base = next((r.median for r in done if r.variant.fpdt is None and r.median), None)
            now = sampler.best if sampler is not None else peak
            cells = row(result, seq_len, args.batch_size, flops, now, base)
            cells += sparse_cells(result) if args.sparsity else []
            cells += [f"{result.first_s:.3f}" if result.first_s is not None else "-"] if args.compile else []
            print(_line(cells, columns), flush=True)
            measured.append((seq_len, flops, result))

        measure_length(args, model_config, seq_len, device, dtype, sampler, emit)
        synchronize(device)
    if sampler is not None:
        peak = sampler.sample(3)
    print(f"# MFU peak: {peak / 1e12:.3g} TFLOP/s ({source}); {format_load(machine_load())}", flush=True)
    if args.json or args.plot:
        bases = {s: r.median for s, _, r in measured if r.variant.fpdt is None and r.median}
        report = {
            "model": args.model,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "batch": args.batch_size,
            "matmul_params": n_params,
            "peak_flops": peak,
            "peak_source": source,
            "machine": machine_load(),
            "rows": [record(r, s, args.batch_size, f, peak, bases.get(s)) for s, f, r in measured],
        }
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=1)
            print(f"# wrote {args.json}", flush=True)
        if args.plot:
            plot(report, args.plot)
            print(f"# wrote {args.plot}", flush=True)
    return 0


if __name__ == "__main__":  # the peak-memory child: python -m hf_fpdt.bench.speed '<payload JSON>'
    print(json.dumps(memory_point(json.loads(sys.argv[1]))))
