"""FPDTConfig: the user-facing settings of hf_fpdt, with ``FPDT_*`` environment fallbacks.

Unset fields (``None``) are filled from the environment so that launchers (``accelerate launch``,
``torchrun``) can configure processes without code changes:

==================  ===========================  =========
field               environment variable         default
==================  ===========================  =========
``chunk_size``      ``FPDT_CHUNK_SIZE``          65536
``offload``         ``FPDT_OFFLOAD``             auto
``sp_size``         ``FPDT_SP_SIZE``             1
``ring_degree``     ``FPDT_RING_DEGREE``         auto
``mlp_chunks``      ``FPDT_MLP_CHUNKS``          2 x attention chunks
``loss_chunks``     ``FPDT_LOSS_CHUNKS``         2 x vocab / hidden
``offload_layer_inputs``  ``FPDT_OFFLOAD_LAYER_INPUTS``  True
``backend``         ``FPDT_BACKEND``             auto
``host_memory``     ``FPDT_HOST_MEMORY``         auto
``checkpoint_segments``  ``FPDT_CHECKPOINT_SEGMENTS``  auto
``device_memory``   ``FPDT_DEVICE_MEMORY``       auto
``sync_copies``     ``FPDT_SYNC_COPIES``         False
``sync_exchanges``  ``FPDT_SYNC_EXCHANGES``      False
``cpu_threads``     ``FPDT_CPU_THREADS``         auto
==================  ===========================  =========

``chunk_size`` counts tokens of the *global* sequence per chunk; each rank of a sequence-parallel group
of size P contributes ``chunk_size // P`` tokens to every chunk. ``chunk_size="auto"`` and
``offload="auto"`` are accepted and resolved from measurements (see ``hf_fpdt.attention.autotune``).
``backend="auto"`` picks the fastest block kernel the device can run (``hf_fpdt.attention.kernels``); a named one
that cannot run there is a ``ValueError`` at the first forward.

``host_memory`` bounds what hf_fpdt keeps on the host across layers (layer inputs, the attention's replay
chunks, its pools): bytes (``2**36``) or a size with a unit (``"64GiB"``, ``"500MB"``; K/M/G/T and
KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal); ``"auto"``, a safe share of the RAM available when the
first step starts, divided among the processes of the node (resolved by ``FPDTRuntime.host_budget``);
``0``, the floor (only each layer's input survives until backward; recomputation computes attention
again); or ``"unlimited"`` (every layer keeps its replay chunks; no check). See :mod:`hf_fpdt.memory.planner`.

``device_memory`` is the device tier above it: device bytes that layer inputs and replay chunks may keep
on the device across layers before they go to the host (one budget for both, the last layers' first;
see :mod:`hf_fpdt.memory.checkpointing`). Same forms; ``"auto"`` is what the device's free memory leaves after
the step's planned working set (:func:`hf_fpdt.memory.planner.plan`), and 0 with ``offload=True`` (everything
offloaded, as asked); ``0`` sends everything to the host; ``"unlimited"`` keeps everything on the device.
On CPU the device is the host: nothing is copied and the budget has no effect.

``sync_copies`` is a debug switch: every device<->host copy of the host store and the layer-input offloader
is followed by a synchronisation of the device, so nothing overlaps. A run with it must give bit-identical
results to the asynchronous run; a difference is a missing stream/event dependency (a race). Slow: for
checks only (``FPDT_SYNC_COPIES=1 pytest tests/gpu``).

``ring_degree`` is R, the ring beside Ulysses: an SP group of P ranks runs as R Ulysses groups of U = P / R ranks
(each splits the heads over its U ranks, and holds a share of the sequence), whose key/value chunks travel round
the ring of the R groups (:mod:`hf_fpdt.attention.ring`). ``"auto"`` (the default): R = 1 (Ulysses alone) where P is
at most the query heads, else the smallest divisor R of P with P / R at most the query heads
(:func:`sp_degrees`). An integer must divide P. The data layout follows it (:mod:`hf_fpdt.data.chunks`).

``sync_exchanges`` runs the sequence-parallel all-to-alls of the chunked attention in the synchronous order: each
one waited where it is issued. By default (``False``) they overlap the compute, one chunk ahead (chunk i+1's q/k/v
and chunk i's output travel while chunk i computes; in backward chunk i's ``dq, dk, dv`` while row i+1 computes;
:mod:`hf_fpdt.attention.chunked`). Both orders give bit-identical results; the switch is for comparisons and
benchmarks (``python -m hf_fpdt.bench exchange``). Every SP rank must hold the same value (the ranks agree on it
at each step: the order of the collectives depends on it). No effect at ``sp_size`` 1.

``cpu_threads`` is the torch thread count of the chunked pieces on CPU, decided once when the runtime is made:
a positive integer, or ``"auto"``, the CPUs of the process's affinity capped by its cgroup's CPU quota, divided
among the node's ``LOCAL_WORLD_SIZE`` processes, never above torch's own count (see
:mod:`hf_fpdt.attention.threads`). No effect on other devices.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

ChunkSize = int | str
Offload = bool | str
HostMemory = int | str

HOST_MEMORY_WORDS = ("auto", "unlimited")
IGNORE_INDEX = -100  # the label HF's losses skip (padding, prompts, the last position after the shift)
BACKENDS = ("cudnn", "flash_attn3", "flash_attn", "torch_flash", "cpu_flash", "math")  # see hf_fpdt.attention.kernels
GIB = 1 << 30
AUTO_CHUNK_MAX = 262144  # the largest chunk chunk_size="auto" picks (attention.autotune's rule, the planner's bound)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def check_sp_heads(heads: int, kv_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``heads`` attention heads (``kv_heads`` key/value heads) split over ``sp_size``
    ranks: every rank needs at least one query head, so ``1 <= sp_size <= heads``. Any size in that range runs:
    the heads split as evenly as they go and the key/value heads follow their query heads
    (:mod:`hf_fpdt.data.head_split`). The rule of one Ulysses group; an SP group beyond the heads is a ring of such
    groups (:func:`sp_degrees`)."""
    if isinstance(sp_size, int) and not isinstance(sp_size, bool) and 1 <= sp_size <= heads:
        return
    even = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    if isinstance(sp_size, int) and sp_size > heads:
        nearest = f"use at most {heads} (one query head per rank); the even splits are {', '.join(map(str, even))}"
    else:
        nearest = f"use 1 to {heads}"
    raise ValueError(
        f"sp_size={sp_size}: the model's {heads} attention heads ({kv_heads} key/value heads) cannot be split over "
        f"{sp_size} ranks: sequence parallelism (Ulysses) gives every rank at least one query head; {nearest}"
    )


def sp_degrees(heads: int, kv_heads: int, sp_size: int, ring_degree: int | str = "auto") -> tuple[int, int]:
    """``(U, R)``: the Ulysses degree (ranks splitting the heads) and the ring degree of an SP group of ``sp_size``
    ranks, ``U * R = sp_size``. ``ring_degree="auto"``: R = 1 where ``sp_size <= heads``, else the smallest divisor R
    of ``sp_size`` with ``sp_size / R <= heads``. An integer R must divide ``sp_size`` and leave ``U <= heads``
    (:func:`check_sp_heads`). Raises ``ValueError`` naming ``ring_degree`` and the values that work. The one rule
    of the runtime, ``apply``, the data layout and the planner."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        check_sp_heads(heads, kv_heads, sp_size)  # raises, naming sp_size
    divisors = [r for r in range(1, sp_size + 1) if sp_size % r == 0]
    valid = [r for r in divisors if sp_size // r <= heads]
    if ring_degree == "auto":
        ring = valid[0] if sp_size > heads else 1  # valid is never empty: R = sp_size leaves U = 1
        return sp_size // ring, ring
    if isinstance(ring_degree, bool) or not isinstance(ring_degree, int) or ring_degree not in valid:
        why = "use 'auto' or a positive integer"
        if ring_degree in divisors and not isinstance(ring_degree, bool):
            why = f"it leaves {sp_size // ring_degree} ranks to split the model's {heads} attention heads (Ulysses)"
        elif isinstance(ring_degree, int) and not isinstance(ring_degree, bool) and ring_degree >= 1:
            why = f"it does not divide sp_size={sp_size}"
        raise ValueError(
            f"ring_degree={ring_degree!r} (FPDTConfig.ring_degree / FPDT_RING_DEGREE): {why}; at sp_size={sp_size} "
            f"with {heads} attention heads use 'auto' or one of {', '.join(map(str, valid))}"
        )
    return sp_size // ring_degree, ring_degree


def format_bytes(n: int | None, none: str = "unlimited") -> str:
    """``n`` bytes for people: ``"1.50 GiB"``, ``"12.0 MiB"``; ``None`` is ``none`` (a budget's "unlimited")."""
    if n is None:
        return none
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def parse_bytes(raw: int | str, name: str = "host_memory") -> HostMemory:
    """``raw`` as a number of bytes (``"64GiB"`` -> 68719476736), or ``"auto"`` / ``"unlimited"``.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000; ``K``, ``KiB`` ... ``T``, ``TiB`` powers of 1024.
    """
    if isinstance(raw, bool):
        raise ValueError(f"{name}={raw!r}: use a number of bytes, a size like '64GiB', 'auto', 'unlimited' or 0")
    if isinstance(raw, int):
        if raw < 0:
            raise ValueError(f"{name}={raw}: a budget cannot be negative; use 0 for the floor or 'unlimited'")
        return raw
    if isinstance(raw, str):
        low = raw.strip().lower()
        if low in HOST_MEMORY_WORDS:
            return low
        m = _SIZE.match(raw)
        if m:
            number, prefix, binary, _ = m.groups()
            base = _UNITS[prefix.lower()]
            if prefix and not binary and m.group(4):  # KB, MB, GB, TB: decimal
                base = 1000 ** ("kmgt".index(prefix.lower()) + 1)
            return int(float(number) * base)
    raise ValueError(
        f"{name}={raw!r}: use a number of bytes, a size with a unit ('64GiB', '500MB'), 'auto', 'unlimited' or 0"
    )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


ENV_NAMES = {  # FPDTConfig field -> the environment variable that fills it when unset (every FPDT_* hf_fpdt reads)
    "chunk_size": "FPDT_CHUNK_SIZE",
    "offload": "FPDT_OFFLOAD",
    "sp_size": "FPDT_SP_SIZE",
    "ring_degree": "FPDT_RING_DEGREE",
    "mlp_chunks": "FPDT_MLP_CHUNKS",
    "loss_chunks": "FPDT_LOSS_CHUNKS",
    "offload_layer_inputs": "FPDT_OFFLOAD_LAYER_INPUTS",
    "backend": "FPDT_BACKEND",
    "host_memory": "FPDT_HOST_MEMORY",
    "checkpoint_segments": "FPDT_CHECKPOINT_SEGMENTS",
    "device_memory": "FPDT_DEVICE_MEMORY",
    "sync_copies": "FPDT_SYNC_COPIES",
    "sync_exchanges": "FPDT_SYNC_EXCHANGES",
    "cpu_threads": "FPDT_CPU_THREADS",
}


def _env_bool_or_auto(name: str, raw: str) -> Offload:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low == "auto":
        return "auto"
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off or auto")


def _env_bool(name: str, raw: str | None, default: bool) -> bool:
    """An on/off environment variable (``default`` when unset)."""
    if raw is None:
        return default
    value = _env_bool_or_auto(name, raw)
    if value == "auto":
        raise ValueError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")
    return value


def _env_int(name: str, raw: str, allow_auto: bool = False) -> ChunkSize:
    low = raw.strip().lower()
    if allow_auto and low == "auto":
        return "auto"
    try:
        return int(low)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a positive integer{' or auto' if allow_auto else ''}") from None


@dataclass
class FPDTConfig:
    """Settings of the fully pipelined distributed transformer.

    Args:
        chunk_size: tokens of the global sequence per attention chunk, or ``"auto"``.
        offload: keep key/value/query chunks in host memory (``True``), on the device (``False``), or
            decide from free device memory (``"auto"``, the default; on CPU: no offload, the host is the device).
        sp_size: sequence-parallel group size (ranks that share one sample).
        ring_degree: R, the ring of Ulysses groups inside the SP group (``sp_size = U x R``), or ``"auto"`` (the
            default: a ring only where ``sp_size`` exceeds the query heads; :func:`sp_degrees`).
        mlp_chunks: tiles of the MLP over the local sequence; ``None`` = twice the attention chunks.
        loss_chunks: tiles of the LM head + cross-entropy; ``None`` = ``2 * vocab // hidden``.
        offload_layer_inputs: move layer inputs saved by activation checkpointing to host memory.
        backend: block attention kernel, one of :data:`BACKENDS` (``hf_fpdt.config.BACKENDS``) or ``"auto"``.
        host_memory: host bytes hf_fpdt may keep across layers, a size (``"64GiB"``), ``"auto"``, ``0`` (the
            floor) or ``"unlimited"`` (see the module docstring).
        checkpoint_segments: k consecutive decoder layers per activation checkpoint while training with
            gradient checkpointing (1: HF's per-layer checkpointing). k > 1 keeps one layer input per
            segment and computes attention again in the recomputation (no replay inside a segment).
            ``"auto"`` (the default): 1 while device + host hold one input per layer, else the smallest k
            whose plan fits, chosen at each new step shape (:func:`hf_fpdt.integrations.step_plan.plan_step`).
        device_memory: device bytes layer inputs and replay chunks may keep on the device, a size,
            ``"auto"``, ``0`` or ``"unlimited"`` (see the module docstring).
        sync_copies: debug switch: synchronise the device after every device<->host copy (race checks; slow).
        sync_exchanges: run the SP all-to-alls in the synchronous order instead of overlapping them with the
            chunks' compute (bit-identical results; see the module docstring).
        attention_pattern: block-sparse attention (no environment variable): a
            :class:`hf_fpdt.attention.sparse_patterns.SparsePattern`, a FlexAttention-style ``mask_mod(b, h, q_idx,
            kv_idx) -> bool``, or a dict ``{layer_idx: pattern or None}``; blocks the pattern drops are neither
            fetched nor computed. ``None`` (default): dense causal attention.
        cpu_threads: torch threads of the chunked pieces on CPU, a positive integer or ``"auto"`` (the default:
            this process's share of the CPUs, see the module docstring).
    """

    chunk_size: ChunkSize | None = None
    offload: Offload | None = None
    sp_size: int | None = None
    ring_degree: int | str | None = None
    mlp_chunks: int | None = None
    loss_chunks: int | None = None
    offload_layer_inputs: bool | None = None
    backend: str | None = None
    host_memory: HostMemory | None = None
    checkpoint_segments: int | str | None = None
    device_memory: HostMemory | None = None
    sync_copies: bool | None = None
    sync_exchanges: bool | None = None
    attention_pattern: object = None
    cpu_threads: int | str | None = None

    def __post_init__(self) -> None:
        env = os.environ
        # fields this call fills from the environment: a setting out of range names its variable
        from_env = {f: n for f, n in ENV_NAMES.items() if getattr(self, f) is None and env.get(n, "").strip()}
        if self.chunk_size is None:
            raw = env.get("FPDT_CHUNK_SIZE")
            self.chunk_size = 65536 if raw is None else _env_int("FPDT_CHUNK_SIZE", raw, allow_auto=True)
        if self.offload is None:
            raw = env.get("FPDT_OFFLOAD")
            self.offload = "auto" if raw is None else _env_bool_or_auto("FPDT_OFFLOAD", raw)
        if self.sp_size is None:
            raw = env.get("FPDT_SP_SIZE")
            self.sp_size = 1 if raw is None else _env_int("FPDT_SP_SIZE", raw)
        if self.ring_degree is None:
            raw = env.get("FPDT_RING_DEGREE")
            self.ring_degree = "auto" if raw is None else _env_int("FPDT_RING_DEGREE", raw, allow_auto=True)
        if self.mlp_chunks is None and env.get("FPDT_MLP_CHUNKS"):
            self.mlp_chunks = _env_int("FPDT_MLP_CHUNKS", env["FPDT_MLP_CHUNKS"])
        if self.loss_chunks is None and env.get("FPDT_LOSS_CHUNKS"):
            self.loss_chunks = _env_int("FPDT_LOSS_CHUNKS", env["FPDT_LOSS_CHUNKS"])
        if self.offload_layer_inputs is None:
            raw = env.get("FPDT_OFFLOAD_LAYER_INPUTS")
            self.offload_layer_inputs = _env_bool("FPDT_OFFLOAD_LAYER_INPUTS", raw, default=True)
        if self.backend is None:
            self.backend = env.get("FPDT_BACKEND", "auto").strip().lower() or "auto"
        if self.host_memory is None:
            raw = env.get("FPDT_HOST_MEMORY")
            self.host_memory = "auto" if raw is None else parse_bytes(raw.strip(), "FPDT_HOST_MEMORY")
        else:
            self.host_memory = parse_bytes(self.host_memory)
        if self.checkpoint_segments is None:
            raw = env.get("FPDT_CHECKPOINT_SEGMENTS")
            self.checkpoint_segments = (
                "auto" if raw is None else _env_int("FPDT_CHECKPOINT_SEGMENTS", raw, allow_auto=True)
            )
        if self.device_memory is None:
            raw = env.get("FPDT_DEVICE_MEMORY")
            self.device_memory = "auto" if raw is None else parse_bytes(raw.strip(), "FPDT_DEVICE_MEMORY")
        else:
            self.device_memory = parse_bytes(self.device_memory, "device_memory")
        if self.sync_copies is None:
            self.sync_copies = _env_bool("FPDT_SYNC_COPIES", env.get("FPDT_SYNC_COPIES"), default=False)
        if self.sync_exchanges is None:
            self.sync_exchanges = _env_bool("FPDT_SYNC_EXCHANGES", env.get("FPDT_SYNC_EXCHANGES"), default=False)
        if self.cpu_threads is None:
            raw = env.get("FPDT_CPU_THREADS")
            self.cpu_threads = "auto" if raw is None else _env_int("FPDT_CPU_THREADS", raw, allow_auto=True)
        try:
            self.validate()
        except ValueError as exc:
            named = [n for f, n in from_env.items() if f"{f}=" in str(exc)]
            if not named:
                raise
            where = ", ".join(f"{n}={env[n]!r}" for n in named)
            noun = "environment variables" if len(named) > 1 else "environment variable"
            raise ValueError(f"{where} ({noun}): {exc}") from None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for any out-of-range setting."""
        cs = self.chunk_size
        if isinstance(cs, str):
            if cs != "auto":
                raise ValueError(f"chunk_size={cs!r}: use a positive number of tokens or 'auto'")
        elif isinstance(cs, bool) or not isinstance(cs, int) or cs < 1:
            raise ValueError(f"chunk_size={cs!r}: use a positive number of tokens (e.g. 65536) or 'auto'")
        if not (isinstance(self.offload, bool) or self.offload == "auto"):
            raise ValueError(f"offload={self.offload!r}: use True, False or 'auto'")
        if not isinstance(self.offload_layer_inputs, bool):
            raise ValueError(f"offload_layer_inputs={self.offload_layer_inputs!r}: use True or False")
        if not isinstance(self.sync_copies, bool):
            raise ValueError(
                f"sync_copies={self.sync_copies!r} (FPDTConfig.sync_copies / FPDT_SYNC_COPIES): use True or False"
            )
        if not isinstance(self.sync_exchanges, bool):
            raise ValueError(
                f"sync_exchanges={self.sync_exchanges!r} (FPDTConfig.sync_exchanges / FPDT_SYNC_EXCHANGES): use True "
                "(the synchronous all-to-alls) or False (overlapped with the compute, the default)"
            )
        parse_bytes(self.host_memory)  # raises naming the accepted forms
        parse_bytes(self.device_memory, "device_memory")
        if isinstance(self.sp_size, bool) or not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"sp_size={self.sp_size!r}: use a positive number of processes")
        r = self.ring_degree
        if r != "auto" and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(
                f"ring_degree={r!r} (FPDTConfig.ring_degree / FPDT_RING_DEGREE): use 'auto' or a positive integer "
                "dividing sp_size (the ring of Ulysses groups)"
            )
        if isinstance(r, int) and self.sp_size > 1 and self.sp_size % r:
            divisors = [d for d in range(1, self.sp_size + 1) if self.sp_size % d == 0]
            raise ValueError(
                f"ring_degree={r} (FPDTConfig.ring_degree / FPDT_RING_DEGREE) does not divide sp_size={self.sp_size}: "
                f"use 'auto' or one of {', '.join(map(str, divisors))}"
            )
        for name in ("mlp_chunks", "loss_chunks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}: use a positive number of tiles, or None for the default")
        k = self.checkpoint_segments
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"checkpoint_segments={k!r} (FPDTConfig.checkpoint_segments / FPDT_CHECKPOINT_SEGMENTS): use a "
                "positive number of layers per checkpoint segment (1 = per-layer checkpointing) or 'auto'"
            )
        n = self.cpu_threads
        if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"cpu_threads={n!r} (FPDTConfig.cpu_threads / FPDT_CPU_THREADS): use a positive number of threads "
                "for the chunked pieces on CPU, or 'auto' (this process's share of the CPUs: affinity, cgroup quota, "
                "LOCAL_WORLD_SIZE)"
            )
        ap = self.attention_pattern
        per_layer = isinstance(ap, Mapping) and all(isinstance(i, int) for i in ap)
        if ap is not None and not callable(ap) and not hasattr(ap, "mask_mod") and not per_layer:
            raise ValueError(
                f"attention_pattern={ap!r}: use a hf_fpdt.attention.sparse_patterns.SparsePattern, a mask_mod "
                "(b, h, q_idx, kv_idx) -> bool, a dict {layer_idx: pattern or None}, or None (dense)"
            )
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(
                f"backend={self.backend!r} (FPDTConfig.backend / FPDT_BACKEND): use 'auto' or one of {BACKENDS}"
            )
        if isinstance(cs, int) and cs < self.sp_size:
            raise ValueError(
                f"chunk_size={cs} is smaller than sp_size={self.sp_size}: every rank needs at least one token "
                "per chunk; raise chunk_size"
            )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
