"""Helpers the benchmarks share: models from a preset or HF config, model FLOPs, peaks, timing, memory, the
commands' argument types (a bad value is argparse's usage error: one line on stderr, exit code 2) and their
progress (a bar on a terminal, a line per finished measurement in a log).

Model FLOPs of one training step (forward + backward, recomputation not counted as useful work)::

    flops = 6 * N * T  +  6 * B * S^2 * (H * D) * L

* ``T = B * S`` tokens; ``N`` = parameters that multiply activations (every parameter except the input
  embedding, which is a lookup; with tied embeddings the shared matrix counts once, as the LM head).
* Attention: forward ``QK^T`` and ``PV`` cost ``2 * 2 * S^2 * (H*D)`` per layer, backward twice that,
  so forward + backward is ``3 * 2 * 2 * S^2 * (H*D)``; causal attention computes half of it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import format_bytes as _format_bytes
from ..config import parse_bytes

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device-name fragment, most specific first.
GPU_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (HF 5.x naming, older fallback)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def build_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM (``attn_implementation="sdpa"``) in training mode on ``device``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.train()


def matmul_params(model: nn.Module) -> int:
    """``N`` of the FLOP formula: all parameters but an untied input embedding."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if emb is not None and (out is None or out.weight is not emb.weight):
        total -= emb.weight.numel()
    return total


def step_flops(config, n_params: int, batch: int, seq_len: int) -> float:
    """Useful FLOPs of one forward + backward (see the module docstring)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    dense = 6.0 * n_params * batch * seq_len
    attention = 6.0 * batch * seq_len**2 * heads * head_dim * layers
    return dense + attention


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MatmulPeak:
    """Best FLOP/s seen for an ``n x n`` matmul in ``dtype`` on ``device``, over every :meth:`sample`.

    On a shared machine one reading is as noisy as the steps it divides; sampling between the timed
    steps and keeping the best gives the machine's capability, the right MFU denominator.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, n: int | None = None) -> None:
        self.device, self.n = device, n or (2048 if device.type == "cpu" else 8192)
        self._a = torch.randn(self.n, self.n, device=device).to(dtype)
        self._b = torch.randn(self.n, self.n, device=device).to(dtype)
        self._inner = 1 if device.type == "cpu" else 20
        self.best = 0.0
        torch.matmul(self._a, self._b)  # warm-up

    def sample(self, repeats: int = 1) -> float:
        """Time ``repeats`` more readings; returns the best FLOP/s so far."""
        for _ in range(repeats):
            synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(self._inner):
                torch.matmul(self._a, self._b)
            synchronize(self.device)
            self.best = max(self.best, 2.0 * self.n**3 * self._inner / (time.perf_counter() - t0))
        return self.best


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an ``n x n`` matmul in ``dtype`` on ``device`` over ``repeats`` readings."""
    return MatmulPeak(device, dtype, n).sample(repeats)


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """Dense bf16/fp16 peak of a known GPU and its name, or ``None`` (measure instead)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for fragment, flops in GPU_BF16_PEAKS:
            if fragment in name:
                return flops, f"{name} datasheet"
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The MFU denominator and where it came from (datasheet table on known GPUs, else measured)."""
    known = datasheet_peak(device, dtype)
    if known is not None:
        return known
    n = 2048 if device.type == "cpu" else 8192
    return measure_matmul_peak(device, dtype, n), f"measured {n}x{n} matmul"


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _maxrss_kib() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r // 1024 if sys.platform == "darwin" else r


class PeakMemory:
    """Peak memory of a region above what was allocated when it started.

    CUDA: ``max_memory_allocated`` (tensors only). CPU: growth of the process's resident-set peak
    (``VmHWM``, reset through ``/proc/self/clear_refs``); meaningful in a fresh process whose allocator
    returns large blocks to the OS (``MALLOC_MMAP_THRESHOLD_``, see :func:`run_child`), since otherwise
    freed pages stay resident and later peaks hide in them. Where ``VmHWM`` cannot be reset, growth of
    the lifetime peak (``ru_maxrss``), which only counts what rises above every earlier peak. ``how``
    names the measure; ``bytes`` is ``None`` where none is available.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None
        self.how = ""
        self._start = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self.how = "cuda max_memory_allocated"
        elif _reset_rss_peak():
            self._start = (_proc_status_kib("VmRSS") or 0) * 1024
            self.how = "VmHWM growth"
        else:
            self._start = _maxrss_kib() * 1024
            self.how = "ru_maxrss growth"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self.how == "VmHWM growth":
            hwm = _proc_status_kib("VmHWM")
            self.bytes = None if hwm is None else max(0, hwm * 1024 - self._start)
        else:
            self.bytes = max(0, _maxrss_kib() * 1024 - self._start)


def time_call(fn: Callable[[], None], device: torch.device, memory: bool = True) -> tuple[float, int | None]:
    """Wall seconds of ``fn()`` (device work included) and, with ``memory``, its peak memory above the start."""
    synchronize(device)
    if not memory:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t0, None
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        seconds = time.perf_counter() - t0
    return seconds, mem.bytes


def run_child(module: str, payload: dict, timeout: float = 3600.0) -> dict:
    """Run ``python -m module '<payload JSON>'`` in a fresh process; its last stdout line is JSON, returned.

    The child's glibc returns blocks of 64 KiB and more to the OS when freed (``MALLOC_MMAP_THRESHOLD_``),
    so its resident set tracks live tensors (see :class:`PeakMemory`).
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-m", module, json.dumps(payload)], capture_output=True, text=True, timeout=timeout, env=env
    )
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{module} child failed ({res.returncode}): {tail[0]}")
    return json.loads(lines[-1])


def machine_load() -> dict:
    """What else the machine runs, for figures that depend on it: the 1, 5 and 15 minute load averages (runnable
    and running tasks, this process's threads included), the CPU count and the CPUs this process may run on."""
    try:
        load = os.getloadavg()
    except OSError:  # no load average on this platform
        load = None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"loadavg": load, "cpu_count": os.cpu_count(), "usable_cpus": usable}


def format_load(load: dict) -> str:
    """``load 1/5/15 min 2.1 1.9 1.2 on 2 CPUs`` (the usable count where the affinity is narrower)."""
    cpus = (
        f"{load['usable_cpus']} of {load['cpu_count']}"
        if load["usable_cpus"] != load["cpu_count"]
        else load["cpu_count"]
    )
    avg = "n/a" if load["loadavg"] is None else " ".join(f"{v:.1f}" for v in load["loadavg"])
    return f"load 1/5/15 min {avg} on {cpus} CPUs"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with right-aligned columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_bytes(n: int | None) -> str:
    """``1.50 GiB`` style (:func:`hf_fpdt.config.format_bytes`), or ``n/a``."""
    return _format_bytes(n, none="n/a")


def parse_dtype(name: str) -> torch.dtype:
    """``bf16``/``bfloat16``, ``fp16``/``float16``, ``fp32``/``float32`` -> torch dtype."""
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
    }
    if name.lower() not in table:
        raise ValueError(f"unknown dtype {name!r}; use bf16, fp16 or fp32")
    return table[name.lower()]


def default_device() -> torch.device:
    """The first accelerator if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- argument types
# Each is an argparse ``type``: it checks one option's text when the command line is parsed, so a bad value is
# argparse's usage error (``python -m hf_fpdt.bench <command>: error: argument --x: ...``, exit code 2) before
# anything is built or measured. Comma lists keep their text (the commands split it; the memory command hands
# its options on to child processes as text and records them in its JSON).


def count(least: int = 1) -> Callable[[str], int]:
    """An int ``>= least``."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {raw!r}")
        return value

    return parse


def counts(least: int = 1, words: Sequence[str] = (), empty: bool = False) -> Callable[[str], str]:
    """A comma list of ints ``>= least`` (or one of ``words``), at least one unless ``empty``; the text itself."""
    what = f"comma-separated ints >= {least}" + (f" or {', '.join(words)}" if words else "")

    def parse(raw: str) -> str:
        items = [x.strip() for x in raw.split(",") if x.strip()]
        if not items and not empty:
            raise argparse.ArgumentTypeError(f"expected {what}, got {raw!r}")
        for item in items:
            if item.lower() in words:
                continue
            try:
                ok = int(item) >= least
            except ValueError:
                ok = False
            if not ok:
                raise argparse.ArgumentTypeError(f"expected {what}, got {raw!r}")
        return raw

    return parse


def fractions(low: float, high: float, low_open: bool = False) -> Callable[[str], str]:
    """A comma list of numbers in ``[low, high]`` (``(low, high]`` if ``low_open``), at least one; the text itself."""
    what = f"comma-separated numbers in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(raw: str) -> str:
        items = [x.strip() for x in raw.split(",") if x.strip()]
        try:
            values = [float(x) for x in items]
        except ValueError:
            values = []
        if not values or any(not (low < v <= high if low_open else low <= v <= high) for v in values):
            raise argparse.ArgumentTypeError(f"expected {what}, got {raw!r}")
        return raw

    return parse


def positive(raw: str) -> float:
    """A number ``> 0``."""
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {raw!r}")
    return value


def one_of(options: Sequence[str]) -> Callable[[str], str]:
    """A comma list of ``options``, at least one; the text itself."""

    def parse(raw: str) -> str:
        items = [x.strip() for x in raw.split(",") if x.strip()]
        if not items or any(x not in options for x in items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(options)}, got {raw!r}")
        return raw

    return parse


def byte_sizes(raw: str) -> str:
    """A comma list of host budgets (``0``, ``64MiB``, ``auto``, ``unlimited``: ``FPDTConfig.host_memory``)."""
    items = [x.strip() for x in raw.split(",") if x.strip()]
    try:
        if not items:
            raise ValueError(f"host_memory={raw!r}: give at least one budget")
        for item in items:
            parse_bytes(int(item) if item.isdigit() else item)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return raw


def dtype_name(raw: str) -> str:
    """``auto`` or a name :func:`parse_dtype` knows; the text itself (``auto`` in lower case)."""
    if raw.lower() == "auto":
        return "auto"
    try:
        parse_dtype(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return raw


def device_name(raw: str) -> str:
    """``auto`` or a torch device string (``cpu``, ``cuda``, ``cuda:1``); the text itself (``auto`` in lower case)."""
    if raw.lower() == "auto":
        return "auto"
    try:
        torch.device(raw)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N (a torch device) or auto, got {raw!r}") from None
    return raw


def model_name(raw: str) -> str:
    """A preset name, an HF ``config.json`` path or a model folder that
    :func:`~hf_fpdt.models.presets.load_model_config` reads; the text itself."""
    from ..models.presets import load_model_config

    try:
        load_model_config(raw)
    except (ValueError, OSError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return raw


# ----------------------------------------------------------------------------- progress


class Progress:
    """Progress of a long measurement, seen wherever the output goes.

    On a terminal: tqdm's bar on stderr with the time left (gone when closed). Where stdout is not a terminal (a
    pipe, a log file, CI), where a bar is not seen or only as carriage returns: one ``# ...`` line on stdout per
    finished measurement (``done(text)``), with the count and the elapsed seconds, so a log shows the run moving
    (the tables' comment lines start with ``#`` too). ``lines`` overrides the choice (tests).
    """

    def __init__(self, total: int, desc: str, unit: str, lines: bool | None = None) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.lines = not sys.stdout.isatty() if lines is None else lines
        self.start = time.perf_counter()
        # disable=None: tqdm shows the bar only where stderr is a terminal
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None)

    def note(self, text: str) -> None:
        """What runs now (the bar's postfix; nothing in a log)."""
        self.bar.set_postfix_str(text)

    def done(self, text: str) -> None:
        """One measurement finished: the bar moves; in a log, a line says which."""
        self.n += 1
        self.bar.update()
        if self.lines:
            elapsed = time.perf_counter() - self.start
            print(f"# {self.desc} [{self.n}/{self.total}] {text} ({elapsed:.0f} s elapsed)", flush=True)

    def close(self) -> None:
        self.bar.close()
