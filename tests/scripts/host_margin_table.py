"""The host margin's table: what a first training step takes on the host against what the plan says.

``python tests/scripts/host_margin_table.py [--models tiny-llama,small-llama] [--lengths 1024,4096,8192]``: for
each point, a fresh process runs ``rlimit_step.py none`` (no limit; fp32, chunk 4096, checkpointing, full
finetune, glibc's default allocator settings) and the table gives, in MiB, the plan's predicted growth of the
host, its margin (:func:`hf_fpdt.memory.planner.host_margin`), the two together (what the plan asks a cgroup or
the RAM to leave the step), the resident-set growth measured, the address-space growth measured (an upper
bound of what ``RLIMIT_AS`` must leave: unlimited, glibc maps per-thread arenas it can do without), and
resident growth / (plan + margin), which must stay below 1. docs/guides/memory.md has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny-llama,small-llama")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    columns = ["model", "tokens", "threads", "plan", "margin", "plan + margin", "RSS growth", "VmPeak growth"]
    print("| " + " | ".join([*columns, "RSS / (plan + margin)"]) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for model in args.models.split(","):
        for seq in args.lengths.split(","):
            cmd = [sys.executable, str(HERE / "rlimit_step.py"), "none", seq, model]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            mib = [f"{r[k]:.1f}" for k in ("plan_peak", "margin", "plan_bound", "rss_growth", "vm_growth")]
            ratio = f"{r['rss_growth'] / r['plan_bound']:.2f}"
            print("| " + " | ".join([model, seq, str(r["threads"]), *mib, ratio]) + " |", flush=True)


if __name__ == "__main__":
    main()
