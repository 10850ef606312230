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
global sequence.

That bound alone ignores what every block costs besides its FLOPs and bytes: kernel launches, the
merge's elementwise kernels, the store's events and Python between launches. On an H100 that fixed cost
moved the best chunk from the bound's 6144 to 16384 (16% faster at 32K tokens). So the rule models the
attention time of one layer (forward + backward, per rank, ``e = D * H / P``) at sequence length ``S``
with ``n = ceil(S / c)`` chunks::

    T(c) = sum over off-diagonal blocks of (t0 + max(12 c_q c_k e / F, bytes_block / B))
         + sum over diagonal blocks     of (t0 + 6 c^2 e / F)
         + (2*b*r + 3*b) * c * e / B                      (backward's first fetch: nothing to hide it)

with ``t0`` the fixed seconds of one block (forward + backward), and picks the smallest multiple of
``lcm(1024, sp_size)`` within 1% of the lowest ``T`` over ``[1024, min(262144, S)]`` (:func:`pick_chunk_size`;
:func:`modelled_attention_seconds`). Without ``t0`` and for long sequences it lands at ``kappa * F / B``;
a fixed cost moves it up (fewer, larger blocks), the exposed first fetch moves it down. ``S`` is the
sequence of the first forward when the runtime resolves ``"auto"`` (``REFERENCE_SEQ_LEN`` when no length
is known, e.g. the plugin before any data).

The tuner measures ``F`` (a forward + backward block of the device's kernel at a probe size, counted with
the same 12 c^2 D H), ``B`` (a pinned host-to-device copy; on CPU a memcpy) and ``t0`` (the chunk pipeline
forward + backward over 8 tiny chunks, its modelled compute subtracted, per block;
:func:`measure_block_overhead`), caching them per device and dtype. If the pick does not fit the memory budget
(``memory_fraction`` of free device memory, at the planner's working set per chunk token,
:func:`hf_fpdt.memory.working_set.attention_working_set` with offload's fetched sets: for MHA at one rank
``((1 + d) (4 b + 4) + 3 b + 24) * D * H`` with ``d = PREFETCH_DEPTH``, ``15 b + 36`` for 2: the backward's
``k, v`` and ``q, o, dq`` sets, the current one and ``d`` in flight, float32 ``dk, dv``, the row's ``dq``, one
block's gradients, the kernel's float32 dq accumulator and two float32 ``dq`` puts held for their copies to the host;
under SP ``dO`` travels too), the candidates stop at
the largest chunk that fits: memory binds before speed does.

On CPU there is no host link (host memory *is* device memory), so ``B`` is memcpy bandwidth and the rule
lands near the lower bound; it is kept for uniformity, and on CPU ``offload="auto"`` is off anyway.

Offload
-------
``offload="auto"`` keeps chunks resident on the device while they fit and offloads only the rest (SPPO's
two-level idea): the host store gets a device budget of ``resident_fraction`` of the free device memory
measured when the store is created (``torch.cuda.mem_get_info``), kept first come first served, so the
first chunks of the first layers stay on the device and the rest goes to pinned host memory. The
fraction leaves room for what free memory does not show yet at the first forward (optimizer states,
gradients, the rest of the step's activations); set ``offload=True`` if a step still runs out. On CPU it
resolves to no offloading: copying host memory to host memory only costs time.

Measurements are injectable (``Autotuner(measure_flops=..., measure_bandwidth=..., measure_overhead=...,
memory_info=...)``)
and cached on the :class:`Autotuner` instance, which :class:`hf_fpdt.attention.runtime.FPDTRuntime` holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import AUTO_CHUNK_MAX, FPDTConfig
from ..memory.probes import device_memory_info
from ..memory.working_set import attention_working_set
from .chunked import TensorSource, chunked_attention_backward, chunked_attention_forward
from .kernels import resolve_backend
from .routes import block_backward, block_forward
from .runtime import FPDTRuntime

MIN_CHUNK = 1024
MAX_CHUNK = AUTO_CHUNK_MAX
REFERENCE_SEQ_LEN = 131072  # the sequence the chunk rule models when no length is known
TIE_TOLERANCE = 0.01  # the smallest chunk within this share of the best modelled time wins (less memory)
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


def measure_block_overhead(
    device: torch.device, dtype: torch.dtype, flops: float, backend: str | None = None, offload: bool | None = None
) -> float:
    """``t0``: fixed seconds per block (forward + backward) of the chunk pipeline, beside its FLOPs.

    Runs the chunk pipeline's forward and backward (:mod:`hf_fpdt.attention.chunked`, as plain functions: no autograd
    graph, so no checkpoint's saved-tensor hooks see it) over 8 chunks of 128 tokens (36 blocks, 2 heads of
    64: compute is small next to launches, events and Python), subtracts the modelled compute at ``flops``
    and divides by the blocks. The host store offloads as it would on ``device`` (CUDA: pinned copies on
    side streams) unless ``offload`` says otherwise.
    """

    chunk, n, heads, dim = 128, 8, 2, 64
    offload = device.type == "cuda" if offload is None else offload
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=offload, sp_size=1, backend=backend or "auto"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, n * chunk, heads, dim, generator=gen).to(device, dtype) for _ in range(4))
    scale = dim**-0.5

    def step() -> None:
        source = TensorSource([chunk] * n, heads, heads)
        _, stored = chunked_attention_forward(source, (q, k, v), runtime, scale, keep_for_backward=True)
        chunked_attention_backward(source, (), stored, do, runtime, scale)

    with torch.no_grad():
        seconds = _best_seconds(step, device)
    compute = 6.0 * heads * dim * (n * chunk) ** 2 / flops
    return max(0.0, (seconds - compute) / (n * (n + 1) // 2))


def attention_bytes_per_token(elem_bytes: int, width: int, sp_size: int = 1, kv_ratio: float = 1.0) -> float:
    """Device bytes the chunk pipeline holds per chunk token at its peak, per rank: the planner's working set
    (:func:`hf_fpdt.memory.working_set.attention_working_set`, with offload's fetched sets), per token."""
    per = 1 << 20  # linear in the chunk: evaluated at a large one, so its rounding up is negligible
    return attention_working_set(per, width=width, elem_bytes=elem_bytes, kv_ratio=kv_ratio, sp_size=sp_size) / per


def modelled_attention_seconds(
    c: int,
    *,
    seq_len: int,
    flops: float,
    bandwidth: float,
    fixed_s: float = 0.0,
    elem_bytes: int,
    kv_ratio: float = 1.0,
    width: int = 4096,
    sp_size: int = 1,
) -> float:
    """``T(c)``: modelled seconds of one attention layer's forward + backward on one rank (module docstring)."""
    e = width / sp_size
    b, r = elem_bytes, kv_ratio
    c = min(c, seq_len)
    n = math.ceil(seq_len / c)
    last = seq_len - c * (n - 1)

    def off_diagonal(cq: int, ck: int) -> float:
        return fixed_s + max(12.0 * cq * ck * e / flops, (2 * b * r * ck + (3 * b + 4) * cq) * e / bandwidth)

    def diagonal(cq: int) -> float:
        return fixed_s + 6.0 * cq * cq * e / flops

    full_rows = n - 1  # query chunks of c tokens, then the last one of `last`
    seconds = full_rows * (full_rows - 1) / 2 * off_diagonal(c, c) + full_rows * off_diagonal(last, c)
    seconds += full_rows * diagonal(c) + diagonal(last)
    return seconds + (2 * b * r + 3 * b) * c * e / bandwidth


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
    fixed_s: float = 0.0,
    seq_len: int | None = None,
) -> int:
    """The smallest multiple of ``lcm(1024, sp_size)`` within ``bounds`` whose modelled time
    (:func:`modelled_attention_seconds` at ``seq_len``, default ``REFERENCE_SEQ_LEN``) is within
    ``TIE_TOLERANCE`` of the best; candidates stop at the sequence (rounded up) and at the largest chunk
    that fits ``memory_budget`` bytes (when given), never below the lower bound.
    """
    if flops <= 0 or bandwidth <= 0 or fixed_s < 0:
        raise ValueError(f"need positive measurements, got F={flops} FLOP/s, B={bandwidth} B/s, t0={fixed_s} s")
    seq_len = seq_len or REFERENCE_SEQ_LEN
    step = math.lcm(1024, sp_size)
    lo = step * math.ceil(bounds[0] / step)
    hi = max(lo, step * (bounds[1] // step))
    hi = min(hi, max(lo, step * math.ceil(seq_len / step)))  # a chunk beyond the sequence changes nothing
    if memory_budget is not None:
        fits = memory_budget / attention_bytes_per_token(elem_bytes, width, sp_size, kv_ratio)
        hi = min(hi, max(lo, step * int(fits // step)))
    model = dict(flops=flops, bandwidth=bandwidth, fixed_s=fixed_s, elem_bytes=elem_bytes, kv_ratio=kv_ratio)
    times = {
        c: modelled_attention_seconds(c, seq_len=seq_len, width=width, sp_size=sp_size, **model)
        for c in range(lo, hi + 1, step)
    }
    best = min(times.values())
    return min(c for c, t in times.items() if t <= best * (1 + TIE_TOLERANCE))


@dataclass(frozen=True)
class Measurement:
    """What the tuner measured on one device: ``F`` (FLOP/s), ``B`` (bytes/s), free/total memory (bytes) and
    ``t0`` (``fixed_s``: fixed seconds per block, forward + backward)."""

    flops: float
    bandwidth: float
    free_bytes: int
    total_bytes: int
    fixed_s: float = 0.0


@dataclass
class Autotuner:
    """Measures a device once and answers ``chunk_size="auto"`` / ``offload="auto"`` from it.

    Args:
        measure_flops: ``(device, dtype) -> F``; default :func:`measure_attention_flops`.
        measure_bandwidth: ``device -> B``; default :func:`measure_host_bandwidth`.
        measure_overhead: ``(device, dtype, F) -> t0``; default :func:`measure_block_overhead`.
        memory_info: ``device -> (free, total)``; default :func:`device_memory_info`.
        memory_fraction: share of free memory the attention chunks may use (chunk-size bound).
        resident_fraction: share of free memory kept for resident chunks under ``offload="auto"``.
        backend: the kernel backend the measurements run (``None``: chosen by capability), the runtime's.
    """

    measure_flops: Callable[[torch.device, torch.dtype], float] = measure_attention_flops
    measure_bandwidth: Callable[[torch.device], float] = measure_host_bandwidth
    measure_overhead: Callable[[torch.device, torch.dtype, float], float] = measure_block_overhead
    memory_info: Callable[[torch.device], tuple[int, int]] = device_memory_info
    memory_fraction: float = 0.25
    resident_fraction: float = 0.4
    backend: str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def measure(self, device: torch.device, dtype: torch.dtype | None = None) -> Measurement:
        """``F``, ``B``, memory and ``t0`` of ``device`` (measured on first call per device and dtype, then cached)."""
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        key = (str(device), dtype)
        if key not in self._cache:
            free, total = self.memory_info(device)
            backend = {}
            if self.backend not in (None, "auto"):  # a named backend that cannot run here: the clear error now
                head_dim = _PROBE.get(device.type, _PROBE["cuda"])[2]
                backend = {"backend": resolve_backend(self.backend, device, dtype, head_dim)}
            flops = float(self.measure_flops(device, dtype, **backend))
            fixed = float(self.measure_overhead(device, dtype, flops, **backend))
            self._cache[key] = Measurement(flops, float(self.measure_bandwidth(device)), free, total, fixed)
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
        seq_len: int | None = None,
    ) -> int:
        """The chunk size this device's measurements pick (tokens of the global sequence); see the module
        docstring. Ranks may measure differently: :func:`hf_fpdt.data.chunk_size.resolve_chunk_size` makes them agree.

        ``width`` = query heads x head dim, ``kv_ratio`` = key/value heads / query heads: hints for the
        memory bound and ``kappa`` (defaults are conservative for Llama-7B-like shapes); ``seq_len``: global
        tokens of the sequence to model (``REFERENCE_SEQ_LEN`` when ``None``).
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
            fixed_s=m.fixed_s,
            seq_len=seq_len,
        )

    def offload(self, device: torch.device) -> tuple[bool, int]:
        """``(offload, resident_bytes)`` for the host store of ``device`` (see the module docstring)."""
        device = torch.device(device)
        if device.type == "cpu":
            return False, 0
        free, _ = self.memory_info(device)
        return True, max(0, int(self.resident_fraction * free))
