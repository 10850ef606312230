"""How long a collective waits for a missing rank: the one place hf_fpdt reads, checks or changes a process
group's timeout.

torch keeps a group's timeout in its backend's options and offers no public reader; the setter is
``torch.distributed.set_timeout`` where torch has it (2.14 on), the private ``_set_pg_timeout`` below (what torch
2.9-2.13 have; 2.14 deprecates it with a ``FutureWarning`` on every call). Both private names are used here only.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 600.0  # seconds: build_groups' default and FPDTPlugin's sp_timeout (gloo's own: 30 minutes)


def check_timeout(timeout: float | timedelta, name: str = "timeout") -> timedelta:
    """``timeout`` (seconds or a ``timedelta``) as a ``timedelta``; ``ValueError`` unless positive and finite.

    Zero is not "no timeout" to torch: a group created with it may block forever in its connection set-up
    (gloo), and every collective would fail at once."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{name}={timeout!r}: use a positive, finite number of seconds (how long a collective waits for a "
            f"missing rank before every rank fails with an error; 0 does not mean 'no timeout'; the default is "
            f"{DEFAULT_TIMEOUT:g})"
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """How long collectives of ``group`` (the world for ``None``) wait for a missing rank, read from its
    backend's options, or None where this torch does not say."""
    group = dist.group.WORLD if group is None else group
    devices = list(getattr(group, "_device_types", None) or []) + [torch.device("cpu"), torch.device("cuda")]
    for device in devices:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def set_group_timeout(group: dist.ProcessGroup, timeout: float | timedelta) -> timedelta | None:
    """Set how long collectives of an existing ``group`` (e.g. the world, created by Accelerate or Trainer
    with their own 30-minute default) wait for a missing rank; collectives started afterwards use it.

    Returns the timeout it had (:func:`group_timeout`), for the caller to put back when it is done with the
    group (``FPDTPlugin.release``). Uses ``torch.distributed.set_timeout`` (torch 2.14 on), else torch's private
    ``_set_pg_timeout`` (gloo and NCCL; deprecated from 2.14); raises ``ValueError`` when this torch has neither.
    """
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=timeout)
    setter = _setter()
    if setter is None:
        raise ValueError(
            f"this torch ({torch.__version__}) cannot change a process group's timeout; create the world with "
            "init_process_group(timeout=...) (Accelerate: InitProcessGroupKwargs, Trainer: ddp_timeout)"
        )
    before = group_timeout(group)
    setter(timeout, group)
    return before


def _setter():
    """torch's public ``set_timeout(timeout, group)`` where it exists, else the private one it replaced, else None."""
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        return public
    return getattr(dist.distributed_c10d, "_set_pg_timeout", None)
