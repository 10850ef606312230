"""``tests/scripts/trace_vs_h100.py`` (issue 50, item 4: the trace against the H100 figures of 2026-11-22) kept
working: one row at a small length, traced with this checkout's code and, where the history has it, with the code
that was measured (``7dab724``), each under this checkout's tracer in one process. Nothing here checks H100 numbers
(the script prints those); it checks that the script traces the step of either code and reports it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "trace_vs_h100.py"
MEASURED = "7dab724"  # the last commit of 2026-11-21: the code the H100 ran on 2026-11-22


def _run(code: Path, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--code", str(code), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _row(code: Path) -> dict:
    res = _run(code, "--rows", "1b_fpdt_16K_on_32K", "--seq-len", "2048", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    row = json.loads(res.stdout.strip().splitlines()[-1])
    traced = res.stderr.split("# traced code: ", 1)[1].split(";", 1)[0]
    assert Path(traced).resolve() == (code / "hf_fpdt").resolve()  # the code asked for, not the tracer's own
    return row


def _check(row: dict) -> None:
    assert row["seq_len"] == 2048 and row["measured"] == {}  # another length: nothing compared
    assert row["step_s"] > 0 and 0 < row["mfu"] < 1 and 0 < row["busy"] <= 1
    assert row["peak_gib"] > 0 and row["error"] is None and not row["device_oom"]
    assert row["peak_holders"] and all(len(h) == 4 for h in row["peak_holders"])


def test_the_script_traces_this_checkouts_step():
    _check(_row(ROOT))


def test_the_script_traces_the_measured_code(tmp_path):
    has = subprocess.run(["git", "cat-file", "-e", f"{MEASURED}^{{commit}}"], cwd=ROOT, capture_output=True)
    if has.returncode != 0:
        pytest.skip(f"{MEASURED} is not in this clone's history (a shallow clone)")
    archive = subprocess.run(["git", "archive", MEASURED, "hf_fpdt"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    _check(_row(tmp_path))


def test_the_script_refuses_a_checkout_without_the_package(tmp_path):
    res = _run(tmp_path, "--rows", "1b_sdpa_32K")
    assert res.returncode == 2 and "no hf_fpdt package there" in res.stderr
