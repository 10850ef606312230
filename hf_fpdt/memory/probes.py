"""Memory probes: how much memory the host and the device have, read in one place.

The planner (:mod:`hf_fpdt.memory.planner`), the runtime's host budget and the autotuner's device share
all ask here, so ``/proc/meminfo`` is parsed by one function.
"""

from __future__ import annotations

import os

import torch

AUTO_HOST_SHARE = 0.8  # share of the available RAM host_memory="auto" takes (the rest: allocator slack, the OS)


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


def device_memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (CPU: ``MemAvailable`` and ``MemTotal`` of ``/proc/meminfo``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    info = meminfo()
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def auto_host_memory(local_processes: int | None = None) -> int:
    """``host_memory="auto"``: ``AUTO_HOST_SHARE`` of the RAM available now, shared by the node's processes.

    The processes of a node are ``LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch) unless given.
    """
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int(AUTO_HOST_SHARE * host_available() / max(1, local_processes))
