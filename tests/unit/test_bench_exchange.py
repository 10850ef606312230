"""``python -m hf_fpdt.bench exchange``: end to end at a tiny shape (2 gloo ranks), the table has a row per length
with both variants' times and the same loss bits; bad arguments are one usage line. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from hf_fpdt.bench.__main__ import main
from hf_fpdt.bench.exchange import COLUMNS


@pytest.mark.multiprocess
def test_exchange_prints_both_variants_per_length(capsys, tmp_path):
    out_json = tmp_path / "exchange.json"
    argv = ["exchange", "--seq-lens", "64,96", "--chunk-size", "32", "--steps", "2", "--warmup", "0"]
    assert main([*argv, "--threads", "1", "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# hf_fpdt.bench exchange: gloo on CPU, load")
    assert lines[1].split() == COLUMNS
    rows = [line.split() for line in lines[3:]]
    assert [r[:3] for r in rows] == [["64", "32", "2"], ["96", "32", "2"]]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and r[5].endswith("x")
        assert r[6] == "yes"  # the overlapped step's loss is the synchronous one's, bit for bit
    saved = json.loads(out_json.read_text())
    assert [len(r["times"]["sync"]) for r in saved["rows"]] == [2, 2]


@pytest.mark.parametrize("argv", [["--sp", "1"], ["--seq-lens", "0"], ["--steps", "x"]])
def test_bad_arguments_are_one_usage_line(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["exchange", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exchange" in err[0] and "--help" in err[0]
