"""``python -m hf_fpdt.bench masked``: its cases run (in-process at a tiny shape), its table's ratio is to the causal
row of the same shape, bad arguments are one usage line, and the whole command end to end (child processes)."""

from __future__ import annotations

import pytest

from hf_fpdt.bench import masked

TINY = {"length": 160, "chunk_size": 64, "backend": "math", "window": 20, "documents": 3, "softcap": 5.0}


@pytest.mark.parametrize(
    "case",
    [
        "causal",
        "documents",
        "padding",
        "window",
        "causal-gemma2",
        "softcap",
        "mask4d",
        "scan4d",
        "prefill-causal",
        "prefill",
        "prefill-attn",
    ],
)
def test_each_case_runs_one_step(case):
    res = masked.measure({**TINY, "case": case, "device": "cpu", "threads": 1})
    assert res["case"] == case and res["peak_bytes"] is not None and res["seconds"] > 0
    if case == "scan4d" or case.startswith("prefill"):  # no training step: no loss
        assert res.get("loss") is None
    else:
        assert 0 < res["loss"] < 20  # a finite cross-entropy over a 1024-token vocabulary


def test_batches_mask_what_their_case_says():
    import torch

    docs = masked._batch("documents", 160, TINY, torch.device("cpu"))["position_ids"][0]
    assert int((docs == 0).sum()) == 3  # three documents, each restarting at 0
    pad = masked._batch("padding", 160, TINY, torch.device("cpu"))
    assert int((pad["attention_mask"] == 0).sum()) == 16 and bool((pad["labels"][0, :16] == -100).all())
    dense = masked._batch("mask4d", 160, TINY, torch.device("cpu"))
    keep = torch.ones(160, 160, dtype=torch.bool).tril()
    keep[:, :16] = False  # causal, the first tenth of the keys dropped
    assert torch.equal(dense["attention_mask"], keep[None, None]) and bool((dense["labels"][0, :16] == -100).all())
    assert masked._scan(dense, 64).needed(2, 1) and not masked._scan(dense, 16).needed(5, 0)
    assert masked.model_config("window", TINY).sliding_window == 20
    assert masked.model_config("prefill", TINY).sliding_window == 20
    assert masked.model_config("softcap", TINY).attn_logit_softcapping == 5.0
    assert masked.model_config("causal-gemma2", TINY).attn_logit_softcapping is None


def test_ratios_are_to_the_causal_row_of_the_same_shape():
    mib = 1 << 20
    results = [
        {"case": "causal", "peak_bytes": 100 * mib, "seconds": 1.0},
        {"case": "documents", "peak_bytes": 120 * mib, "seconds": 1.5},
        {"case": "causal-gemma2", "peak_bytes": 200 * mib, "seconds": 1.0},
        {"case": "softcap", "peak_bytes": 250 * mib, "seconds": 2.0},
        {"case": "window", "error": "timed out after 5s"},
        {"case": "scan4d", "peak_bytes": 5 * mib, "seconds": 0.5},
        {"case": "prefill-causal", "peak_bytes": 40 * mib, "seconds": 1.0},
        {"case": "prefill", "peak_bytes": 50 * mib, "seconds": 1.0},
    ]
    rows = {r[0]: r for r in masked.rows(results)}
    assert rows["prefill"][2] == "1.25x" and rows["scan4d"][2] == "-"  # a prefill against the causal prefill
    assert rows["documents"][2] == "1.20x" and rows["softcap"][2] == "1.25x" and rows["causal"][2] == "1.00x"
    assert rows["causal-gemma2"][2] == "1.00x"  # its own shape's reference, not Llama's
    assert rows["window"][1:] == ["timed out after 5s", "-", "-"]


@pytest.mark.parametrize("argv", [["--length", "0"], ["--cases", "causal,holes"], ["--backend", "fast"]])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    from hf_fpdt.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["masked", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m hf_fpdt.bench masked: error: argument")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_command_prints_the_table(capsys):
    from hf_fpdt.bench.__main__ import main

    argv = ["--length", "160", "--chunk-size", "64", "--window", "20", "--cases", "window,softcap", "--device", "cpu"]
    assert main(["masked", *argv, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert set(lines) == {"causal", "window", "causal-gemma2", "softcap"}
    assert lines["causal"][-2] == "1.00x" and lines["softcap"][-2].endswith("x")
