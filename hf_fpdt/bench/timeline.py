"""A traced step in time: the events of :mod:`hf_fpdt.bench.trace` played on a GPU of :mod:`hf_fpdt.bench.gpus`.

The host issues the events in order, :data:`~hf_fpdt.bench.gpus.HOST_OP_S` each (kernels, copies, collectives). A
kernel starts when its stream is free and the host has issued it, and runs for its FLOPs at the GPU's GEMM or
attention rate, or its bytes at the memory bandwidth (whichever is longer, at least
:data:`~hf_fpdt.bench.gpus.KERNEL_MIN_S`). A copy runs on its stream at the host link's pinned or pageable rate; a
blocking one holds the host until it is done. A collective starts when the stream that issued it and the
communication stream are free, and takes its bytes' share that leaves the rank at NVLink's rate within a node (the
inter-node rate beyond); ``wait()`` orders its stream after it. An event's record takes its stream's time, a wait
moves the waiting stream to it; a host synchronisation moves the host to the time of what it waits for.

What the compute stream (the default stream) waits for is attributed to a cause: a copy or exchange it was ordered
after (``wait on stream N`` / ``all_to_all``), or the host (issuing ops, or held by a synchronisation: its kind and
where in hf_fpdt it was made). Not modelled: kernels of different streams slowing each other (they share the SMs and
HBM), the allocator's own time, CPU work the trace does not see (Python in HF and hf_fpdt between ops is counted
only as the per-op host cost).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .gpus import COLLECTIVE_LATENCY_S, GPU, HOST_OP_S, KERNEL_MIN_S, SYNC_S
from .trace_events import ATTENTION, GEMM, Collective, CollectiveWait, Copy, Kernel, Record, Sync, Wait

COMPUTE = 0  # the default stream
COMM = -2  # the communication stream of the collectives
GAP_S = 1e-3  # a compute-stream gap this long or longer is counted


@dataclass
class Timeline:
    """The predicted timing of one traced step on one GPU."""

    gpu: str
    step_s: float
    busy_s: dict  # stream -> seconds busy ("compute", "copy N", "comm")
    kind_s: dict  # compute stream seconds by kind (gemm, attention, memory)
    idle_s: dict  # compute-stream idle seconds by cause
    gaps: int  # compute-stream gaps of GAP_S or more
    host_syncs: int
    copy_bytes: dict = field(default_factory=dict)  # direction -> bytes

    def busy_share(self, stream: str) -> float:
        return self.busy_s.get(stream, 0.0) / self.step_s if self.step_s else 0.0

    def top_idle(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.idle_s.items(), key=lambda kv: -kv[1])[:n]


def kernel_seconds(k: Kernel, gpu: GPU) -> float:
    """A kernel's predicted duration on ``gpu``."""
    if k.kind == GEMM:
        compute = k.flops / gpu.gemm
    elif k.kind == ATTENTION:
        compute = k.flops / gpu.attention_rate(k.backend, k.head_dim)
    else:
        compute = 0.0
    return max(compute, k.nbytes / gpu.hbm, KERNEL_MIN_S)


def _collective_seconds(c: Collective, gpu: GPU) -> float:
    if c.group_size <= 1:
        return 0.0
    link = gpu.nvlink if c.group_size <= gpu.gpus_per_node else gpu.internode
    share = (c.group_size - 1) / c.group_size
    if c.op == "all_reduce":
        share *= 2  # a ring all-reduce sends and receives about twice the bytes
    return COLLECTIVE_LATENCY_S + c.nbytes * share / link


def _name(stream: int) -> str:
    return "compute" if stream == COMPUTE else "comm" if stream == COMM else f"stream {stream}"


def play(events: list, gpu: GPU) -> Timeline:
    """Time ``events`` (an :class:`~hf_fpdt.bench.trace_events.EventLog`'s) on ``gpu`` (see the module docstring)."""
    host = 0.0
    host_cause = "host issuing ops"
    ready: dict = defaultdict(float)  # stream -> when its queued work is done
    cause: dict = {}  # stream -> why its ready time last moved past its own work (a wait)
    last_end: dict = defaultdict(float)  # stream -> end of its last kernel or copy
    recorded: dict = {}
    collectives: dict = {}
    busy: dict = defaultdict(float)
    kinds: dict = defaultdict(float)
    idle: dict = defaultdict(float)
    copy_bytes: dict = defaultdict(int)
    carries: dict = {}  # stream -> the direction of its last copy (what a wait on it waits for)
    gaps = syncs = 0

    def run(stream: int, seconds: float) -> float:
        nonlocal gaps, host_cause
        start = max(ready[stream], host)
        if stream == COMPUTE:
            waited = max(0.0, ready[stream] - last_end[stream])
            late = max(0.0, start - max(ready[stream], last_end[stream]))
            if waited:
                idle[cause.get(stream, "wait")] += waited
            if late:
                idle[host_cause] += late
            if start - last_end[stream] >= GAP_S:
                gaps += 1
        end = start + seconds
        ready[stream] = last_end[stream] = end
        busy[_name(stream)] += seconds
        host_cause = "host issuing ops"
        return end

    for e in events:
        if isinstance(e, Kernel):
            host += HOST_OP_S
            seconds = kernel_seconds(e, gpu)
            run(e.stream, seconds)
            if e.stream == COMPUTE:
                kinds[e.kind] += seconds
        elif isinstance(e, Copy):
            host += HOST_OP_S
            carries[e.stream] = e.direction
            rate = gpu.pcie_pinned if e.pinned else gpu.pcie_pageable
            end = run(e.stream, e.nbytes / rate)
            copy_bytes[e.direction] += e.nbytes
            if e.blocking:
                host, host_cause = max(host, end), f"blocking {e.direction} copy"
        elif isinstance(e, Collective):
            host += HOST_OP_S
            start = max(ready[COMM], ready[e.stream], host)
            end = start + _collective_seconds(e, gpu)
            busy["comm"] += end - start
            ready[COMM] = end
            collectives[e.uid] = end
        elif isinstance(e, CollectiveWait):
            _wait(ready, cause, e.stream, collectives.get(e.uid, 0.0), "waiting for an SP exchange (all-to-all)")
        elif isinstance(e, Record):
            recorded[e.event] = (ready[e.stream], e.stream)
        elif isinstance(e, Wait):
            at, other = (ready[e.other], e.other) if e.event < 0 else recorded.get(e.event, (0.0, e.stream))
            what = f"{carries[other]} copies on {_name(other)}" if other in carries else _name(other)
            _wait(ready, cause, e.stream, at, f"waiting for {what}")
        elif isinstance(e, Sync):
            syncs += 1
            if e.event >= 0:
                at = recorded.get(e.event, (0.0, 0))[0]
            elif e.stream >= 0:
                at = ready[e.stream]
            else:
                at = max(ready.values(), default=0.0)
            if at > host:
                host = at
            host += SYNC_S
            host_cause = f"host sync: {e.kind}" + (f" at {e.where.split(' < ')[0]}" if e.where else "")
    step = max([host, *ready.values()])
    return Timeline(gpu.name, step, dict(busy), dict(kinds), dict(idle), gaps, syncs, dict(copy_bytes))


def _wait(ready: dict, cause: dict, stream: int, at: float, why: str) -> None:
    if at > ready[stream]:
        ready[stream] = at
        cause[stream] = why
