"""The trace and timeline of ``bench plan --trace`` checked against the H100 figures of 2026-11-22 (issue 50, item 4).

usage: python tests/scripts/trace_vs_h100.py --code PATH [--rows NAME,NAME] [--seq-len N] [--json]

``--code`` is the checkout whose ``hf_fpdt`` is traced: the code measured on the H100 on 2026-11-22 is the last
commit of 2026-11-21, ``7dab724`` (``git worktree add --detach ../wt-old 7dab724``); the current checkout works too.
The tracer is always this checkout's: its torch-only modules (``hf_fpdt/bench/trace*.py``, ``timeline.py``,
``gpus.py`` and what they import) are loaded by file under the package name ``_fpdt_tracer`` without running this
checkout's ``hf_fpdt/__init__.py``, and ``--code`` is put first on ``sys.path``, so ``import hf_fpdt`` is the traced
code and both live in one process. Each row builds the model as the run that measured it did (the traced code's
``bench.common.build_model``; for the 8B rows PEFT LoRA r16 on the seven linears, as ``gpu/probe_8b.py``), applies
``hf_fpdt.apply`` with the row's ``FPDTConfig`` (or not: HF sdpa) and non-reentrant checkpointing, and traces
forward + backward (no optimizer, as measured) at the row's length on an 80 GB device; the timeline times it on
the H100 row of ``bench/gpus.py`` as it is: nothing is fitted per row. Predicted vs measured, as each was measured:

* the ``llama-1b`` rows are the old ``python -m hf_fpdt.bench speed``'s (its chunk column says ``auto (6144)``, and
  its peaks fit no other definition): step, the median timed step; MFU, ``(6 N S + 6 S^2 h L) / (step x 989
  TFLOP/s)``; peak, ``max_memory_allocated`` over a step minus what was allocated at its start, which holds the
  previous step's gradients (freed by the step's ``zero_grad``): predicted, the trace's allocated peak less the
  weights and the trainable parameters' gradients.
* the 8B rows are ``gpu/probe_8b.py``'s: two steps per length, the faster one; GPU growth, ``max_memory_allocated``
  over both minus what was allocated before the first (two steps are traced; the second is timed); host,
  ``ru_maxrss``: predicted, the pinned (cached power-of-two blocks) and pageable host peak plus :data:`HOST_BASE`.
* busy: the compute stream's busy share (the profile of 2026-11-22: kernels 2.06 s of a 2.50 s step).

The old code's ``chunk_size="auto"`` measures the attention's FLOP/s and the host link on the device, which a
shape-only device cannot time: the llama-1b row takes the 6144 it picked on the H100, the 8B rows the rule at the
GPU table's rates (:func:`_measured_rates`).

Nothing here is a test: it prints the table (``--json``: one object per row). ``--seq-len`` replaces every row's
length (the suite's check of this script; the measured figures then do not apply and are not compared).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
import types
from pathlib import Path

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]  # this checkout: the tracer's
TRACER = "_fpdt_tracer"
PEAK = 989e12  # the scripts' MFU denominator (H100 dense bf16)
HOST_BASE = 3 * GIB  # assumed: Python, torch, CUDA's libraries and transformers in the process's RSS
L8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, max_position_embeddings=1 << 21, rope_theta=500000.0)  # fmt: skip

# name -> (script, model, variant, FPDTConfig kwargs, tokens, measured {step_s, mfu, peak_gib, host_gib, busy, oom})
K = 1024
ROWS = {
    "1b_sdpa_32K": ("speed", "llama-1b", "sdpa", None, 32 * K, dict(step_s=1.73, mfu=0.288, peak_gib=12.9)),
    "1b_sdpa_64K": ("speed", "llama-1b", "sdpa", None, 64 * K, dict(step_s=5.39, mfu=0.294, peak_gib=27.9)),
    "1b_sdpa_128K": ("speed", "llama-1b", "sdpa", None, 128 * K, dict(step_s=18.8, mfu=0.293, peak_gib=57.9)),
    "1b_sdpa_256K": ("speed", "llama-1b", "sdpa", None, 256 * K, dict(oom="device")),
    "1b_fpdt_auto_on_32K": ("speed", "llama-1b", "fpdt", dict(chunk_size=6144, offload=True), 32 * K,
                            dict(step_s=2.53)),
    "1b_fpdt_16K_off_32K": ("speed", "llama-1b", "fpdt", dict(chunk_size=16384, offload=False), 32 * K,
                            dict(step_s=2.13)),
    "1b_fpdt_16K_off_64K": ("speed", "llama-1b", "fpdt", dict(chunk_size=16384, offload=False), 64 * K,
                            dict(step_s=1.20 * 5.39, peak_gib=15.7)),
    "1b_fpdt_16K_on_32K": ("speed", "llama-1b", "fpdt", dict(chunk_size=16384, offload=True), 32 * K,
                           dict(step_s=2.36, peak_gib=2.3, busy=2.06 / 2.50)),
    "1b_fpdt_16K_on_64K": ("speed", "llama-1b", "fpdt", dict(chunk_size=16384, offload=True), 64 * K,
                           dict(step_s=1.31 * 5.39, peak_gib=4.8)),
    "1b_fpdt_32K_on_128K": ("speed", "llama-1b", "fpdt", dict(chunk_size=32768, offload=True), 128 * K,
                            dict(step_s=22.8, peak_gib=9.8)),
    "1b_fpdt_32K_on_256K": ("speed", "llama-1b", "fpdt", dict(chunk_size=32768, offload=True), 256 * K,
                            dict(step_s=82.0, mfu=0.249, peak_gib=19.8)),
    "8b_sdpa_32K": ("probe_8b", "l8b", "sdpa", None, 32 * K, dict(oom="device")),
    "8b_fpdt_32K": ("probe_8b", "l8b", "fpdt", dict(chunk_size="auto"), 32 * K,
                    dict(step_s=10.3, peak_gib=7.4, host_gib=30.0)),
    "8b_fpdt_64K": ("probe_8b", "l8b", "fpdt", dict(chunk_size="auto"), 64 * K,
                    dict(step_s=26.7, peak_gib=10.7, host_gib=59.0)),
    "8b_fpdt_128K": ("probe_8b", "l8b", "fpdt", dict(chunk_size="auto"), 128 * K, dict(oom="host")),
}  # fmt: skip
HOST_CAPACITY = 128 * GIB  # the 8B rows' machine
# steps traced per row, as measured: probe_8b's peak is over two steps from the memory allocated before the first
# (what the first step leaves allocated counts); bench speed's is one step's, from that step's start
STEPS = {"speed": 1, "probe_8b": 2}


def load_tracer() -> types.SimpleNamespace:
    """This checkout's tracer modules under :data:`TRACER` (see the module docstring)."""
    if TRACER not in sys.modules:
        package = types.ModuleType(TRACER)
        package.__path__ = [str(ROOT / "hf_fpdt")]  # a namespace: its __init__ (hf_fpdt's surface) is not run
        sys.modules[TRACER] = package
    names = ("trace_device", "trace_events", "trace", "timeline", "gpus")
    mods = {n: importlib.import_module(f"{TRACER}.bench.{n}") for n in names}
    return types.SimpleNamespace(**mods)


def _probes_skipped(stack) -> None:
    """The current code's attention probe blocks (numbers the trace does not compute) skipped where they exist, as
    ``bench plan --trace`` does; the old code has none (it picks torch's flash kernels on CUDA without a probe)."""
    from unittest import mock

    for module, attr, value in (
        ("hf_fpdt.attention.kernels", "prober", lambda device, dtype, head_dim: lambda name: None),
        ("hf_fpdt.attention.routes", "prober", lambda device, dtype, head_dim: lambda name: None),
        ("hf_fpdt.attention.routes", "probe_kinds", lambda router, device, dtype, head_dim: {}),
        ("hf_fpdt.attention.routes", "probe_cudnn_bias", lambda device, dtype, head_dim: None),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, attr):
            stack.enter_context(mock.patch.object(mod, attr, value))


def _measured_rates(stack, gpu) -> None:
    """The old code's ``chunk_size="auto"`` measures the attention's FLOP/s and the host link on the device (a
    shape-only device has no time): the GPU table's flash rate at head dim 128 (the old probe's shape) and pinned
    host-to-device rate instead, once for all rows. The current code has no such measurement."""
    from unittest import mock

    try:
        autotune = importlib.import_module("hf_fpdt.autotune")
    except ImportError:
        return
    measure = autotune.Autotuner.measure

    def with_rates(self, device, dtype=None):
        self.measure_flops = lambda device, dtype: gpu.attention_rate("flash", 128)
        self.measure_bandwidth = lambda device: gpu.pcie_pinned
        return measure(self, device, dtype)

    stack.enter_context(mock.patch.object(autotune.Autotuner, "measure", with_rates))


def _host_capacity(stack, capacity: int) -> None:
    """The current code's own host check made against the measured machine's host (128 GiB), where it has one."""
    from unittest import mock

    try:
        step_plan = importlib.import_module("hf_fpdt.integrations.step_plan")
        from hf_fpdt.memory.probes import HostLimits
    except ImportError:
        return
    limits = HostLimits(ram=capacity, address_space=None, cgroup=None)
    stack.enter_context(mock.patch.object(step_plan, "host_limits", lambda: limits))
    stack.enter_context(mock.patch.object(step_plan, "local_processes", lambda: 1))


def _model_config(model: str):
    from transformers import AutoConfig

    if model == "l8b":
        return AutoConfig.for_model("llama", **L8B)
    try:
        from hf_fpdt.bench.common import load_model_config  # the code of 2026-11-21
    except ImportError:
        from hf_fpdt.models.presets import load_model_config
    return load_model_config(model)


def _build(script: str, config, meta):
    """The model on the meta device as ``script`` built it (see the module docstring); hf_fpdt is applied later."""
    import torch

    from hf_fpdt.bench.common import build_model  # the traced code's: HF sdpa, bf16, use_cache off, training mode

    model = build_model(config, torch.bfloat16, meta)
    if script == "speed":
        return model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))


def _flops(config, tokens: int) -> float:
    """The scripts' FLOPs of one step: ``6 N S + 6 S^2 h L`` (N: the linears and the LM head)."""
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    n = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + h * vocab
    return 6 * n * tokens + 6 * tokens * tokens * h * layers


def trace_row(name: str, tracer, tokens: int | None = None) -> dict:
    """Trace row ``name`` of :data:`ROWS` with the code on ``sys.path`` (``tokens``: another length, not compared)."""
    import contextlib

    import torch

    import hf_fpdt

    script, model_name, variant, fpdt, length, measured = ROWS[name]
    if tokens is not None:
        length, measured = tokens, {}
    config = _model_config(model_name)
    start = time.perf_counter()
    log = tracer.trace_events.EventLog()
    gpu = tracer.gpus.gpu("h100")
    dev = tracer.trace_device.TraceDevice(log, total_memory=gpu.memory)
    model = _build(script, config, tracer.trace_device.META)
    error = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(dev)
        _probes_skipped(stack)
        _measured_rates(stack, gpu)
        _host_capacity(stack, HOST_CAPACITY)
        tracer.trace._to_device(dev, model)
        base = dev.allocator.allocated
        inner = model.base_model.model if script == "probe_8b" else model
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if variant == "fpdt":
            hf_fpdt.apply(inner, hf_fpdt.FPDTConfig(**fpdt))
        if script == "probe_8b":
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        else:
            from hf_fpdt.bench.common import enable_checkpointing

            enable_checkpointing(model)
        ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        ids, pos = ids.to("cuda"), torch.arange(length).unsqueeze(0).to("cuda")
        marks = [0]  # where each step's events begin
        try:
            for _ in range(STEPS[script]):
                loss = model(input_ids=ids, labels=ids, position_ids=pos).loss
                loss.backward()
                loss.item()
                model.zero_grad(set_to_none=True)
                loss = None
                marks.append(len(log.events))
        except torch.OutOfMemoryError as err:
            error = f"OutOfMemoryError: {str(err)[:120]}"
        except ValueError as err:  # the current code's own refusal of a step that does not fit
            error = str(err)[:200]
        loss = ids = pos = model = inner = None
        gc.collect()
    a = dev.allocator
    timeline = tracer.timeline.play(log.events[marks[-2] :] if len(marks) > 2 else log.events, gpu)  # the last step
    # bench speed's step starts with the previous step's gradients (freed by its zero_grad): its base holds them
    base += grads if script == "speed" else 0
    row = {
        "row": name, "script": script, "model": model_name, "variant": variant, "fpdt": fpdt, "seq_len": length,
        "step_s": timeline.step_s, "mfu": _flops(config, length) / (timeline.step_s * PEAK) if timeline.step_s else 0,
        "peak_gib": (a.peak_allocated - base) / GIB,
        "reserved_gib": a.peak_reserved / GIB,
        "weights_gib": base / GIB, "host_gib": (dev.host.pinned_reserved + dev.host.peak_pageable + HOST_BASE) / GIB,
        "busy": timeline.busy_share("compute"), "device_oom": a.failures > 0, "short_gib": a.short_by / GIB,
        "error": error, "kind_s": timeline.kind_s, "idle": timeline.top_idle(3), "syncs": timeline.host_syncs,
        "trace_s": time.perf_counter() - start, "measured": measured,
        "peak_holders": [[b / GIB, c, w, o] for b, c, w, o in dev.peak_holders()],
    }  # fmt: skip
    row["host_oom"] = row["host_gib"] > HOST_CAPACITY / GIB
    return row


def _cell(pred: float, meas: float | None, fmt: str) -> str:
    if meas is None:
        return fmt.format(pred)
    err = pred / meas - 1
    verdict = "" if abs(err) <= 0.2 else " (>20%)"
    return f"{fmt.format(pred)} / {fmt.format(meas)} ({100 * err:+.0f}%){verdict}"


def table(rows: list[dict]) -> str:
    headers = ["row", "tokens", "step pred / meas", "MFU pred / meas", "peak GiB pred / meas", "host GiB pred / meas",
               "busy pred / meas", "OOM pred / meas", "traced in"]  # fmt: skip
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        m = r["measured"]
        oom = "device" if r["device_oom"] else "host" if r["host_oom"] else "no"
        cells = [
            r["row"], str(r["seq_len"]),
            _cell(r["step_s"], m.get("step_s"), "{:.2f} s") if "oom" not in m else f"{r['step_s']:.2f} s",
            _cell(100 * r["mfu"], 100 * m["mfu"] if "mfu" in m else None, "{:.1f}%"),
            _cell(r["peak_gib"], m.get("peak_gib"), "{:.1f}"),
            _cell(r["host_gib"], m.get("host_gib"), "{:.1f}") if r["script"] == "probe_8b" else "-",
            _cell(100 * r["busy"], 100 * m["busy"] if "busy" in m else None, "{:.0f}%"),
            f"{oom} / {m.get('oom', 'no') if m else '-'}", f"{r['trace_s']:.0f} s",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", required=True, help="the checkout whose hf_fpdt is traced (e.g. 7dab724's worktree)")
    parser.add_argument("--rows", default="all", help=f"comma list of rows, or all: {', '.join(ROWS)}")
    parser.add_argument("--seq-len", type=int, help="every row at this length instead (the measured figures then do "
                        "not apply)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    args = parser.parse_args(argv)
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    code = Path(args.code).resolve()
    if not (code / "hf_fpdt" / "__init__.py").is_file():
        parser.error(f"--code {code}: no hf_fpdt package there")
    sys.path.insert(0, str(code))
    for mod in [m for m in sys.modules if m == "hf_fpdt" or m.startswith("hf_fpdt.")]:
        del sys.modules[mod]
    tracer = load_tracer()
    import hf_fpdt

    print(f"# traced code: {Path(hf_fpdt.__file__).parent}; tracer: {ROOT / 'hf_fpdt' / 'bench'}", file=sys.stderr)
    rows = []
    for name in names:
        print(f"# tracing {name} ...", file=sys.stderr, flush=True)
        row = trace_row(name, tracer, args.seq_len)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"# {name}: {json.dumps({k: row[k] for k in ('step_s', 'peak_gib', 'host_gib', 'busy', 'error')})}",
                  file=sys.stderr, flush=True)  # fmt: skip
    if not args.json:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
