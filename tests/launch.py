"""Run a script under ``accelerate launch --config_file accelerate_configs/cpu.yaml``, as ranks without a launcher,
or as several torchrun "nodes" on loopback (tests' helpers).

The processes get one thread each (2 cores are shared), a free rendezvous port (other tests may
launch at the same time) and no ``FPDT_*`` variables from the developer's shell.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu.yaml"
SCRIPTS = ROOT / "tests" / "scripts"  # the scripts tests launch
# A launched process imports this tree (not an installed copy), the tests' helpers and the scripts' shared modules.
IMPORT_PATH = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", SCRIPTS))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(
    script: str | Path, num_processes: int, *args: str, timeout: int = 300, config: Path = CPU_CONFIG
) -> str:
    """Launch ``script`` on ``num_processes`` CPU processes with the Accelerate ``config`` (default: cpu.yaml);
    returns the output, raises with it on failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([IMPORT_PATH, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config),
        "--num_processes", str(num_processes),
        "--main_process_port", str(_free_port()),
        str(script), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}")
    return out


def torchrun_nodes(
    script: str | Path, nodes: int, per_node: int, *args: str, timeout: float = 120
) -> list[tuple[int, str]]:
    """Start ``script`` as ``nodes`` "nodes" of ``per_node`` CPU processes on loopback, the way a multi-node job
    starts: one ``torchrun --nnodes N --nproc-per-node P --node-rank k --master-addr 127.0.0.1 --master-port
    PORT`` per node, all at once (static rendezvous; node k's ranks are ``k * P .. k * P + P - 1`` and their
    ``GROUP_RANK`` is k). Returns ``[(returncode, output)]`` per node; every launcher and its workers are killed
    (each node is its own process group) when they have not all ended within ``timeout`` seconds."""
    import signal
    import tempfile
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([IMPORT_PATH, env.get("PYTHONPATH", "")])
    port = _free_port()
    procs, logs = [], []
    for node in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(script), *args,
        ]  # fmt: skip
        log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty node cannot block on a full pipe
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        logs.append(log)
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        late = [node for node, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and its workers
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if late:
        tails = "\n".join(f"--- node {n}:\n{outputs[n][-3000:]}" for n in range(nodes))
        raise TimeoutError(f"torchrun nodes {late} of {script} {args} still running after {timeout} s\n{tails}")
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


def launch_ranks(
    script: str | Path, num_processes: int, *args: str, timeout: float = 300, env: dict | None = None
) -> list[tuple[int, str, float]]:
    """Start ``script`` once per rank with torchrun's environment but without its agent (which would kill
    the other ranks when one fails), so each rank's own exit is seen: ``[(returncode, output, exit time)]``
    per rank (exit time: ``time.time()`` when the test saw it end)."""
    import time

    port = _free_port()
    procs = []
    for rank in range(num_processes):
        penv = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_")}
        penv.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
        penv.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_processes))
        penv.update(LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        penv["PYTHONPATH"] = os.pathsep.join([IMPORT_PATH, penv.get("PYTHONPATH", "")])
        penv.update(env or {})
        cmd = [sys.executable, str(script), *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    ends: dict[int, float] = {}
    deadline = time.time() + timeout
    while len(ends) < num_processes:
        for rank, proc in enumerate(procs):
            if rank not in ends and proc.poll() is not None:
                ends[rank] = time.time()
        if time.time() > deadline:
            for proc in procs:
                proc.kill()
            raise TimeoutError(f"{script} {args} still running after {timeout} s")
        time.sleep(0.05)
    return [(p.returncode, p.stdout.read().decode(errors="replace"), ends[r]) for r, p in enumerate(procs)]


def fault_ranks(out: Path, shape: str, fault: str, where: str, timeout: float, delay: float) -> list[dict]:
    """Run ``tests/scripts/fault_script.py`` on 2 ranks with ``fault`` at ``where`` (``FAULT_DELAY=delay`` for a late
    rank) and the group's ``timeout``: per rank ``{"rc", "out", "end", **what the rank recorded}``. No rank may end
    in a C++ abort (``terminate called``)."""
    runs = launch_ranks(
        SCRIPTS / "fault_script.py", 2, shape, fault, where, str(timeout), str(out), env={"FAULT_DELAY": str(delay)}
    )
    ranks = []
    for rank, (rc, text, end) in enumerate(runs):
        path = out / f"rank{rank}.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        ranks.append({"rc": rc, "out": text, "end": end, **record})
    for r in ranks:
        assert "terminate called" not in r["out"], r["out"][-3000:]
    return ranks
