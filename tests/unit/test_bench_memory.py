"""``python -m hf_fpdt.bench memory``: the table, the budget fit, and one real point (no size asserted
beyond being positive: memory figures are environment-dependent)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from hf_fpdt.bench import memory

GIB = 1 << 30


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    return parser.parse_args(argv)


def test_longest_fit_measured_and_linear():
    points = [{"length": n, "peak_bytes": 1000 + 10 * n} for n in (100, 200, 400)]
    assert memory.longest_fit(points, 1000 + 10 * 300) == (200, 300)
    assert memory.longest_fit(points, 500) == (None, None)  # the fixed cost alone is over the budget: no length
    assert memory.longest_fit([{"length": 8, "error": "exit code -9"}], GIB) == (None, None)


def test_table_has_a_row_per_length_and_the_ratio():
    results = [
        {"mode": "sdpa", "length": 64, "peak_bytes": 2 * GIB},
        {"mode": "fpdt", "length": 64, "peak_bytes": GIB // 4, "host_store_bytes": GIB // 8},
        {"mode": "sdpa", "length": 128, "error": "exit code -9"},
        {"mode": "fpdt", "length": 128, "peak_bytes": GIB // 2, "host_store_bytes": 0},
    ]
    table = memory.format_table(results, ["sdpa", "fpdt"], [64, 128]).splitlines()
    assert table[0] == "| seq len | sdpa peak GiB | fpdt peak GiB | sdpa / fpdt | fpdt host-store GiB |"
    assert table[2] == "| 64 | 2.000 | 0.250 | 8.0x | 0.125 |"
    assert table[3] == "| 128 | exit code -9 | 0.500 | - | 0.000 |"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_point_in_process_and_the_cli_end_to_end(tmp_path):
    point = memory._measure_point(_args(["--model", "tiny-llama", "--chunk-size", "16"]), "fpdt", 40)
    # in-process the step may reuse memory earlier tests freed (RSS growth 0): only the subprocess run
    # below measures from a fresh process, as the CLI does
    assert point["peak_bytes"] >= 0 and point["loss"] > 0 and point["device"] == "cpu"
    assert point["host_store_bytes"] > 0  # offload=True: the attention's chunks went to the host store
    out = tmp_path / "mem.json"
    argv = ["--model", "tiny-llama", "--lengths", "32", "--modes", "fpdt", "--chunk-size", "16", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "hf_fpdt.bench", "memory", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 32 |" in proc.stdout and "longest sequence within" in proc.stdout
    assert "[1/1] fpdt seq=32" in proc.stderr  # progress output
    results = json.loads(out.read_text())["results"]
    assert results[0]["mode"] == "fpdt" and results[0]["peak_bytes"] > 0


def test_peak_memory_falls_back_to_ru_maxrss_where_vmhwm_cannot_be_reset(monkeypatch):
    import torch

    from hf_fpdt.bench import common

    monkeypatch.setattr(common, "_reset_rss_peak", lambda: False)
    with common.PeakMemory(torch.device("cpu")) as mem:
        block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
        del block
    assert mem.how == "ru_maxrss growth" and mem.bytes is not None and mem.bytes >= 0
