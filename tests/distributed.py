"""Test harness: run one function in N real processes joined by torch.distributed, collect the results.

Usage (from a test module in this folder; ``fn`` must be a top-level function of an importable module,
because the processes start clean, forked from a server process (``forkserver``), and import it by name)::

    from distributed import run_distributed

    def _worker(rank: int, world_size: int, n: int) -> torch.Tensor:
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)                       # the default (world) group is initialised
        return t

    def test_sum():
        results = run_distributed(_worker, 2, 3)  # [result of rank 0, result of rank 1]

Each process: ``torch.set_num_threads(num_threads)``, ``init_process_group(backend)`` over the TCP store the
parent hosts on 127.0.0.1 at a free port, ``fn(rank, world_size, *args, **kwargs)``, then ``destroy_process_group``.
The parent hosts the store as torchrun's and ``accelerate launch``'s agent does (``TORCHELASTIC_USE_AGENT_STORE``):
a failed rank's note there (:func:`hf_fpdt.distributed.peers.leave_note`) outlives that rank's process, so a peer
whose collective fails when the rank exits can still read it.
Results travel back through ``torch.save`` bytes (tensors, dicts of tensors, plain objects).

When a rank raises, the parent re-raises that exception with its type (so ``pytest.raises(ValueError,
match=...)`` works), chained to the remote traceback (:class:`RemoteTraceback`). The cause is the first
failure to arrive, with the communication errors of ranks left waiting in a collective ranked last;
those ranks are terminated after ``grace`` seconds. A run that exceeds ``timeout`` raises
``TimeoutError`` naming the ranks that did not report.

Worker functions that need a failure *and* a result to compare can catch inside and return the
message instead (see ``test_sp_errors.py``); that saves a process start per case.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RemoteTraceback", "free_port", "run_distributed"]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (the ``__cause__`` of the re-raised one)."""

    def __str__(self) -> str:
        return self.args[0]


def group_loss_and_grads(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    """Backward of this rank's ``loss``, then the loss and every parameter gradient summed over the world.

    Under SP each rank's loss is its share of the sample's loss, so the sums are what one process
    computes on the whole sample: ``{"loss": tensor, "grads": {name: tensor}}``.
    """
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": total, "grads": grads}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# What the forkserver imports once, so that each rank forked from it starts without importing them again (about 5 s
# of CPU per rank, hundreds of ranks in a run of the suite); a rank still imports its test's module.
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "peft", "hf_fpdt", "testkit")


SESSION_ENV = dict(os.environ)  # at import (collection): the environment no test has changed yet


# Read when a process starts (the C allocator, the OpenMP runtime torch loads, the interpreter): a caller setting one
# to something the session did not have gets freshly spawned ranks, which read it.
AT_START = ("MALLOC_", "LD_", "PYTHON", "OMP_", "KMP_", "MKL_", "GOMP_")


def _started_fresh() -> bool:
    changed = set(os.environ.items()) ^ set(SESSION_ENV.items())
    return any(name.startswith(AT_START) for name, _ in changed)


def _context() -> mp.context.BaseContext:
    """``forkserver``: a clean process forked per rank (no state of the test process, as with ``spawn``) from a server
    that imported :data:`PRELOAD` once, started under :data:`SESSION_ENV` (what a module reads from the environment
    when imported is the session's, whichever test starts the server); each rank then takes the caller's environment
    (:func:`_worker`). ``spawn`` when the caller changed what a process reads as it starts (:data:`AT_START`)."""
    if _started_fresh():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(SESSION_ENV)
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        os.environ.clear()
        os.environ.update(current)
    return ctx


def _worker(
    rank: int, world_size: int, port: int, backend: str, num_threads: int, payload: bytes, results, env: dict
) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's from when it started
    os.environ.update(env)
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG, read by torch when the server imported it
    torch.set_num_threads(num_threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        fn, args, kwargs, timeout = pickle.loads(payload)
        wait = timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)
        report = (rank, True, _dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt / SystemExit
        report = (rank, False, (_picklable(exc), traceback.format_exc()))
    results.put(report)  # before the teardown, which makes peers stuck in a collective fail too
    if dist.is_initialized():
        dist.destroy_process_group()


def _is_peer_failure(exc: BaseException) -> bool:
    # What a rank raises when another rank died or left a collective: a consequence, not the cause.
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower())


def _port_in_use(exc: BaseException) -> bool:
    return "address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 180.0,
    num_threads: int = 1,
    grace: float = 10.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes.

    Args:
        fn: a picklable top-level function; its return value must survive ``torch.save``.
        world_size: number of processes (ranks 0..world_size-1 of the default group).
        backend: torch.distributed backend (``"gloo"`` for CPU tests).
        timeout: seconds for the whole run (also the collectives' timeout).
        num_threads: ``torch.set_num_threads`` in every worker.
        grace: seconds the other ranks get to finish after one rank failed.

    Returns:
        The return values of ``fn``, in rank order.
    """
    payload = pickle.dumps((fn, args, kwargs, timeout))
    for attempt in range(3):  # the free port can be taken between free_port() and the bind
        try:
            return _run_once(payload, world_size, backend, timeout, num_threads, grace)
        except Exception as exc:
            if attempt == 2 or not _port_in_use(exc):
                raise
    raise AssertionError("unreachable")


def _run_once(payload: bytes, world_size: int, backend: str, timeout: float, num_threads: int, grace: float) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, num_threads, payload, results, dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, ok, data = results.get(timeout=min(1.0, deadline - now))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                for r in dead:  # killed without reporting (segfault, OOM)
                    outcome[r] = (False, (RuntimeError(f"rank {r} exited with code {procs[r].exitcode}"), ""))
                continue
            outcome[rank] = (ok, data)
            if not ok:  # the others may be stuck in a collective with the failed rank
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        complete = len(outcome) == world_size
        for p in procs:
            p.join(10 if complete else 0)
            if p.is_alive():
                p.terminate()
                p.join(5)
        results.close()
        del store  # the store's server stops once every rank has ended
    # The cause: the first failure to arrive that is not a peer's communication error.
    failed = sorted((r for r, (ok, _) in outcome.items() if not ok), key=lambda r: _is_peer_failure(outcome[r][1][0]))
    if failed:
        exc, tb = outcome[failed[0]][1]
        raise exc from RemoteTraceback(f"rank {failed[0]} of {world_size} (failed ranks: {failed}):\n{tb}")
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
    return [_loads(outcome[r][1]) for r in range(world_size)]
