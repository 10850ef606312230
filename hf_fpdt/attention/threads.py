"""CPU threads of the chunked pieces on a machine other processes share.

The chunked path runs many small operations where HF's path runs a few large ones (per chunk: a block
kernel, a merge, a projection tile, a loss tile; about 4x HF's operator count at 4K tokens in chunks of 1K).
Each operation is an OpenMP parallel region that ends when its slowest thread does. On an idle machine that
costs nothing; with another busy process on the same cores, one of the region's threads is often descheduled
and every region waits a scheduler slice for it, so the chunked step slows several times more than HF's
(measured on 2 cores with one busy process: HF sdpa 2.1x, the chunked step 4.2-5.9x). One thread per free
core avoids the wait: inside the chunked pieces the thread count drops to the cores the other processes
leave, and comes back when they go.

The free cores are estimated, not configured: ``others = load - own``, the 1-minute load average (runnable
tasks, this process's threads included) less this process's own CPU use over the same minute (an exponential
average with the kernel's 60 s time constant, from ``time.process_time``); the count inside a scope is
``round(usable CPUs - others)`` clamped to ``[1, torch's thread count]``. Waiting threads of this process count
in the load but not in its CPU time, so contention lowers the count and an idle machine keeps torch's.
Nothing is global: each runtime owns one :class:`CpuThreads`; a scope restores the count it found.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator

import torch

LOAD_TIME_CONSTANT_S = 60.0  # the kernel's 1-minute load average: an exponential average over 60 s


def free_cores(usable: int, load: float, own: float) -> float:
    """Cores the other processes leave: ``usable - (load - own)``, ``load - own`` taken as at least 0."""
    return usable - max(0.0, load - own)


def thread_count(requested: int, usable: int, load: float | None, own: float) -> int:
    """Threads for a chunked piece: ``round(free_cores)`` within ``[1, requested]``; ``requested`` without a load
    average (a platform without one)."""
    if load is None:
        return requested
    return max(1, min(requested, math.floor(free_cores(usable, load, own) + 0.5)))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class CpuThreads:
    """The thread count of one runtime's chunked pieces on CPU (see the module docstring).

    ``adapt=False`` keeps torch's count (``FPDTConfig.adapt_threads``; tests that time or count threads).
    """

    def __init__(self, adapt: bool = True) -> None:
        self.adapt = adapt
        self._own: float | None = None  # this process's average CPU use (cores), 60 s time constant
        self._last: tuple[float, float] | None = None  # (wall, process CPU) at the last update
        self._depth = 0
        self._backward: tuple[int, int] | None = None  # (graph task, torch's count) of an open backward scope

    def _own_use(self, requested: int) -> float:
        wall, cpu = time.monotonic(), time.process_time()
        if self._last is None:  # no history yet: as if this process had kept its threads busy
            self._own = float(requested)
        else:
            dt = wall - self._last[0]
            if dt > 0:
                rate = (cpu - self._last[1]) / dt
                keep = math.exp(-dt / LOAD_TIME_CONSTANT_S)
                self._own = keep * self._own + (1 - keep) * rate
        self._last = (wall, cpu)
        return self._own

    def count(self, requested: int) -> int:
        """The threads a scope opened now runs with (``requested``: torch's count outside the scopes)."""
        own = self._own_use(requested)
        if not self.adapt:
            return requested
        return thread_count(requested, _usable_cpus(), _load(), own)

    def _in_backward_scope(self) -> bool:
        """A backward scope is open in the running backward (one a backward left open, e.g. one that raised or
        stopped before the piece's input, is closed here)."""
        if self._backward is None:
            return False
        if self._backward[0] == torch._C._current_graph_task_id():
            return True
        self.close_backward()
        return False

    def open_backward(self, device: torch.device) -> None:
        """Enter a scope from a piece's backward (:func:`backward_scope`'s output marker)."""
        if device.type != "cpu" or self._depth or self._in_backward_scope():
            return
        outer = torch.get_num_threads()
        n = self.count(outer)
        if n != outer:
            torch.set_num_threads(n)
        self._backward = (torch._C._current_graph_task_id(), outer)

    def close_backward(self) -> None:
        """Leave the backward scope (:func:`backward_scope`'s input marker), restoring torch's count."""
        if self._backward is not None:
            outer, self._backward = self._backward[1], None
            if torch.get_num_threads() != outer:
                torch.set_num_threads(outer)

    @contextlib.contextmanager
    def scope(self, device: torch.device) -> Iterator[None]:
        """Run the body with :meth:`count` threads on CPU (nested scopes keep the outer one's); restores torch's."""
        if device.type != "cpu" or self._depth or self._in_backward_scope():
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        outer = torch.get_num_threads()
        n = self.count(outer)
        if n != outer:
            torch.set_num_threads(n)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            if torch.get_num_threads() != outer:
                torch.set_num_threads(outer)


class _Open(torch.autograd.Function):
    """Identity; its backward (run before the piece's: it sits on the piece's output) opens the scope."""

    @staticmethod
    def forward(ctx, threads: CpuThreads, x: torch.Tensor) -> torch.Tensor:
        ctx.threads, ctx.device = threads, x.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.threads.open_backward(ctx.device)
        return None, grad


class _Close(torch.autograd.Function):
    """Identity; its backward (run after the piece's: it sits on the piece's input) closes the scope."""

    @staticmethod
    def forward(ctx, threads: CpuThreads, x: torch.Tensor) -> torch.Tensor:
        ctx.threads = threads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.threads.close_backward()
        return None, grad


def backward_scope(threads: CpuThreads, piece, x: torch.Tensor):
    """``piece(x)`` with ``threads``' count in its forward and in its backward, for a piece whose backward is not
    this package's to change (the tiles of :mod:`hf_fpdt.memory.tiling`): identity markers on its input and its
    floating outputs open the scope when backward reaches the outputs and close it when it reaches the input. A
    backward that never reaches the input leaves it open until the next scope (see ``_in_backward_scope``)."""
    marked = x.device.type == "cpu" and x.requires_grad and torch.is_grad_enabled()
    with threads.scope(x.device):
        out = piece(_Close.apply(threads, x) if marked else x)
    if not marked:
        return out
    if isinstance(out, torch.Tensor):
        return _Open.apply(threads, out) if out.requires_grad else out
    return type(out)(_Open.apply(threads, t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in out)
