"""``python -m hf_fpdt.bench acceptance --quick`` on CPU: every part runs in a worker and lands in the JSON and the
Markdown; a part out of budget is skipped without replacing what an earlier command measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_fpdt.bench import acceptance


def _run(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hf_fpdt.bench", "acceptance", "--device", "cpu", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_run_writes_every_part_and_merges(tmp_path):
    res = _run("--quick", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "acceptance.json").read_text())
    rows = report["rows"]
    assert {r["part"] for r in rows} == set(acceptance.PARTS)
    streamed = [line for line in res.stdout.splitlines() if not line.startswith("#")]
    assert len(streamed) == len(rows)  # one line per row, printed as it finished
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    for r in rows:
        if r["kind"] == "train":
            assert r["step_s"] > 0 and 0 < r["mfu"] < 1 and r["host_max_rss_bytes"] > 0
        else:
            assert r["prefill_s"] > 0
    fpdt = [r for r in rows if r["impl"] == "fpdt" and r["kind"] == "train"]
    assert all(r["backend"] in ("cpu_flash", "math") for r in fpdt)
    assert {r["offload"] for r in fpdt} >= {"on", "off"}
    sdpa = {(r["part"], r["seq_len"]) for r in rows if r["impl"] == "sdpa"}
    assert all(r["vs_sdpa"] > 0 for r in rows if (r["part"], r["seq_len"]) in sdpa)
    big = [r for r in rows if r["part"] == "8b" and r["impl"] == "fpdt"]
    assert all(r["plan_device_peak_bytes"] > 0 and r["plan_host_bytes"] >= 0 for r in big)
    assert max(r["segments"] for r in big) == 2
    summary = report["chunk_summary"]
    assert summary["best_chunk"] in acceptance.QUICK.sweep_chunks and summary["ratio"] > 0
    md = (tmp_path / "acceptance.md").read_text()
    assert md.count("\n| ") == len(rows) + 1 and "chunk_size auto at" in md and "Targets" in md
    for column in acceptance.COLUMNS:
        assert column in md
    # on CPU: no device reserve, no allocator retries, nothing pinned ("-"); the host pool's pageable bytes
    assert not any(k in r for r in rows for k in ("gpu_reserved_bytes", "alloc_retries", "host_pinned_bytes"))
    assert all(r["host_pool_bytes"] >= 0 for r in rows if r["impl"] == "fpdt")
    assert any(r["host_pool_bytes"] > 0 for r in fpdt if r["offload"] == "on")

    # a second command with no budget: its rows are skipped, the measured ones stay; the table keeps every part
    again = _run("--quick", "--only", "eval", "--budget-s", "0", "--out", str(tmp_path))
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("skipped: budget") == 2
    merged = json.loads((tmp_path / "acceptance.json").read_text())["rows"]
    assert len(merged) == len(rows)
    assert all(r["error"] is None for r in merged if r["part"] == "eval")


def test_memory_columns_of_a_gpu_row_and_a_cpu_row():
    base = {"part": "8b", "seq_len": 131072, "label": "fpdt", "impl": "fpdt", "error": None}
    gpu = {**base, "gpu_peak_bytes": 70 << 30, "gpu_reserved_bytes": 75 << 30, "alloc_retries": 0,
           "host_pinned_bytes": 96 << 30, "host_pool_bytes": 64 << 30}  # fmt: skip
    cpu = {**base, "host_pool_bytes": 3 << 20}
    at = {
        name: acceptance.COLUMNS.index(name) for name in ("GPU reserved", "alloc retries", "host pinned", "host pool")
    }
    got = {name: acceptance.cells(gpu)[i] for name, i in at.items()}
    assert got == {
        "GPU reserved": "75.00 GiB",
        "alloc retries": "0",
        "host pinned": "96.00 GiB",
        "host pool": "64.00 GiB",
    }
    got = {name: acceptance.cells(cpu)[i] for name, i in at.items()}
    assert got == {"GPU reserved": "-", "alloc retries": "-", "host pinned": "-", "host pool": "3.0 MiB"}
    assert len(acceptance.cells(cpu)) == len(acceptance.COLUMNS)


def test_rows_of_the_full_run():
    args = acceptance.argparse.Namespace(seq_lens=None, chunks=None)
    rows = acceptance.plan_rows(list(acceptance.PARTS), acceptance.FULL, args)
    llama = [r for r in rows if r["part"] == "llama1b"]
    assert sorted({r["seq_len"] for r in llama}) == [32768, 65536, 131072, 262144]
    assert sum(r["impl"] == "sdpa" for r in llama) == 4
    big = [r for r in rows if r["part"] == "8b"]
    assert [r["seq_len"] for r in big if r["impl"] == "fpdt"] == [131072, 262144, 524288, 1048576]
    assert all(r["fresh"] and r["lora"] == 16 for r in big)
    assert len({(r["part"], r["key"]) for r in rows}) == len(rows)  # a row's key is unique within its part
