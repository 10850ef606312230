"""CPU threads of the chunked pieces: how many, decided once per runtime, and scopes that apply them.

The chunked path runs many small operations where HF's path runs a few large ones (per chunk: a block kernel, a
merge, a projection tile, a loss tile). Each is an OpenMP parallel region that ends when its slowest thread
does, so more threads than the process has CPUs (a container's CPU quota, a node's cores shared by several
training processes) costs these pieces more than HF's few large operators. The count is therefore the
process's share of the CPUs, decided once when the runtime is made (``hf_fpdt.apply`` / ``hf_fpdt.configure``,
or the attention-only path's first call), from ``FPDTConfig.cpu_threads``:

* an integer: that many threads inside the chunked pieces;
* ``"auto"`` (the default): the CPUs this process may run on (``os.sched_getaffinity``), capped by the CPU
  quota of its control group (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``; whole CPUs,
  at least 1), divided among the node's training processes (``LOCAL_WORLD_SIZE``, as torchrun and ``accelerate
  launch --num_cpu_threads_per_process`` divide them), and never more than torch's own count when a scope opens
  (``OMP_NUM_THREADS`` or ``torch.set_num_threads`` lower it; ``auto`` only lowers).

A :meth:`CpuThreads.scope` sets ``torch.set_num_threads`` to that count around a piece's forward and around the
chunked attention's backward (both run inside one Python frame of hf_fpdt: a ``with`` block) and gives torch its
count back at every exit, an exception included; on another device it does nothing. The tiled MLP's backward
(one node of :mod:`hf_fpdt.memory.tiling`, not hf_fpdt's frame) runs with torch's count, like the rest of the
step: a scope that spans autograd nodes cannot restore the count when a backward raises or stops between them.
The count does not change results: on the 2-core development machine 1 and 2 threads give the same bits
(``tests/unit/test_threads.py``). Nothing is global: each runtime owns one :class:`CpuThreads`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..memory.probes import local_processes


def affinity_cpus() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where it is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _quota(folder: str, v2: bool) -> float | None:
    """CPUs the group at ``folder`` may use (quota / period), or None where it sets no limit."""
    if v2:
        raw = _read(os.path.join(folder, "cpu.max"))  # "max 100000" or "200000 100000"
        parts = raw.split() if raw else []
        if len(parts) != 2 or parts[0] == "max":
            return None
        quota, period = parts
    else:
        quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
        period = _read(os.path.join(folder, "cpu.cfs_period_us"))
    try:
        q, p = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for no limit


def cgroup_cpus(proc: str = "/proc", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's control group in CPUs (``2.5``), or None where none is set.

    cgroup v2: ``cpu.max`` of the process's group and each of its ancestors; cgroup v1: ``cpu.cfs_quota_us /
    cpu.cfs_period_us`` in the ``cpu`` controller's hierarchy; the smallest. Inside a container the group's own
    folder may be the mount's root: both are read (as :func:`hf_fpdt.memory.probes.cgroup_available` does)."""
    raw = _read(os.path.join(proc, "self", "cgroup"))
    if raw is None:
        return None
    found = []
    for line in raw.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            bases, v2 = [root], True
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu,cpuacct (or cpu alone)
            bases, v2 = [os.path.join(root, controllers), os.path.join(root, "cpu")], False
        else:
            continue
        parts = [p for p in path.split("/") if p]
        folders = {os.path.join(base, *parts[:n]) for base in bases for n in range(len(parts) + 1)}
        found += [q for q in (_quota(f, v2) for f in sorted(folders)) if q is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class CpuShare:
    """What ``cpu_threads="auto"`` is made of: the CPUs found and how they are shared."""

    affinity: int  # CPUs this process may run on
    quota: float | None  # the cgroup's CPU quota in CPUs, None: no limit
    processes: int  # training processes of the node (LOCAL_WORLD_SIZE)

    @classmethod
    def probe(cls) -> CpuShare:
        return cls(affinity_cpus(), cgroup_cpus(), local_processes())

    @property
    def threads(self) -> int:
        """``min(affinity, whole CPUs of the quota) // processes``, at least 1."""
        cpus = self.affinity if self.quota is None else min(self.affinity, max(1, math.floor(self.quota)))
        return max(1, cpus // self.processes)

    def describe(self) -> str:
        quota = "no cgroup CPU limit" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        return f"{self.affinity} CPUs in affinity, {quota}, {self.processes} process(es) on the node"


class CpuThreads:
    """The thread count of one runtime's chunked pieces on CPU (see the module docstring), decided at
    construction from ``setting`` (``FPDTConfig.cpu_threads``: a positive int or ``"auto"``).

    Args:
        setting: ``"auto"`` or a positive number of threads.
        share: the CPUs ``"auto"`` divides (default: probed now, :meth:`CpuShare.probe`).
    """

    def __init__(self, setting: int | str = "auto", share: CpuShare | None = None) -> None:
        self.setting = setting
        self.share = share if share is not None else (CpuShare.probe() if setting == "auto" else None)
        self.threads = setting if isinstance(setting, int) else self.share.threads
        self._depth = 0

    def count(self) -> int:
        """The threads a scope opened now runs with: an integer setting as given; ``"auto"``'s share, at most
        torch's count (what the launcher or the user set for the process)."""
        if self.setting == "auto":
            return min(self.threads, torch.get_num_threads())
        return self.threads

    def describe(self) -> str:
        """One phrase for the plan line: the count and where it comes from."""
        if self.setting != "auto":
            return f"cpu_threads {self.threads} (set)"
        torch_count = torch.get_num_threads()
        text = f"cpu_threads {self.count()} (auto: {self.share.describe()}"
        if torch_count > self.threads:
            text += (
                f"; torch's {torch_count} threads outside the chunked pieces: torch.set_num_threads({self.threads}) "
                f"or OMP_NUM_THREADS={self.threads} for the rest of the step"
            )
        return text + ")"

    @contextlib.contextmanager
    def scope(self, device: torch.device) -> Iterator[None]:
        """Run the body with :meth:`count` threads on CPU (nested scopes keep the outer one's); torch's count is
        restored at every exit, an exception included. On another device nothing changes."""
        if device.type != "cpu" or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        outer = torch.get_num_threads()
        n = self.count()
        self._depth = 1
        try:
            if n != outer:
                torch.set_num_threads(n)
            yield
        finally:
            self._depth = 0
            if torch.get_num_threads() != outer:
                torch.set_num_threads(outer)
