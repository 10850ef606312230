"""The attention pipeline's working set: what one rank holds on the device at its peak block, beyond the stored chunks.

One formula for the planner (:mod:`hf_fpdt.memory.planner`, the device's "attention working set") and the
autotuner (:mod:`hf_fpdt.attention.autotune`, the largest chunk a memory budget allows), read off what
:mod:`hf_fpdt.attention.chunked` keeps alive at a block. Per token of a global chunk, per rank, with ``b`` the
bytes of the compute dtype, ``a`` those of the accumulators (4: float32; 8 for float64), ``e_q = B * H / P * D`` and
``e_k = B * Hkv' / P * D`` elements (``Hkv' = max(Hkv, P)`` when P > Hkv: the replicated KV heads) and
``h = B * H / P`` rows of the fp32 lse; ``s = 1 + PREFETCH_DEPTH`` fetched sets (the block's and those in flight),
counted only where a fetch allocates (``copies``: a CUDA store that offloads; on CPU and for resident chunks a
fetch hands over the stored tensor, which the replay already counts), and there the put tensors the store holds until
their copies to the host are done, at most ``w = WRITES_IN_FLIGHT`` times the largest
(:class:`hf_fpdt.memory.staging.HeldSources`: chunk i's k, v, q while its blocks run, chunk i-1's q, o, lse beside
chunk i's diagonal, the dq puts beside a backward block)::

    forward block (i, j < i)   q_i (b e_q) + running o, lse (a e_q + 4h) + the block's out, lse (b e_q + 4h)
                               + its cast to the accumulator's dtype (a e_q where b < a)
                               + copies: s * (k_j, v_j)  (2 b e_k each) + the held puts (w b max(e_q, e_k))
    forward diagonal (i, i)    q_i, k_i, v_i (b (e_q + 2 e_k)) + the block's out, lse (b e_q + 4h)
                               + copies: the held puts (w b max(e_q, e_k))
    backward block (i, j)      dq_i of the row (a e_q) + dk_i, dv_i (2 a e_k) + the block's dq, dk, dv (b (e_q + 2 e_k))
                               + the kernel's float32 dq accumulator and its contiguous lse (a e_q + 4h: FA2's
                               dq_accum; torch's CPU flash backward holds
                               per-thread tiles instead, 1 MiB a thread, measured: the term bounds it from above
                               wherever a chunk's q is at least that)
                               + copies: s * (k_i, v_i, q_j, o_j, lse_j, dO_j under SP, dq_j) + the held dq puts
                               (w a e_q)
    all-to-all (SP > 1)        the chunk's q, k, v (b (e_q + 2 e_k)) and the packed send and receive buffers (2x that)
    overlap (SP > 1, the       forward and diagonal rows: + the next chunk's q/k/v exchange in flight (its send and
    default; not with          receive buffers, 2 b (e_q + 2 e_k)) + the previous chunk's output exchange (2 b e_q);
    ``sync_exchanges``)        backward row: + one chunk's dq/dk/dv exchange (2 b (e_q + 2 e_k))

The working set is the largest of these. What it leaves out, on purpose: the stored chunks (the planner's replay
and pool terms), the backward's dO and fp32 dq store (the planner's ``bwd_extra``), the full-length output and
input gradients (the layer's activations), and the kernels' own scratch (flash kernels: tiles, O(threads x tile),
not O(chunk)). ``tests/unit/test_working_set.py`` holds the backward's row against a CPU allocation probe.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .host_store import PREFETCH_DEPTH
from .staging import WRITES_IN_FLIGHT


class WorkingSet(NamedTuple):
    """Bytes of one rank's attention pipeline at a forward block off the diagonal, a diagonal block, a backward block
    and an all-to-all."""

    forward: int
    diagonal: int
    backward: int
    exchange: int

    @property
    def peak(self) -> int:
        return max(self)


def working_set_parts(
    chunk: int,
    *,
    width: int,
    elem_bytes: int,
    kv_ratio: float = 1.0,
    heads: int = 0,
    batch: int = 1,
    sp_size: int = 1,
    copies: bool = True,
    acc_bytes: int = 4,
    depth: int = PREFETCH_DEPTH,
    overlapped: bool = True,
    ring: int = 1,
) -> WorkingSet:
    """The forward, backward and all-to-all terms of :func:`attention_working_set` (module docstring), in bytes.
    ``overlapped``: under SP the exchanges travel while the chunks compute (``FPDTConfig.sync_exchanges`` False).
    ``ring``: R, a ring of Ulysses groups (``chunk`` is then the ring's attention chunk, ``sp_size`` the Ulysses
    degree): the forward holds the round's gathered k, v (send buffer, R received, R unpacked), the backward the
    round's R partial dk, dv (fp32) and the reduce's send and receive buffers (:mod:`hf_fpdt.attention.ring`)."""
    if chunk < 0 or width <= 0 or elem_bytes <= 0 or sp_size < 1 or batch < 1:
        raise ValueError(
            f"attention_working_set needs chunk >= 0, width > 0, elem_bytes > 0, batch >= 1 and sp_size >= 1; got "
            f"chunk={chunk}, width={width}, elem_bytes={elem_bytes}, batch={batch}, sp_size={sp_size}"
        )
    b, a = elem_bytes, max(acc_bytes, elem_bytes)
    e_q = batch * width / sp_size
    e_k = e_q * kv_ratio
    h = batch * heads / sp_size
    sets = 1 + depth if copies else 0
    cast = a * e_q if b < a else 0.0
    held = WRITES_IN_FLIGHT * b * max(e_q, e_k) if copies else 0.0  # puts held for their copies to the host
    forward = b * e_q + (a * e_q + 4 * h) + (b * e_q + 4 * h) + cast + sets * 2 * b * e_k + held
    diagonal = b * (e_q + 2 * e_k) + b * e_q + 4 * h + held
    fetched = 2 * b * e_k + 2 * b * e_q + 4 * h + (b * e_q if sp_size > 1 else 0.0) + a * e_q
    backward = a * e_q + 2 * a * e_k + b * (e_q + 2 * e_k) + (a * e_q + 4 * h)
    if copies:
        backward += sets * fetched + WRITES_IN_FLIGHT * a * e_q
    exchange = 3 * b * (e_q + 2 * e_k) if sp_size > 1 else 0.0
    if sp_size > 1 and overlapped:  # exchanges in flight beside the block (attention.chunked)
        forward += 2 * b * (e_q + 2 * e_k) + 2 * b * e_q
        diagonal += 2 * b * (e_q + 2 * e_k) + 2 * b * e_q
        backward += 2 * b * (e_q + 2 * e_k)
    if ring > 1:
        gathered = (1 + 2 * ring) * 2 * b * e_k
        forward += gathered
        diagonal += gathered
        backward += 3 * ring * 2 * a * e_k
        exchange += gathered
    return WorkingSet(*(math.ceil(chunk * x) for x in (forward, diagonal, backward, exchange)))


def attention_working_set(chunk: int, **shape: float | int | bool) -> int:
    """Peak bytes one rank's attention pipeline holds beyond its stored chunks, for global chunks of ``chunk`` tokens:
    the largest of :func:`working_set_parts`, which takes the same keywords.

    ``width``: query heads x head dim (``H * D``); ``kv_ratio``: key/value heads over query heads, after any
    replication (``Hkv' / H``); ``heads``: query heads (for the fp32 lse rows; 0 leaves them out); ``copies``: a
    fetch allocates a device buffer (CUDA with offload); ``overlapped``: the SP exchanges overlap the compute. The
    module docstring derives each term.
    """
    return working_set_parts(chunk, **shape).peak
