"""``chunk_size="auto"`` and ``offload="auto"``: choices made from measurements of the machine.

Chunk size
----------
Per (query chunk, key/value chunk) block of ``c`` tokens, ``H`` heads of dimension ``D``, the forward and
backward attention do ``W = 12 * c^2 * D * H`` FLOPs (forward ``QK^T`` and ``PV``: ``4 c^2 D H``;
backward twice that), while the pipeline moves ``M = beta * c * D * H`` bytes over the host link for
it: forward fetches ``k_j, v_j`` (``2 * b * r`` bytes per element, ``b`` = bytes of the dtype,
``r = Hkv / H``), backward fetches ``q_j, o_j, dO_j`` (``3 * b``) and the float32 ``dq_j`` accumulator
(``4``). Transfer hides behind compute when ``W / F >= M / B``, with ``F`` the attention throughput
(FLOP/s) and ``B`` the one-way host-link bandwidth (bytes/s)::

    c >= kappa * F / B,        kappa = (2*b*r + 3*b + 4) / 12        (~1.2 for bf16 MHA, ~0.9 for GQA 8:1)

Heads and sequence parallelism cancel (both sides scale with ``H / P``), so ``c`` counts tokens of the
global sequence. The tuner measures ``F`` (a forward + backward block of the device's kernel at a probe
size, counted with the same 12 c^2 D H) and ``B`` (a pinned host-to-device copy; on CPU a memcpy),
caches both per device, and picks the smallest ``c`` above the bound, rounded up to a multiple of
``lcm(1024, sp_size)`` and clamped to ``[1024, 262144]``. If that chunk does not fit the memory budget
(``memory_fraction`` of free device memory, at ``(11 b + 16) * D * H / P`` bytes per chunk token: the
backward's ``k, v``, float32 ``dk, dv``, two in-flight sets of ``q, o, dO, dq`` and one block's
gradients), the largest chunk that fits is used instead: memory binds before overlap does.

On CPU there is no host link (host memory *is* device memory), so ``B`` is memcpy bandwidth and the rule
lands at the lower bound; it is kept for uniformity, and on CPU ``offload="auto"`` is off anyway.

Offload
-------
``offload="auto"`` keeps chunks resident on the device while they fit and offloads only the rest (SPPO's
two-level idea): the host store gets a device budget of ``resident_fraction`` of the free device memory
measured when the store is created (``torch.cuda.mem_get_info``), kept first come first served, so the
first chunks of the first layers stay on the device and the rest goes to pinned host memory. The
fraction leaves room for what free memory does not show yet at the first forward (optimizer states,
gradients, the rest of the step's activations); set ``offload=True`` if a step still runs out. On CPU it
resolves to no offloading: copying host memory to host memory only costs time.

Measurements are injectable (``Autotuner(measure_flops=..., measure_bandwidth=..., memory_info=...)``)
and cached on the :class:`Autotuner` instance, which :class:`hf_fpdt.runtime.FPDTRuntime` holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MIN_CHUNK = 1024
MAX_CHUNK = 262144
_PROBE = {  # device type -> (tokens, heads, head_dim) of the F probe
    "cuda": (8192, 16, 128),
    "cpu": (1024, 4, 64),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up: kernels, allocator
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype training runs in on ``device`` when nothing says otherwise (bf16 on GPUs, fp32 on CPU)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def measure_attention_flops(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> float:
    """``F``: FLOP/s of one non-causal ``block_forward`` + ``block_backward`` at a probe size.

    Counted as ``12 * c^2 * D * H`` per block, the convention of the chunk-size rule.
    """
    from .kernels import block_backward, block_forward

    c, h, d = _PROBE.get(device.type, _PROBE["cuda"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, c, h, d, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    scale = d**-0.5

    def block() -> None:
        out, lse = block_forward(q, k, v, False, scale, backend)
        block_backward(do, q, k, v, out, lse, False, scale, backend)

    with torch.no_grad():
        seconds = _best_seconds(block, device)
    return 12.0 * c * c * d * h / seconds


def measure_host_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """``B``: bytes/s of a host-to-device copy from pinned memory (CPU: a memcpy)."""
    if device.type == "cpu":
        nbytes = min(nbytes, 64 << 20)
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return nbytes / _best_seconds(lambda: dst.copy_(src), device)
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _best_seconds(lambda: dst.copy_(src, non_blocking=True), device)


def device_memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (CPU: ``MemAvailable`` and ``MemTotal`` of ``/proc/meminfo``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def overlap_kappa(elem_bytes: int, kv_ratio: float = 1.0) -> float:
    """``kappa`` of ``c >= kappa * F / B``: host-link bytes per element per 12 FLOPs (module docstring)."""
    return (2 * elem_bytes * kv_ratio + 3 * elem_bytes + 4) / 12.0


def attention_bytes_per_token(elem_bytes: int, width: int, sp_size: int = 1) -> float:
    """Device bytes the chunk pipeline holds per chunk token at its peak (backward), per rank."""
    return (11 * elem_bytes + 16) * width / sp_size


def pick_chunk_size(
    flops: float,
    bandwidth: float,
    *,
    elem_bytes: int,
    kv_ratio: float = 1.0,
    sp_size: int = 1,
    memory_budget: float | None = None,
    width: int = 4096,
    bounds: tuple[int, int] = (MIN_CHUNK, MAX_CHUNK),
) -> int:
    """The smallest multiple of ``lcm(1024, sp_size)`` with ``c >= kappa * F / B``, within ``bounds``,
    lowered to the largest that fits ``memory_budget`` bytes (when given) if it does not fit.
    """
    if flops <= 0 or bandwidth <= 0:
        raise ValueError(f"need positive measurements, got F={flops} FLOP/s and B={bandwidth} B/s")
    step = math.lcm(1024, sp_size)
    lo = step * math.ceil(bounds[0] / step)
    hi = max(lo, step * (bounds[1] // step))
    need = overlap_kappa(elem_bytes, kv_ratio) * flops / bandwidth
    c = min(hi, max(lo, step * math.ceil(need / step)))
    if memory_budget is not None:
        fits = memory_budget / attention_bytes_per_token(elem_bytes, width, sp_size)
        if c > fits:
            c = max(lo, step * int(fits // step))
    return c


@dataclass(frozen=True)
class Measurement:
    """What the tuner measured on one device: ``F`` (FLOP/s), ``B`` (bytes/s), free/total memory (bytes)."""

    flops: float
    bandwidth: float
    free_bytes: int
    total_bytes: int


@dataclass
class Autotuner:
    """Measures a device once and answers ``chunk_size="auto"`` / ``offload="auto"`` from it.

    Args:
        measure_flops: ``(device, dtype) -> F``; default :func:`measure_attention_flops`.
        measure_bandwidth: ``device -> B``; default :func:`measure_host_bandwidth`.
        memory_info: ``device -> (free, total)``; default :func:`device_memory_info`.
        memory_fraction: share of free memory the attention chunks may use (chunk-size bound).
        resident_fraction: share of free memory kept for resident chunks under ``offload="auto"``.
    """

    measure_flops: Callable[[torch.device, torch.dtype], float] = measure_attention_flops
    measure_bandwidth: Callable[[torch.device], float] = measure_host_bandwidth
    memory_info: Callable[[torch.device], tuple[int, int]] = device_memory_info
    memory_fraction: float = 0.25
    resident_fraction: float = 0.4
    _cache: dict = field(default_factory=dict, repr=False)

    def measure(self, device: torch.device, dtype: torch.dtype | None = None) -> Measurement:
        """``F``, ``B`` and memory of ``device`` (measured on first call per device and dtype, then cached)."""
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        key = (str(device), dtype)
        if key not in self._cache:
            free, total = self.memory_info(device)
            self._cache[key] = Measurement(
                float(self.measure_flops(device, dtype)), float(self.measure_bandwidth(device)), free, total
            )
        return self._cache[key]

    def measurements(self) -> dict[tuple[str, torch.dtype], Measurement]:
        """What has been measured so far, keyed by (device, dtype)."""
        return dict(self._cache)

    def measured_chunk_size(
        self,
        device: torch.device,
        *,
        sp_size: int = 1,
        dtype: torch.dtype | None = None,
        width: int = 4096,
        kv_ratio: float = 1.0,
    ) -> int:
        """The chunk size this device's measurements pick (tokens of the global sequence); see the module
        docstring. Ranks may measure differently: :func:`hf_fpdt.chunk_size.resolve_chunk_size` makes them agree.

        ``width`` = query heads x head dim, ``kv_ratio`` = key/value heads / query heads: hints for the
        memory bound and ``kappa`` (defaults are conservative for Llama-7B-like shapes).
        """
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        m = self.measure(device, dtype)
        budget = self.memory_fraction * m.free_bytes if m.free_bytes > 0 else None
        elem = torch.empty((), dtype=dtype).element_size()
        return pick_chunk_size(
            m.flops,
            m.bandwidth,
            elem_bytes=elem,
            kv_ratio=kv_ratio,
            sp_size=sp_size,
            memory_budget=budget,
            width=width,
        )

    def offload(self, device: torch.device) -> tuple[bool, int]:
        """``(offload, resident_bytes)`` for the host store of ``device`` (see the module docstring)."""
        device = torch.device(device)
        if device.type == "cpu":
            return False, 0
        free, _ = self.memory_info(device)
        return True, max(0, int(self.resident_fraction * free))


def resolve_offload(device: torch.device, tuner: Autotuner | None = None) -> tuple[bool, int]:
    """``offload="auto"`` for ``device``: ``(offload, resident_bytes)``."""
    return (tuner or Autotuner()).offload(device)
