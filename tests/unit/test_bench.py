"""``python -m hf_fpdt.bench speed`` end to end on a tiny preset, and the shared bench helpers.

A correctness test of the CLI and the formulas: no timing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys

import pytest
import torch

from hf_fpdt.bench import common, speed
from hf_fpdt.bench import step as bench_step
from hf_fpdt.models.presets import load_model_config, preset_config


def _run_speed(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    return speed.run(parser.parse_args(argv))


def test_speed_cli_prints_a_table_with_every_column(capsys, monkeypatch, tmp_path):
    real_build = speed.build

    def build(variant, *args):  # marks in the output when each model is built
        print(f"# building {variant.name}")
        return real_build(variant, *args)

    monkeypatch.setattr(speed, "build", build)
    argv = ["--model", "tiny-llama", "--seq-lens", "48,32", "--chunk-size", "16,4096", "--offload", "on,off"]
    argv += ["--steps", "1", "--warmup", "0", "--device", "cpu", "--peak-tflops", "1", "--no-memory"]
    argv += ["--json", str(tmp_path / "speed.json"), "--plot", str(tmp_path / "speed.png")]
    assert _run_speed(argv) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("seq_len"))
    for column in speed.COLUMNS:
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 2 :] if not line.startswith("#")]
    assert len(rows) == 10  # per length: the baseline and 2 chunk sizes x 2 offload settings
    # streamed: the rows of 48 tokens are printed before the models of 32 tokens are built
    first_32 = next(i for i, line in enumerate(lines) if line.split()[:1] == ["32"])
    builds = [i for i, line in enumerate(lines) if line.startswith("# building")]
    assert max(i for i, line in enumerate(lines) if line.split()[:1] == ["48"]) < builds[5] < first_32
    for length, group in (("48", rows[:5]), ("32", rows[5:])):
        assert group[0][:2] == [length, "sdpa+ckpt"] and group[0][-1] == "1.00x"
        assert {(r[2], r[3]) for r in group[1:]} == {("16", "on"), ("16", "off"), ("4096", "on"), ("4096", "off")}
    for r in rows:
        assert r[1] in ("sdpa+ckpt", "fpdt+ckpt")
        assert float(r[4]) > 0  # step seconds
        assert r[6].endswith("%")  # MFU
        assert r[-1].endswith("x")
        assert "n/a" in r  # exposed transfer: no host link on CPU
    assert "MFU peak: 1 TFLOP/s (--peak-tflops)" in out

    report = json.loads((tmp_path / "speed.json").read_text())
    assert report["peak_flops"] == 1e12 and report["device"] == "cpu" and len(report["rows"]) == 10
    for printed, rec in zip(rows, report["rows"]):
        assert (str(rec["seq_len"]), rec["impl"], rec["chunk"], rec["offload"]) == tuple(printed[:4])
        assert f"{rec['step_s']:.3f}" == printed[4] and len(rec["steps_s"]) == 1
        assert rec["mfu"] == pytest.approx(float(printed[6].rstrip("%")) / 100, abs=6e-4)  # the same fixed peak
        assert rec["exposed_transfer_s"] is None and rec["error"] is None
        assert f"{rec['vs_sdpa']:.2f}x" == printed[-1]
    png = (tmp_path / "speed.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # two panels with five lines each


@pytest.mark.multiprocess
def test_speed_cli_module_entry_point(tmp_path):
    cfg = preset_config("tiny-llama").to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "hf_fpdt.bench", "speed", "--model", str(path), "--seq-lens", "32"]
    cmd += ["--steps", "1", "--warmup", "0", "--no-offload", "--device", "cpu", "--dtype", "fp32", "--threads", "1"]
    cmd += ["--sequential", "--peak-tflops", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if "+ckpt" in line and not line.startswith("#")]
    assert [r[1] for r in rows] == ["sdpa+ckpt", "fpdt+ckpt"] and rows[1][3] == "off"
    for r in rows:  # peak memory from the child process: a number and a unit, not n/a
        assert r[7] != "n/a" and r[8] in ("B", "KiB", "MiB", "GiB")


def test_load_model_config_from_preset_json_and_folder(tmp_path):
    assert load_model_config("tiny-llama").hidden_size == 64
    cfg = preset_config("tiny-neox")
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    from_file = load_model_config(str(tmp_path / "config.json"))
    from_dir = load_model_config(str(tmp_path))
    assert type(from_file) is type(cfg) and type(from_dir) is type(cfg)
    assert from_file.hidden_size == from_dir.hidden_size == cfg.hidden_size
    with pytest.raises(ValueError, match="preset"):
        load_model_config("no-such-model")


def test_step_flops_formula():
    cfg = preset_config("small-llama")
    n, b, s = 1000, 2, 4096
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    attention = 3 * 2 * 2 * b * s * s * heads * head_dim * cfg.num_hidden_layers / 2  # causal: half
    assert common.step_flops(cfg, n, b, s) == pytest.approx(6 * n * b * s + attention)


def test_matmul_params_leave_out_an_untied_input_embedding():
    cfg = preset_config("tiny-llama")
    model = common.build_model(cfg, torch.float32, torch.device("meta"))
    total = sum(p.numel() for p in model.parameters())
    assert common.matmul_params(model) == total - cfg.vocab_size * cfg.hidden_size


def test_format_helpers_and_dtypes():
    table = common.format_table(["a", "bb"], [["1", "22"], ["333", "4"]])
    assert table.splitlines()[0] == "  a  bb" and table.splitlines()[2] == "  1  22"
    assert common.format_bytes(None) == "n/a" and common.format_bytes(3 << 30) == "3.00 GiB"
    assert common.parse_dtype("bf16") is torch.bfloat16 and common.parse_dtype("FP32") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        common.parse_dtype("int8")


def test_variants_and_offload_parsing():
    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    args = parser.parse_args(["--chunk-size", "1024,auto", "--offload", "auto"])
    names = [(v.name, v.fpdt) for v in speed.variants(args)]
    assert names == [
        ("sdpa+ckpt", None),
        ("fpdt+ckpt", {"chunk_size": 1024, "offload": "auto"}),
        ("fpdt+ckpt", {"chunk_size": "auto", "offload": "auto"}),
    ]
    assert speed.variants(parser.parse_args(["--no-baseline"]))[0].fpdt == {}
    assert parser.parse_args(["--offload"]).offload == "on"
    assert parser.parse_args(["--no-offload"]).offload == "off"


def test_matmul_peak_keeps_the_best_reading():
    sampler = common.MatmulPeak(torch.device("cpu"), torch.float32, n=64)
    first = sampler.sample()
    assert first > 0 and sampler.sample(2) >= first
    assert common.peak_flops(torch.device("cpu"), torch.float32)[1].startswith("measured")


def test_out_of_memory_is_a_row_not_a_crash(monkeypatch, capsys):
    real_step = bench_step.train_step

    def step(model, batch):
        if hasattr(model, "fpdt"):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real_step(model, batch)

    monkeypatch.setattr(bench_step, "train_step", step)
    argv = ["--model", "tiny-llama", "--seq-lens", "32", "--steps", "1", "--warmup", "1", "--device", "cpu"]
    assert _run_speed([*argv, "--peak-tflops", "1", "--no-memory"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "+ckpt" in line]
    rows = [r for r in rows if r[0] != "#"]
    assert rows[0][1] == "sdpa+ckpt" and rows[0][-1] == "1.00x"
    assert rows[1][1] == "fpdt+ckpt" and rows[1][4:9] == ["OOM"] * 5 and rows[1][-1] == "-"


# ---------------------------------------------------------------------------- bench plan: bad arguments exit 2

USAGE_ERRORS = [  # argparse's checks: SystemExit(2), one line naming the option
    ("--seq-len", "abc"),
    ("--seq-len", "-5"),
    ("--seq-len", "4096,0"),
    ("--chunk-size", "0"),
    ("--sp", "0"),
    ("--dp", "0"),
    ("--batch", "0"),
    ("--lora-rank", "-1"),
    ("--local-processes", "0"),
    ("--segments", "two"),
]
PLAN_ERRORS = [  # what plan() refuses: return code 2, one line naming the option and plan()'s message
    (
        ["--sp", "33", "--ring", "1"],
        "argument --ring: ring_degree=1 (FPDTConfig.ring_degree / FPDT_RING_DEGREE): it "
        "leaves 33 ranks to split the model's 32 attention heads",
    ),  # fmt: skip
    (
        ["--sp", "64", "--ring", "3"],
        "argument --ring: ring_degree=3 (FPDTConfig.ring_degree / FPDT_RING_DEGREE): it does not divide sp_size=64",
    ),  # fmt: skip
    (["--device-memory", "-1"], "argument --device-memory: device_memory='-1'"),
    (["--host-memory", "lots"], "argument --host-memory: host_memory='lots'"),
    (["--dtype", "int8"], "argument --dtype: dtype='int8' is unknown"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
]


@pytest.mark.parametrize("option, value", USAGE_ERRORS)
def test_bench_plan_usage_errors_are_one_line_and_exit_2(option, value, capsys):
    from hf_fpdt.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", option, value])
    assert exit_info.value.code == 2  # 1 is "does not fit"
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert f"error: argument {option}: expected" in captured.err and repr(value) in captured.err


@pytest.mark.parametrize("argv, message", PLAN_ERRORS)
def test_bench_plan_arguments_plan_refuses_exit_2(argv, message, capsys):
    from hf_fpdt.bench.__main__ import main

    assert main(["plan", "--seq-len", "4096", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1  # nothing planned, no traceback
    assert captured.err.startswith("python -m hf_fpdt.bench plan: error: ") and message in captured.err


def test_bench_plan_takes_chunk_size_auto(capsys):
    from hf_fpdt.bench.__main__ import main

    assert main(["plan", "--seq-len", "8192", "--chunk-size", "auto", "--host-memory", "unlimited"]) == 0
    assert "fits" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_bench_plan_exit_codes_from_the_shell():
    """As a user runs it: a bad argument is one line on stderr and exit code 2, no traceback; a length that does
    not fit is exit code 1."""
    cmd = [sys.executable, "-m", "hf_fpdt.bench", "plan", "--model", "small-llama", "--device", "cpu"]
    bad = subprocess.run(cmd + ["--seq-len", "abc"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "python -m hf_fpdt.bench plan: error: argument --seq-len: expected comma-separated token counts >= 1, got "
        "'abc' (see python -m hf_fpdt.bench plan --help)"
    ]
    over = subprocess.run(
        cmd + ["--seq-len", "4096", "--host-capacity", "1MiB"], capture_output=True, text=True, timeout=120
    )
    assert over.returncode == 1 and "DOES NOT FIT" in over.stdout


# Bad arguments of every measuring command (issue 43, item 7): one line on stderr, exit code 2, nothing measured.
# Each used to end in a traceback with exit code 1 (speed and memory once the model was built, eval at once).
COMMAND_USAGE_ERRORS = [
    ("speed", "--chunk-size", "0"),
    ("speed", "--chunk-size", "16,abc"),
    ("speed", "--seq-lens", "abc"),
    ("speed", "--offload", "maybe"),
    ("speed", "--sparsity", "0"),
    ("speed", "--steps", "0"),
    ("speed", "--dtype", "int8"),
    ("speed", "--device", "gpu0"),
    ("speed", "--model", "no-such-model"),
    ("eval", "--lengths", "abc"),
    ("eval", "--depths", "2"),
    ("eval", "--samples", "0"),
    ("eval", "--chunk-size", "0"),
    ("memory", "--chunk-size", "0"),
    ("memory", "--lengths", "0"),
    ("memory", "--modes", "fpdt,bogus"),
    ("memory", "--host-memory", "lots"),
    ("memory", "--segments", "0"),
    ("acceptance", "--seq-lens", "abc"),
    ("acceptance", "--chunks", "0"),
    ("acceptance", "--only", "8b,bogus"),
    ("acceptance", "--budget-s", "-1"),
    ("acceptance", "--dtype", "int8"),
    ("acceptance", "--device", "gpu0"),
    ("acceptance", "--steps", "0"),
]


@pytest.mark.parametrize("command, option, value", COMMAND_USAGE_ERRORS)
def test_every_command_usage_error_is_one_line_and_exit_2(command, option, value, capsys, monkeypatch):
    from hf_fpdt.bench.__main__ import main

    def refuse(*args, **kwargs):  # nothing may be measured or built
        raise AssertionError("the command ran")

    for name in ("speed", "eval", "memory", "acceptance"):
        monkeypatch.setattr(importlib.import_module(f"hf_fpdt.bench.{name}"), "run", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main([command, option, value])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith(f"python -m hf_fpdt.bench {command}: error: argument {option}: ")
    assert repr(value) in captured.err


@pytest.mark.multiprocess
def test_usage_errors_from_the_shell_the_issue_named():
    """The three commands of issue 43 as a user runs them: one line on stderr, exit code 2, no traceback."""
    for argv in (["speed", "--chunk-size", "0"], ["eval", "--lengths", "abc"], ["memory", "--chunk-size", "0"]):
        res = subprocess.run(
            [sys.executable, "-m", "hf_fpdt.bench", *argv], capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 2 and res.stdout == "", (argv, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr


def test_speed_in_a_log_prints_a_line_per_finished_step(capsys):
    """Where stdout is not a terminal (here: captured) the progress bar is not seen: each finished step is a
    ``# S=...`` line, printed before its length's rows."""
    argv = ["--model", "tiny-llama", "--seq-lens", "32", "--chunk-size", "16", "--steps", "2", "--warmup", "1"]
    assert _run_speed([*argv, "--device", "cpu", "--peak-tflops", "1", "--no-memory"]) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("# S=32 [")]
    assert [line.split("]")[0] for line in progress] == [f"# S=32 [{k}/6" for k in range(1, 7)]  # 2 variants x 3
    assert sum("warm-up 1/1:" in line for line in progress) == 2 and sum("timed 2/2:" in line for line in progress) == 2
    assert all(re.search(r": \d+\.\d{3} s \(\d+ s elapsed\)$", line) for line in progress), progress
    first_row = next(i for i, line in enumerate(lines) if line.split()[:2] == ["32", "sdpa+ckpt"])
    assert lines.index(progress[-1]) < first_row


def test_progress_lines_only_where_the_bar_is_not_seen(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # a terminal: the bar alone
    quiet = common.Progress(2, "x", "step")
    quiet.done("one")
    quiet.close()
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)  # a pipe or a file
    log = common.Progress(2, "x", "step")
    log.done("one")
    log.done("two")
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out] == ["# x [1/2] one", "# x [2/2] two"]


@pytest.mark.parametrize(
    "command, dest",
    [("speed", "seq_lens"), ("memory", "lengths"), ("eval", "lengths"), ("plan", "seq_len"), ("masked", "length"),
     ("exchange", "seq_lens"), ("acceptance", "seq_lens")],
)  # fmt: skip
def test_one_length_option_on_every_subcommand(command, dest):
    """``--seq-len`` on every subcommand; the spellings of earlier releases (``--seq-lens``, ``--lengths``,
    ``--length``) as aliases of it."""
    from hf_fpdt.bench.__main__ import parse
    from hf_fpdt.bench.cli import LENGTH_FLAGS

    values = []
    for flag in LENGTH_FLAGS:
        args, _ = parse([command, flag, "4096"])
        values.append(getattr(args, dest))
    assert len(values) == 4 and all(v == values[0] for v in values)
    assert "4096" in str(values[0])


@pytest.mark.parametrize("command", ["speed", "memory", "eval", "plan", "masked", "exchange", "acceptance"])
def test_help_pages_are_plain_text_and_an_unknown_option_gets_the_subcommands_usage(command, capsys):
    """``--help`` shows no reST markup (double backquotes, ``:mod:``-style roles); an option the subcommand does not
    know: its usage, then one error line, exit code 2."""
    from hf_fpdt.bench.__main__ import parse

    with pytest.raises(SystemExit) as done:
        parse([command, "--help"])
    assert done.value.code == 0
    page = capsys.readouterr().out
    assert "--seq-len" in page and "``" not in page
    assert not re.search(r":(mod|func|meth|class|attr|data):`", page), page
    with pytest.raises(SystemExit) as done:
        parse([command, "--no-such-option", "1"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith(f"usage: python -m hf_fpdt.bench {command}") and "unrecognized arguments: --no-such" in err
