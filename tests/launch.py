"""Run a script under ``accelerate launch --config_file accelerate_configs/cpu.yaml`` (tests' helper).

The processes get one thread each (2 cores are shared), a free rendezvous port (other tests may
launch at the same time) and no ``FPDT_*`` variables from the developer's shell.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu.yaml"


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
