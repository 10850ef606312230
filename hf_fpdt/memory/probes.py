"""Memory probes: how much memory the host and the device have, read in one place.

The planner (:mod:`hf_fpdt.memory.planner`), the runtime's host budget and the autotuner's device share
all ask here, so ``/proc/meminfo`` is parsed by one function.

What a process may really allocate on the host is the smallest of three limits (:func:`host_limits`): the RAM
the kernel says is available (``MemAvailable``), the address-space limit of the process (``RLIMIT_AS``, e.g.
``ulimit -v``, less what the process has mapped already and what its threads may map: ``THREAD_ADDRESS_SPACE``
each beyond the first) and the memory limit of its control group (cgroup v2 ``memory.max`` or v1
``memory.limit_in_bytes``, less what the group uses; a container's limit). RAM and the cgroup are shared by the
node's processes, ``RLIMIT_AS`` is each process's own. The planner sets its margin (what the allocator takes beyond
the tensors, :func:`hf_fpdt.memory.planner.host_margin`) against whichever binds.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from ..config import format_bytes

_UNLIMITED_V1 = 1 << 62  # cgroup v1 writes "no limit" as a huge number (9223372036854771712 = 2^63 - page)

AUTO_HOST_SHARE = 0.8  # share of the available RAM host_memory="auto" takes (the rest: allocator slack, the OS)
# Address space a thread beyond the first may map in a step: glibc's arena for it (64 MiB reserved at its first
# allocation) and its stack (8 MiB). RLIMIT_AS counts them though little of them is resident; measured on CPU with
# tests/scripts/rlimit_step.py (the step's address-space need grows 64-72 MiB per thread, docs/guides/memory.md).
THREAD_ADDRESS_SPACE = 72 << 20


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``); empty where it cannot be read."""
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return info


def host_available() -> int:
    """Bytes of RAM available now (``MemAvailable``; the free pages where ``/proc/meminfo`` is missing)."""
    available = meminfo().get("MemAvailable")
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text) if text.isdigit() else None


def _stat_value(path: str, *keys: str) -> int:
    """The first of ``keys`` in a cgroup ``memory.stat`` file (0 where absent)."""
    try:
        with open(path) as fh:
            values = dict(line.split()[:2] for line in fh if len(line.split()) >= 2)
    except OSError:
        return 0
    return next((int(values[k]) for k in keys if k in values and values[k].isdigit()), 0)


def cgroup_available(proc: str = "/proc", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the process's control group may still allocate (``None``: no memory limit found).

    cgroup v2: for the process's group and each of its ancestors with a ``memory.max``, the limit less
    ``memory.current`` (page cache that can be dropped, ``inactive_file`` of ``memory.stat``, counted as free);
    the smallest. cgroup v1: the same with ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` of the memory
    controller's hierarchy. Inside a container the group's own folder may be the mount's root: both are read.
    """
    try:
        with open(os.path.join(proc, "self", "cgroup")) as fh:
            lines = [line.strip().split(":", 2) for line in fh if line.count(":") >= 2]
    except OSError:
        return None
    found = []
    for _, controllers, path in lines:
        if controllers == "":  # v2
            base, limit, usage, stat = root, "memory.max", "memory.current", ("inactive_file",)
        elif "memory" in controllers.split(","):  # v1
            base, limit, usage, stat = (
                os.path.join(root, "memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                ("total_inactive_file", "inactive_file"),
            )
        else:
            continue
        parts = [p for p in path.split("/") if p]
        folders = {os.path.join(base, *parts[:n]) for n in range(len(parts) + 1)}
        for folder in folders:
            cap = _read_int(os.path.join(folder, limit))
            if cap is None or cap >= _UNLIMITED_V1:
                continue
            used = _read_int(os.path.join(folder, usage)) or 0
            used -= min(used, _stat_value(os.path.join(folder, "memory.stat"), *stat))
            found.append(max(0, cap - used))
    return min(found) if found else None


def address_space_available(proc: str = "/proc") -> int | None:
    """Bytes this process may still map under ``RLIMIT_AS`` (its soft limit less ``VmSize``); ``None``: no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    mapped = meminfo_status(proc).get("VmSize", 0)
    return max(0, soft - mapped)


def meminfo_status(proc: str = "/proc") -> dict[str, int]:
    """The ``Vm*`` lines of ``/proc/self/status`` in bytes (empty where it cannot be read)."""
    info = {}
    try:
        with open(os.path.join(proc, "self", "status")) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.startswith("Vm") and value.strip().endswith("kB"):
                    info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return info


@dataclass(frozen=True)
class HostLimits:
    """What the host lets this process allocate, by source (bytes; ``None``: that limit is not set)."""

    ram: int  # MemAvailable, shared by the node's processes
    address_space: int | None  # RLIMIT_AS less VmSize, this process's own
    cgroup: int | None  # the control group's limit less its usage, shared by the group's processes
    threads: int = 1  # the threads that allocate in a step (torch's intra-op threads)

    def per_process(self, local_processes: int = 1) -> tuple[int, str]:
        """``(bytes, source)``: the smallest limit of one of ``local_processes`` processes of the node (RAM and
        the cgroup shared evenly among them; ``RLIMIT_AS`` each process's own, less ``THREAD_ADDRESS_SPACE`` per
        thread beyond the first: address space its threads may map and never fill) and what sets it."""
        n = max(1, local_processes)
        share = f" / {n} local processes" if n > 1 else ""
        options = [(self.ram // n, f"RAM available (MemAvailable {format_bytes(self.ram)}{share})")]
        if self.cgroup is not None:
            options.append((self.cgroup // n, f"cgroup memory limit ({format_bytes(self.cgroup)} left{share})"))
        if self.address_space is not None:
            extra = max(0, self.threads - 1)
            reserved = extra * THREAD_ADDRESS_SPACE
            source = f"RLIMIT_AS (ulimit -v: {format_bytes(self.address_space)} left to map"
            if extra:
                threads = f"{extra} more threads' arenas and stacks" if extra > 1 else "1 more thread's arena and stack"
                source += f", less {format_bytes(reserved)} for {threads}"
            options.append((max(0, self.address_space - reserved), source + ")"))
        return min(options, key=lambda o: o[0])


def host_limits() -> HostLimits:
    """The host's three limits now (see the module docstring), with this process's threads."""
    return HostLimits(host_available(), address_space_available(), cgroup_available(), torch.get_num_threads())


def local_processes() -> int:
    """The training processes of this node (``LOCAL_WORLD_SIZE``, set by torchrun / accelerate launch; 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def device_memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (CPU: ``MemAvailable`` and ``MemTotal`` of ``/proc/meminfo``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    info = meminfo()
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def auto_host_memory(processes: int | None = None) -> int:
    """``host_memory="auto"``: ``AUTO_HOST_SHARE`` of what one process may allocate now: the smallest of the
    RAM available and the cgroup limit (both shared by the node's ``processes``) and ``RLIMIT_AS``.

    The processes of a node are ``LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch) unless given.
    """
    nbytes, _ = host_limits().per_process(local_processes() if processes is None else processes)
    return int(AUTO_HOST_SHARE * nbytes)
