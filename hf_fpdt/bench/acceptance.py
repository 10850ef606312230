"""``python -m hf_fpdt.bench acceptance``: everything hf_fpdt promises on a GPU, measured into one table (issue 22).

Parts (``--only part1,part2``; all by default):

* ``llama1b``: the llama-1b preset, HF sdpa + non-reentrant checkpointing against hf_fpdt + checkpointing with
  chunk ``auto`` (offload ``auto`` and ``on``) and fixed chunks (``--chunks``, offload on; the best of them is
  "best fixed"), at 32K, 64K, 128K, 256K tokens (sdpa until it runs out of memory; longer sdpa rows are then
  skipped). Per row: step time, tokens/s, MFU, peak GPU memory, host max RSS, the block kernel backend used,
  exposed transfer share, time against sdpa.
* ``8b``: the Llama-3.1-8B shape (random weights from the preset), LoRA r16 on every linear layer,
  checkpointing, one step at 128K, 256K, 512K and 1M (``checkpoint_segments="auto"``, which applies segments
  where one input per layer does not fit): s/step, MFU, GPU peak, host max RSS against the resolved
  ``host_memory`` budget, and the plan's prediction (:func:`hf_fpdt.memory.planner.plan`) beside the measurement;
  an sdpa row at 128K shows where HF stands.
* ``chunk``: ``chunk_size="auto"``'s pick against the best of a sweep of fixed chunks at one length (goal:
  within 5%).
* ``eval``: prefill time of ``generate()`` (the path ``bench eval`` measures; one new token) at 32K and 128K,
  HF sdpa against hf_fpdt.
* ``transfer``: the share of the step the compute stream waited for host-to-device copies (offload on), at 32K
  and 128K.

Each row runs in a worker process (one per part, a fresh one for each 8B row so its max RSS is its own and a
host out-of-memory kill takes only that row); an out-of-memory error or a killed worker is recorded in the row
and the command goes on. ``--budget-s`` bounds each part's wall time (default 540 s, so each command ends
inside 10 minutes): rows that do not start in time, and one that runs past it, get ``skipped: budget``. Rows are
printed as they finish (above a progress bar on a terminal); ``--out DIR`` (default:
``out/acceptance/<device>_<dtype>``, ``out/acceptance/quick`` for ``--quick``) receives ``acceptance.json``,
``acceptance.md`` and (with matplotlib) the PNG plots of ``bench speed`` per part, merged with rows earlier
commands wrote there (a row measured again replaces its old one), so several short commands build one table.

``--quick``: tiny shapes (the ``tiny-llama`` preset, lengths of a few chunks of 16 tokens; CPU or GPU, seconds),
one worker for every part: what CI runs so this never rots.

Memory columns of every row: ``GPU peak`` (``max_memory_allocated``), ``GPU reserved`` (``max_memory_reserved``: what
the caching allocator took from the device, fragmentation and blocks waiting on other streams included),
``alloc retries`` (``num_alloc_retries``: the allocator freed its cache and tried again, a sign of memory pressure),
``host pinned`` (the peak of pinned host memory torch's caching host allocator held, as it takes it: power-of-two
blocks), ``host pool`` (hf_fpdt's host stores at the end of the row, as the allocator takes them:
:attr:`hf_fpdt.memory.host_store.HostStore.host_bytes`). On CPU the first three are ``-``; ``host pool`` is the
pageable figure there (nothing is pinned).

MFU: model FLOPs of :func:`hf_fpdt.bench.common.step_flops` over the datasheet peak (measured matmul peak
where unknown); with LoRA the frozen weights get no weight gradient, so ``2 * N * T`` of its ``6 * N * T`` is
not counted.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import FPDTConfig
from ..data.chunk_size import chunk_hints
from ..integrations.state import state_of
from ..models.presets import load_model_config
from .cli import add_length
from .common import (
    _proc_status_kib,
    _reset_rss_peak,
    build_model,
    count,
    counts,
    datasheet_peak,
    default_device,
    device_name,
    dtype_name,
    format_bytes,
    matmul_params,
    measure_matmul_peak,
    one_of,
    parse_dtype,
    step_flops,
    time_call,
)

PARTS = ("llama1b", "8b", "chunk", "eval", "transfer")
DEFAULT_BUDGET_S = 540.0
K = 1024


@dataclass(frozen=True)
class Shapes:
    """Models and lengths of one run (full on a GPU, or ``--quick``)."""

    model: str
    big_model: str
    lora_rank: int
    lengths: tuple[int, ...]
    big_lengths: tuple[int, ...]
    big_segmented: tuple[int, ...]
    fixed_chunks: tuple[int, ...]
    sweep_chunks: tuple[int, ...]
    sweep_length: int
    eval_lengths: tuple[int, ...]
    transfer_lengths: tuple[int, ...]


FULL = Shapes(
    model="llama-1b",
    big_model="llama-3.1-8b",
    lora_rank=16,
    lengths=(32 * K, 64 * K, 128 * K, 256 * K),
    big_lengths=(128 * K, 256 * K, 512 * K),
    big_segmented=(1024 * K,),
    fixed_chunks=(16 * K, 32 * K),
    sweep_chunks=(4 * K, 8 * K, 16 * K, 32 * K, 64 * K),
    sweep_length=64 * K,
    eval_lengths=(32 * K, 128 * K),
    transfer_lengths=(32 * K, 128 * K),
)
QUICK = Shapes(
    model="tiny-llama",
    big_model="tiny-llama",
    lora_rank=4,
    lengths=(64,),
    big_lengths=(96,),
    big_segmented=(160,),
    fixed_chunks=(16, 32),
    sweep_chunks=(16, 32),
    sweep_length=80,
    eval_lengths=(64,),
    transfer_lengths=(64,),
)


def _seconds(raw: str) -> float:
    """A number of seconds ``>= 0`` (0: no row starts in time)."""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {raw!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``acceptance`` subcommand's options."""
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU or GPU, seconds): the CI run")
    parser.add_argument(
        "--only", type=one_of(PARTS), default=None, help=f"comma list of parts to run, of {', '.join(PARTS)} [all]"
    )
    parser.add_argument(
        "--budget-s",
        type=_seconds,
        default=DEFAULT_BUDGET_S,
        help=f"wall seconds per part (0: every row skipped) [{DEFAULT_BUDGET_S:g}]",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for acceptance.json/.md and plots, merged with its earlier rows "
        "[out/acceptance/<device>_<dtype>, or out/acceptance/quick]",
    )
    add_length(parser, "seq_lens", counts(), None, "comma list: the lengths of the chosen parts")
    parser.add_argument("--chunks", type=counts(), default=None, help="comma list: the fixed chunks / the chunk sweep")
    parser.add_argument(
        "--device", type=device_name, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--dtype", type=dtype_name, default=None, help="bf16, fp16 or fp32 (default: fp32 on CPU, bf16 otherwise)"
    )
    parser.add_argument(
        "--steps", type=count(1), default=None, help="timed steps per row (default: 2 up to 64K, then 1)"
    )
    parser.add_argument("--warmup", type=count(0), default=None, help="untimed steps per row (default: 1 up to 128K)")


def _ints(raw: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in raw.split(",") if x.strip()) if raw else None


def _parts(raw: str | None) -> list[str]:
    parts = [p.strip() for p in raw.split(",") if p.strip()] if raw else list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"--only {raw!r}: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    return parts


# ------------------------------------------------------------------------------------------- the rows


def _row(part: str, kind: str, model: str, impl: str, seq_len: int, **spec) -> dict:
    fpdt = spec.get("fpdt")
    offload = {True: "on", False: "off"}.get(fpdt.get("offload"), fpdt.get("offload")) if fpdt else None
    label = impl if fpdt is None else f"{impl} chunk={fpdt.get('chunk_size')} offload={offload}"
    if fpdt and fpdt.get("checkpoint_segments") not in (None, 1):
        label += f" segments={fpdt['checkpoint_segments']}"
    return {"part": part, "kind": kind, "model": model, "impl": impl, "seq_len": seq_len, "key": f"{label} S={seq_len}",
            "label": label, **spec}  # fmt: skip


def plan_rows(parts: list[str], shapes: Shapes, args: argparse.Namespace) -> list[dict]:
    """The rows of ``parts`` in the order they run (``args``: --seq-lens, --chunks overrides)."""
    lens, chunks = _ints(args.seq_lens), _ints(args.chunks)
    rows: list[dict] = []
    for part in parts:
        if part == "llama1b":
            for s in lens or shapes.lengths:
                rows.append(_row(part, "train", shapes.model, "sdpa", s))
                for offload in ("auto", True):
                    rows.append(
                        _row(part, "train", shapes.model, "fpdt", s, fpdt={"chunk_size": "auto", "offload": offload})
                    )
                for c in chunks or shapes.fixed_chunks:
                    rows.append(_row(part, "train", shapes.model, "fpdt", s, fpdt={"chunk_size": c, "offload": True}))
        elif part == "8b":
            big = {"lora": shapes.lora_rank, "plan": True, "fresh": shapes is FULL}
            first = (lens or shapes.big_lengths)[0]
            rows.append(_row(part, "train", shapes.big_model, "sdpa", first, **big))
            auto = {"chunk_size": "auto", "offload": "auto", "host_memory": "auto", "checkpoint_segments": "auto"}
            for s in lens or shapes.big_lengths:
                rows.append(_row(part, "train", shapes.big_model, "fpdt", s, fpdt=auto, **big))
            if lens is None:
                for s in shapes.big_segmented:  # "auto" applies segments where one input per layer does not fit
                    segs = auto if shapes is FULL else {**auto, "checkpoint_segments": 2, "host_memory": 0}
                    rows.append(_row(part, "train", shapes.big_model, "fpdt", s, fpdt=segs, **big))
        elif part == "chunk":
            s = (lens or (shapes.sweep_length,))[0]
            rows.append(_row(part, "train", shapes.model, "fpdt", s, fpdt={"chunk_size": "auto", "offload": True}))
            for c in chunks or shapes.sweep_chunks:
                rows.append(_row(part, "train", shapes.model, "fpdt", s, fpdt={"chunk_size": c, "offload": True}))
        elif part == "eval":
            for s in lens or shapes.eval_lengths:
                rows.append(_row(part, "prefill", shapes.model, "sdpa", s))
                rows.append(
                    _row(part, "prefill", shapes.model, "fpdt", s, fpdt={"chunk_size": "auto", "offload": "auto"})
                )
        elif part == "transfer":
            for s in lens or shapes.transfer_lengths:
                rows.append(_row(part, "train", shapes.model, "fpdt", s, fpdt={"chunk_size": "auto", "offload": True}))
    return rows


# ------------------------------------------------------------------------------------------- the worker


def _host_max_rss() -> int | None:
    hwm = _proc_status_kib("VmHWM")
    return None if hwm is None else hwm * 1024


def _gpu_total(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))


def measure(row: dict) -> dict:
    """Worker side: build the row's model, run its steps, return what was measured (an OOM is a result)."""
    from . import step

    device, dtype = torch.device(row["device"]), parse_dtype(row["dtype"])
    config = load_model_config(row["model"])
    variant = step.Variant(row["impl"], row.get("fpdt"))
    out: dict = {"error": None}
    _reset_rss_peak()
    model = None
    try:
        if row["kind"] == "prefill":
            return {**out, **_prefill(row, config, variant, device, dtype)}
        model = step.build(variant, config, dtype, device, 0)
        n_params = matmul_params(model)
        if row.get("lora"):
            model = _lora(model, row["lora"])
        runtime = step.step_runtime(model)
        if runtime is not None:  # resolve "auto" first: its probe is not part of the step
            runtime.global_chunk_size(device, **chunk_hints(config, dtype))
        batch = step.make_batch(config.vocab_size, 1, row["seq_len"], device, 0)
        result = step.Result(variant)
        _reset_memory_stats(device)
        for _ in range(row["warmup"]):
            if result.error is None:
                step.run_step(model, batch, device, result, timed=False)
        for _ in range(row["steps"]):
            if result.error is None:
                step.run_step(model, batch, device, result, timed=True)
        step.describe(model, result, device, row["seq_len"])
        out["error"] = result.error
        out["chunk"], out["offload"] = result.chunk, result.offload
        if result.seconds:
            t = statistics.median(result.seconds)
            flops = step_flops(config, n_params, 1, row["seq_len"])
            if row.get("lora"):
                flops -= 2.0 * n_params * row["seq_len"]  # frozen weights: no weight-gradient GEMMs
            out.update(step_s=t, steps_s=result.seconds, tokens_per_s=row["seq_len"] / t, mfu=flops / t / row["peak"])
            out["step_peak_bytes"] = result.peak_bytes
            if result.exposed:
                out["exposed_transfer_share"] = statistics.median(result.exposed)
                out["exposed_transfer_s"] = statistics.median(result.exposed_s)
        out.update(_memory_stats(device))
        if runtime is not None:
            out["host_pool_bytes"] = _host_pool_bytes(model, runtime, device)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            out["backend"] = runtime.kernel_backend(device, dtype, head_dim)
            out["host_budget_bytes"] = runtime.host_budget(device)
            out["segments"] = runtime.checkpointing.segments
            if row.get("plan") and result.error is None:
                out.update(_plan(row, config, runtime, device, dtype, out))
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not step.is_oom(err):
            raise
        out["error"] = "OOM"
    finally:
        out["host_max_rss_bytes"] = _host_max_rss()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _reset_memory_stats(device: torch.device) -> None:
    """Peaks and counters start at this row (CUDA: the device's and the pinned host allocator's)."""
    if device.type != "cuda":
        return
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.reset_accumulated_memory_stats(device)  # num_alloc_retries counts this row's
    reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if reset_host is not None:
        reset_host()


def _memory_stats(device: torch.device) -> dict:
    """The row's device peaks (allocated, reserved), allocator retries and pinned host peak; none on CPU."""
    if device.type != "cuda":
        return {}
    out = {
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device),
        "gpu_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
    }
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned = host_stats() if host_stats is not None else {}
    peak = pinned.get("allocated_bytes.peak", pinned.get("allocated_bytes.current"))
    if peak is not None:
        out["host_pinned_bytes"] = int(peak)
    return out


def _host_pool_bytes(model, runtime, device: torch.device) -> int:
    """Host bytes of the model's stores (the attention's chunks and the layer inputs), as the allocator takes them."""
    state = state_of(model)
    offloader = getattr(state, "layer_offloader", None)
    return runtime.store(device).host_bytes + (offloader.store(device).host_bytes if offloader is not None else 0)


def _plan(row: dict, config, runtime, device, dtype, out: dict) -> dict:
    """The planner's prediction for the row's step, beside the measurement."""
    from ..memory.planner import plan

    budget = out.get("host_budget_bytes")
    p = plan(
        config,
        row["seq_len"],
        lora_rank=row.get("lora") or None,
        dtype=dtype,
        device=device.type,
        device_memory=_gpu_total(device),
        host_memory="unlimited" if budget is None else budget,
        chunk_size=runtime.global_chunk_size(device),
        segments=runtime.checkpointing.segments,
        optimizer=False,
        search_longest=False,
    )
    return {"plan_device_peak_bytes": p.peak, "plan_host_bytes": p.host_kept, "plan_fits": p.fits}


def _prefill(row: dict, config, variant, device: torch.device, dtype: torch.dtype) -> dict:
    """Seconds of ``generate()`` with one new token over a random prompt (prefill dominates)."""
    import hf_fpdt

    from .step import step_runtime

    model = build_model(config, dtype, device, 0).eval()
    if variant.fpdt is not None:
        hf_fpdt.apply(model, FPDTConfig(**variant.fpdt))
    runtime = step_runtime(model)
    out: dict = {}
    if runtime is not None:  # resolve "auto" first: its probe is not part of the prefill
        out["chunk"] = str(runtime.global_chunk_size(device, **chunk_hints(config, dtype)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config.vocab_size, (1, row["seq_len"]), generator=gen).to(device)

    def go() -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False, use_cache=True, pad_token_id=0)

    _reset_memory_stats(device)
    for _ in range(row["warmup"]):
        go()
    seconds = [time_call(go, device, memory=False)[0] for _ in range(max(1, row["steps"]))]
    t = statistics.median(seconds)
    out.update(prefill_s=t, tokens_per_s=row["seq_len"] / t)
    out.update(_memory_stats(device))
    if runtime is not None:
        out["host_pool_bytes"] = _host_pool_bytes(model, runtime, device)
    return out


def worker() -> int:
    """``python -m hf_fpdt.bench.acceptance --worker``: one row JSON per stdin line, one result line each."""
    for line in sys.stdin:
        if line.strip():
            print("ROW " + json.dumps(measure(json.loads(line))), flush=True)
    return 0


# ------------------------------------------------------------------------------------------- the parent


@dataclass
class _Worker:
    """A worker process and the thread that reads its result lines."""

    proc: subprocess.Popen
    lines: queue.Queue
    stderr: object
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls) -> _Worker:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONUNBUFFERED="1")
        err = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "hf_fpdt.bench.acceptance", "--worker"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                if line.startswith("ROW "):
                    lines.put(json.loads(line[4:]))
            lines.put(None)  # end of output: the worker exited

        threading.Thread(target=read, daemon=True).start()
        return cls(proc, lines, err)

    def run(self, row: dict, timeout: float) -> dict:
        """The row's result; ``{"error": ...}`` when the worker died or ran past ``timeout``."""
        try:
            self.proc.stdin.write(json.dumps(row) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"error": f"worker died: {self._tail()}"}
        try:
            got = self.lines.get(timeout=max(timeout, 1.0))
        except queue.Empty:
            self.stop()
            return {"error": f"skipped: budget (stopped after {timeout:.0f} s)"}
        if got is None:
            self.proc.wait()
            code = self.proc.returncode
            why = " (killed: host out of memory?)" if code in (-9, 137) else ""
            return {"error": f"worker died ({code}){why}: {self._tail()}"}
        return got

    def _tail(self) -> str:
        self.stderr.seek(0)
        lines = [x for x in self.stderr.read().strip().splitlines() if x.strip()]
        return lines[-1][:300] if lines else "no output"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()


COLUMNS = ["part", "seq_len", "impl", "chunk", "offload", "backend", "step s", "tokens/s", "MFU", "GPU peak",
           "GPU reserved", "alloc retries", "host pinned", "host pool", "host max RSS", "xfer exposed", "vs sdpa",
           "note"]  # fmt: skip


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    return {"s": f"{value:.3f}", "pct": f"{value:.1%}", "bytes": format_bytes(value), "int": f"{value:,.0f}"}[kind]


def _note(r: dict) -> str:
    notes = []
    if r.get("error"):
        notes.append(r["error"])
    if r.get("plan_device_peak_bytes") is not None:
        budget = "unlimited" if r.get("host_budget_bytes") is None else format_bytes(r["host_budget_bytes"])
        notes.append(
            f"plan: GPU {format_bytes(r['plan_device_peak_bytes'])}, host {format_bytes(r['plan_host_bytes'])}"
            f"{'' if r.get('plan_fits') else ' (does not fit)'}; host budget {budget}"
        )
    if r.get("segments", 1) not in (1, None) and r.get("impl") == "fpdt":
        notes.append(f"segments k={r['segments']}")
    if r.get("prefill_s") is not None:
        notes.append(f"prefill {r['prefill_s']:.3f} s")
    return "; ".join(notes)


def cells(r: dict) -> list[str]:
    """One table row (the streamed line and the Markdown table share it)."""
    return [
        r["part"], str(r["seq_len"]), r["label"], str(r.get("chunk", "-")), str(r.get("offload", "-")),
        str(r.get("backend", "-")), _fmt(r.get("step_s") or r.get("prefill_s"), "s"),
        _fmt(r.get("tokens_per_s"), "int"),
        _fmt(r.get("mfu"), "pct"), _fmt(r.get("gpu_peak_bytes"), "bytes"), _fmt(r.get("gpu_reserved_bytes"), "bytes"),
        _fmt(r.get("alloc_retries"), "int"), _fmt(r.get("host_pinned_bytes"), "bytes"),
        _fmt(r.get("host_pool_bytes"), "bytes"), _fmt(r.get("host_max_rss_bytes"), "bytes"),
        _fmt(r.get("exposed_transfer_share"), "pct"), f"{r['vs_sdpa']:.2f}x" if r.get("vs_sdpa") else "-", _note(r),
    ]  # fmt: skip


def _vs_sdpa(rows: list[dict]) -> None:
    base = {(r["part"], r["seq_len"]): r.get("step_s") or r.get("prefill_s") for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        t, b = r.get("step_s") or r.get("prefill_s"), base.get((r["part"], r["seq_len"]))
        r["vs_sdpa"] = t / b if t and b else None


def chunk_summary(rows: list[dict]) -> dict | None:
    """``chunk_size="auto"``'s pick against the best fixed chunk of the ``chunk`` part (goal: within 5%)."""
    part = [r for r in rows if r["part"] == "chunk" and r.get("step_s")]
    auto = next((r for r in part if r["fpdt"]["chunk_size"] == "auto"), None)
    fixed = [r for r in part if r["fpdt"]["chunk_size"] != "auto"]
    if auto is None or not fixed:
        return None
    best = min(fixed, key=lambda r: r["step_s"])
    ratio = auto["step_s"] / best["step_s"]
    return {"seq_len": auto["seq_len"], "auto_chunk": auto.get("chunk"), "auto_step_s": auto["step_s"],
            "best_chunk": best["fpdt"]["chunk_size"], "best_step_s": best["step_s"], "ratio": ratio,
            "within_5pct": ratio <= 1.05}  # fmt: skip


def markdown(report: dict) -> str:
    """The results as Markdown: one table, then the chunk pick and the targets."""
    lines = [f"# hf_fpdt acceptance ({report['device_name']}, {report['dtype']})", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in report["rows"]]
    s = report.get("chunk_summary")
    if s:
        lines += ["", f"chunk_size auto at {s['seq_len']} tokens: picked {s['auto_chunk']} ({s['auto_step_s']:.3f} s); "
                  f"best fixed {s['best_chunk']} ({s['best_step_s']:.3f} s): {s['ratio']:.3f}x "
                  f"({'within' if s['within_5pct'] else 'NOT within'} 5%)"]  # fmt: skip
    shares = [r["exposed_transfer_share"] for r in report["rows"] if r.get("exposed_transfer_share") is not None]
    if shares:
        median = statistics.median(shares)
        lines += ["", f"exposed transfer share over {len(shares)} rows: median {median:.1%}, max {max(shares):.1%}"]
    lines += ["", "Targets (issue 22): fpdt <= 0.9x sdpa's step time at 32K-128K (llama-1b); >= 40% MFU at 256K "
              "(llama-1b), >= 50% on the 8B shape; 8B LoRA at 512K with host max RSS under its budget (1M with "
              "segments: stretch); chunk auto within 5% of the best fixed chunk.", ""]  # fmt: skip
    return "\n".join(lines)


def _plots(report: dict, out: Path) -> list[str]:
    if importlib.util.find_spec("matplotlib") is None:
        return []
    from .speed import plot

    written = []
    for part in ("llama1b", "8b"):
        rows = [
            {"impl": r["impl"] + "+ckpt", "settings": r.get("fpdt"), "chunk": r.get("chunk", "-"),
             "offload": r.get("offload", "-"), "seq_len": r["seq_len"], "step_s": r["step_s"], "mfu": r["mfu"]}
            for r in report["rows"] if r["part"] == part and r.get("step_s")
        ]  # fmt: skip
        if rows:
            path = out / f"acceptance_{part}.png"
            plot({**report, "model": part, "batch": 1, "rows": rows}, str(path))
            written.append(str(path))
    return written


def _merge(out: Path, rows: list[dict]) -> list[dict]:
    """Rows of earlier commands in ``out`` with this command's; a row measured again replaces its old one, a
    row this command skipped (budget) does not replace a measured one."""
    path = out / "acceptance.json"
    old = {(r["part"], r["key"]): r for r in (json.loads(path.read_text())["rows"] if path.exists() else [])}
    for r in rows:
        key = (r["part"], r["key"])
        skipped = str(r.get("error") or "").startswith("skipped")
        if not (skipped and key in old and not str(old[key].get("error") or "").startswith("skipped")):
            old[key] = r
    return list(old.values())


def _steps(seq_len: int, quick: bool, args: argparse.Namespace) -> tuple[int, int]:
    steps = args.steps if args.steps is not None else 1 if quick or seq_len > 64 * K else 2
    warmup = args.warmup if args.warmup is not None else 0 if quick or seq_len > 128 * K else 1
    return steps, warmup


def default_out(device_name: str, dtype: torch.dtype, quick: bool) -> str:
    """Where a run's table goes without ``--out``: one folder per device and dtype (their rows merge into one
    table, as the parts of one acceptance run should), ``quick`` apart; under ``out/``, which git ignores."""
    if quick:
        return os.path.join("out", "acceptance", "quick")
    slug = "".join(c if c.isalnum() or c in "-." else "-" for c in device_name).strip("-").lower()
    return os.path.join("out", "acceptance", f"{slug}_{str(dtype).removeprefix('torch.')}")


def run(args: argparse.Namespace) -> int:
    """Run the chosen parts row by row in workers; print, merge and write the results."""
    device = torch.device(args.device) if args.device not in (None, "auto") else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    auto = args.dtype in (None, "auto")
    dtype = parse_dtype(args.dtype) if not auto else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    shapes = QUICK if args.quick else FULL
    parts = _parts(args.only)
    known = datasheet_peak(device, dtype)
    peak, source = (
        known if known else (measure_matmul_peak(device, dtype, 512 if args.quick else 2048), "measured matmul")
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# acceptance on {name} ({device}, {dtype}); parts {', '.join(parts)}; budget {args.budget_s:g} s per part; "
          f"MFU peak {peak / 1e12:.3g} TFLOP/s ({source})", flush=True)  # fmt: skip
    todo = plan_rows(parts, shapes, args)
    common = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "peak": peak}
    for r in todo:
        r.update(common)
        r["steps"], r["warmup"] = _steps(r["seq_len"], args.quick, args)
    done: list[dict] = []
    # Rows can take minutes each: a bar (on a terminal) counts them; the rows print above it as they finish.
    bar = tqdm(total=len(todo), desc="acceptance", unit="row", disable=None, leave=False)
    worker: _Worker | None = None
    deadlines: dict[str, float] = {}
    sdpa_oom: dict[str, int] = {}
    for r in todo:
        bar.set_postfix_str(f"{r['part']} {r['impl']} {r['seq_len']}")
        deadline = deadlines.setdefault(r["part"], time.perf_counter() + args.budget_s)
        left = deadline - time.perf_counter()
        if left <= 0:
            got = {"error": "skipped: budget"}
        elif r["impl"] == "sdpa" and r["part"] in sdpa_oom and r["seq_len"] > sdpa_oom[r["part"]]:
            got = {"error": f"skipped: sdpa out of memory at {sdpa_oom[r['part']]}"}
        else:
            fresh = r.get("fresh") or (not args.quick and (done and done[-1]["part"] != r["part"]))
            if worker is not None and (fresh or not worker.alive):
                worker.stop()
                worker = None
            worker = worker or _Worker.start()
            got = worker.run(r, left)
            if r.get("fresh") or not worker.alive:
                worker.stop()
                worker = None
        row = {**r, **got}
        if row["impl"] == "sdpa" and row.get("error") and not row["error"].startswith("skipped"):
            sdpa_oom.setdefault(row["part"], row["seq_len"])
        done.append(row)
        bar.update()
        tqdm.write(" | ".join(cells(row)), file=sys.stdout)
        sys.stdout.flush()
    bar.close()
    if worker is not None:
        worker.stop()
    out = Path(args.out or default_out(name, dtype, args.quick))
    out.mkdir(parents=True, exist_ok=True)
    rows = _merge(out, done)
    _vs_sdpa(rows)
    report = {"device": str(device), "device_name": name, "dtype": str(dtype).removeprefix("torch."),
              "peak_flops": peak, "peak_source": source, "quick": args.quick, "rows": rows,
              "chunk_summary": chunk_summary(rows)}  # fmt: skip
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    (out / "acceptance.md").write_text(markdown(report))
    written = [str(out / "acceptance.json"), str(out / "acceptance.md"), *_plots(report, out)]
    print(f"# wrote {', '.join(written)}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(worker())
    sys.exit("usage: python -m hf_fpdt.bench acceptance [options] (this module's own entry is the row worker)")
