"""``examples/finetune_lora.py`` under ``accelerate launch`` on CPU: FPDT over N processes equals one process.

Same seed, SGD with a large learning rate (so every step's loss depends on the previous gradients),
fp32, tiny Llama with LoRA on every linear layer, 1030-token passkey samples (documents of different
lengths, right-padded), chunk 128 (no chunk divides the length; SP 4 needs padding), 3 steps:

* sp 2 and sp 4 (one sample per step) against one ``sdpa`` process;
* dp 2 x sp 2 (batch 1 per process) against one ``sdpa`` process with batch 2;

per-step global training losses and the eval loss (evaluated under SP) to 1e-4 relative, the eval
accuracy of ``compute_metrics`` (argmax run tile by tile in the tiled head) equal, and the saved LoRA
adapters load back with PEFT and hold the same weights. Every run ends with ``--eval-retrieval``
(passkey answers generated through the KV-cache path; under SP by every rank, the prefill
sequence-parallel). The baseline refuses ``FPDT_SP_SIZE`` > 1.

``examples/grpo.py`` (TRL's GRPOTrainer under FPDT): sp 2 against one ``sdpa`` process, the same losses, rewards
and KL; ``examples/dpo_long.py`` and ``examples/sft_long.py`` (padded and packed) likewise.

What a reader meets (issue 37): the examples are launched as the README launches them, with warnings shown (not
hidden as ``tests/launch.py`` hides them for the other tests): the quickstart's, DPO's and GRPO's runs print at most
one warning line each; the example runs on one plain ``python`` process; a run refuses to replace another run's
adapter or metrics.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import CPU_CONFIG, IMPORT_PATH, ROOT, SCRIPTS, _free_port, accelerate_launch
from testkit import SCRATCH, tiny_model

SCRIPT = ROOT / "examples" / "finetune_lora.py"
COMMON = ("--seq-len", "1030", "--chunk-size", "128", "--max-steps", "3", "--optim", "sgd")
COMMON += ("--learning-rate", "1.0", "--seed", "0", "--num-train-samples", "8", "--num-eval-samples", "2")
COMMON += ("--eval-retrieval", "--eval-depths", "0,1")  # generate() after training, prefill sequence-parallel under SP
RTOL = 1e-4
_TMP = Path(SCRATCH) / "example"  # removed at exit (testkit)
# A warning as the libraries print one: Python's ``...Warning:`` (and the DDP reducer's ``Warning:``), DeepSpeed's
# ``[WARNING]``, transformers' ``[transformers]`` notices, torch.distributed's ``W1127 ...`` lines.
WARNING_LINE = re.compile(r"Warning\b|\[WARNING\]|^\[transformers\]|^W\d{4} ")


def launch_as_a_user(script: Path, num_processes: int | None, *args: str, timeout: int = 300) -> str:
    """The command a reader types: ``accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes N``
    (``None``: plain ``python``), warnings shown as the user sees them (``tests/launch.py`` hides them); one thread
    per process (2 cores are shared). Returns stdout + stderr; raises with them on failure."""
    _TMP.mkdir(parents=True, exist_ok=True)  # the runs' metrics files go there
    env = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_") and k != "PYTHONWARNINGS"}
    env.update(OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([IMPORT_PATH, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(script), *args]
    if num_processes is not None:
        cmd[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
        cmd[5:5] = ["--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}")
    return out


def warning_lines(output: str) -> list[str]:
    """The warning lines of a run's output (progress bars redraw with carriage returns: each redraw is a line)."""
    return [line for line in re.split(r"[\r\n]", output) if WARNING_LINE.search(line)]


@functools.cache
def run(num_processes: int, attn: str, sp_size: int, batch: int = 1, bf16: bool = False) -> dict:
    """Metrics of one launch (cached: several tests share a run); the adapter is in ``metrics['dir']``."""
    name = f"{attn}_np{num_processes}_sp{sp_size}_b{batch}" + ("_bf16" if bf16 else "")
    out_dir, metrics_path = _TMP / name, _TMP / f"{name}.json"
    args = ("--attn", attn, "--sp-size", str(sp_size), "--per-device-batch-size", str(batch))
    args += ("--bf16",) if bf16 else ()
    args += ("--output-dir", str(out_dir), "--metrics-json", str(metrics_path))
    output = launch_as_a_user(SCRIPT, num_processes, *COMMON, *args)
    metrics = json.loads(metrics_path.read_text())
    metrics["dir"], metrics["output"] = str(out_dir), output
    return metrics


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


CASES = {  # FPDT launch -> its one-process sdpa baseline
    "sp2": ((2, "fpdt", 2, 1), (1, "sdpa", 1, 1)),
    "sp4": ((4, "fpdt", 4, 1), (1, "sdpa", 1, 1)),
    "dp2xsp2": ((4, "fpdt", 2, 1), (1, "sdpa", 1, 2)),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_one_process(case: str) -> None:
    fpdt_run, base_run = CASES[case]
    fpdt, base = run(*fpdt_run), run(*base_run)
    assert fpdt["attn"] == "fpdt" and fpdt["world_size"] == fpdt_run[0] and fpdt["sp_size"] == fpdt_run[2]
    assert fpdt["dp_size"] == fpdt_run[0] // fpdt_run[2]
    assert len(base["losses"]) == len(fpdt["losses"]) == 3
    # The learning rate is large enough that the steps move the loss: a wrong gradient shows.
    assert abs(base["losses"][2] - base["losses"][0]) > 1e-2
    for step, (got, want) in enumerate(zip(fpdt["losses"], base["losses"])):
        assert _rel(got, want) < RTOL, f"{case} step {step}: fpdt {got} vs sdpa {want}"
    assert _rel(fpdt["eval_loss"], base["eval_loss"]) < RTOL, (fpdt["eval_loss"], base["eval_loss"])
    # compute_metrics: argmax in the tiled head (fpdt) or over HF's logits (sdpa), the same accuracy.
    assert 0 < base["eval_accuracy"] and fpdt["eval_accuracy"] == base["eval_accuracy"]
    assert fpdt["tokens_per_s"] > 0 and fpdt["peak_memory_bytes"] > 0
    for metrics in (fpdt, base):  # passkey retrieval after finetuning (a tiny model: the value means nothing)
        accuracy = metrics["retrieval_accuracy"]
        assert set(accuracy) == {"overall", "1030/0.0", "1030/1.0"} and 0.0 <= accuracy["overall"] <= 1.0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bf16_mixed_precision_within_twice_sdpa() -> None:
    """``--bf16`` (TrainingArguments(bf16=True): float32 weights under autocast) at sp 2: each step's loss and
    the eval loss are within twice sdpa-bf16's distance from the float32 run (plus 1% of bf16's eps)."""
    fpdt, base, exact = run(2, "fpdt", 2, bf16=True), run(1, "sdpa", 1, bf16=True), run(1, "sdpa", 1)
    floor = 0.01 * torch.finfo(torch.bfloat16).eps
    pairs = list(zip(fpdt["losses"], base["losses"], exact["losses"]))
    pairs.append((fpdt["eval_loss"], base["eval_loss"], exact["eval_loss"]))
    assert len(pairs) == 4
    for step, (got, own, want) in enumerate(pairs):
        assert _rel(got, want) <= 2 * _rel(own, want) + floor, f"step {step}: fpdt {got}, sdpa {own}, fp32 {want}"


@pytest.mark.multiprocess
def test_batch_of_two_differs_from_batch_of_one() -> None:
    # Guards the dp 2 x sp 2 comparison: it must not pass merely because both runs saw one sample.
    assert _rel(run(1, "sdpa", 1, 2)["losses"][0], run(1, "sdpa", 1, 1)["losses"][0]) > 1e-6


@pytest.mark.multiprocess
def test_adapter_loads_back_with_peft() -> None:
    from peft import PeftModel

    fpdt, base = run(2, "fpdt", 2, 1), run(1, "sdpa", 1, 1)
    loaded = {}
    for key, metrics in (("fpdt", fpdt), ("sdpa", base)):
        model = tiny_model("tiny-llama", None, seed=None)
        model = PeftModel.from_pretrained(model, metrics["dir"])
        loaded[key] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert loaded["fpdt"].keys() == loaded["sdpa"].keys() and loaded["fpdt"]
    trained = [n for n, p in loaded["fpdt"].items() if "lora_B" in n and p.abs().max() > 0]
    assert trained, "lora_B starts at zero; after 3 steps it must not be"
    for name, want in loaded["sdpa"].items():
        got = loaded["fpdt"][name]
        assert (got - want).abs().max() <= RTOL * want.abs().max(), name


def _example(script: Path = SCRIPT):
    """An example as a module (its ``main``, ``parse_args``, ...); ``examples/`` on the path for what the examples
    share (``"_common.py"``), as Python puts it there when it runs the script."""
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_sdpa_baseline_refuses_fpdt_sp_size_and_runs_get_their_own_folders(monkeypatch) -> None:
    example = _example()
    monkeypatch.setenv("FPDT_SP_SIZE", "2")
    with pytest.raises(SystemExit):
        example.parse_args(["--attn", "sdpa"])
    assert example.parse_args(["--attn", "fpdt"]).sp_size is None  # fpdt takes it from the environment
    monkeypatch.setenv("FPDT_SP_SIZE", "1")
    sdpa = example.parse_args(["--attn", "sdpa"])
    fpdt = example.parse_args(["--attn", "fpdt"])
    assert example.default_output_dir(sdpa, 1, 1) != example.default_output_dir(fpdt, 1, 1)
    assert example.default_output_dir(fpdt, 2, 2) != example.default_output_dir(fpdt, 2, 4)


ZERO3_CONFIG = ROOT / "accelerate_configs" / "deepspeed_zero3.yaml"
# COMMON with one step (DeepSpeed's first step over a complete module trace is slow on CPU: README), no generation
ZERO3_COMMON = ("--seq-len", "300", "--chunk-size", "64", "--max-steps", "1", "--optim", "sgd", "--learning-rate")
ZERO3_COMMON += ("1.0", "--seed", "0", "--num-train-samples", "8", "--num-eval-samples", "2")


def _zero3_run(num_processes: int, attn: str, sp_size: int) -> dict:
    name = f"zero3_{attn}_np{num_processes}_sp{sp_size}"
    out_dir, metrics_path = _TMP / name, _TMP / f"{name}.json"
    args = ("--attn", attn, "--sp-size", str(sp_size), "--output-dir", str(out_dir))
    args += ("--metrics-json", str(metrics_path))
    launcher = SCRIPTS / "deepspeed_example.py"  # the example, without DeepSpeed's JIT-built comm op
    accelerate_launch(launcher, num_processes, *ZERO3_COMMON, *args, config=ZERO3_CONFIG)
    return json.loads(metrics_path.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero3_launch_equals_one_zero3_process() -> None:
    """accelerate_configs/deepspeed_zero3.yaml on 2 CPU processes (sp 2) against the same config on one process.

    The baseline runs ZeRO-3 too: transformers builds the model under ``deepspeed.zero.Init`` then, which
    initialises other weights than a plain build. One SGD step at lr 1.0, then the eval set: its loss
    depends on that step's gradients.
    """
    fpdt, base = _zero3_run(2, "fpdt", 2), _zero3_run(1, "sdpa", 1)
    for metrics in (fpdt, base):
        assert metrics["distributed_type"] == "DEEPSPEED" and metrics["sharded"] == "zero3"
    assert fpdt["world_size"] == 2 and fpdt["sp_size"] == 2 and len(fpdt["losses"]) == 1
    assert _rel(fpdt["losses"][0], base["losses"][0]) < RTOL, (fpdt["losses"], base["losses"])
    assert _rel(fpdt["eval_loss"], base["eval_loss"]) < RTOL, (fpdt["eval_loss"], base["eval_loss"])
    assert fpdt["eval_accuracy"] == base["eval_accuracy"] > 0


def test_launches_that_would_not_do_what_their_config_says_are_refused(monkeypatch) -> None:
    example = _example()
    args = example.parse_args(["--eval-retrieval"])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP only on GPUs"):  # Accelerate would silently use DDP on CPU
        example.check_launch(args, use_cpu=True)
    with pytest.raises(ValueError, match="--eval-retrieval is not supported under FSDP"):
        example.check_launch(args, use_cpu=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="or DeepSpeed ZeRO-3: generation gathers sharded parameters"):
        example.check_launch(args, use_cpu=True)
    example.check_launch(example.parse_args([]), use_cpu=True)  # ZeRO-3 on CPU without generation: fine


DPO = ROOT / "examples" / "dpo_long.py"
DPO_ARGS = ("--prompt-len", "200", "--completion-len", "100", "--chunk-size", "64", "--max-steps", "2")


@functools.cache
def dpo_run(num_processes: int, attn: str) -> dict:
    """``examples/dpo_long.py`` as its guide runs it (cached: the warning count reads the same run's output)."""
    return _launched_example(DPO, DPO_ARGS, "dpo", num_processes, attn)


def _launched_example(script: Path, args: tuple, kind: str, num_processes: int, attn: str) -> dict:
    """An example launched as a user does (fpdt: SP over every process; sdpa: HF's attention), with its metrics
    JSON and its output."""
    name = f"{kind}_{attn}_np{num_processes}"
    path = _TMP / f"{name}.json"
    extra = ("--sp-size", str(num_processes)) if attn == "fpdt" else ("--attn", "sdpa")
    out = ("--output-dir", str(_TMP / name), "--metrics-json", str(path))
    output = launch_as_a_user(script, num_processes, *args, *extra, *out)
    return {**json.loads(path.read_text()), "output": output}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dpo_example_sp2_equals_one_process_sdpa() -> None:
    """``examples/dpo_long.py``: FPDTDPOTrainer at SP 2 gives TRL's DPOTrainer's losses and reward margins."""
    got, want = dpo_run(2, "fpdt"), dpo_run(1, "sdpa")
    assert len(got["losses"]) == len(want["losses"]) == 2
    for key in ("losses", "margins"):
        for g, w in zip(got[key], want[key]):
            assert abs(g - w) <= 1e-5 * max(abs(w), 1.0), (key, got[key], want[key])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dpo_example_uneven_last_batch_sp2_equals_one_process_sdpa() -> None:
    """``examples/dpo_long.py`` on 3 pairs in batches of 2: step 2 holds one pair. TRL gathers per-rank scalars
    (its entropy sum) with ``gather_for_metrics``, which cuts the last batch to its samples: a scalar is one row
    there, as Accelerate gathers it. Losses within 1e-5; reward margins, differences of log-prob sums, within 1e-5
    of the sums (fp32 rounds each sum to ~1e-7 of it, as test_trl_dpo.py measures)."""
    script = ROOT / "examples" / "dpo_long.py"
    common = ("--prompt-len", "200", "--completion-len", "100", "--chunk-size", "64", "--max-steps", "2")
    common += ("--num-pairs", "3", "--per-device-batch-size", "2", "--output-dir", str(_TMP / "dpo_uneven"))
    got, want = _TMP / "dpo_uneven_sp2.json", _TMP / "dpo_uneven_sdpa.json"
    accelerate_launch(script, 2, *common, "--sp-size", "2", "--metrics-json", str(got))
    accelerate_launch(script, 1, *common, "--attn", "sdpa", "--metrics-json", str(want))
    got, want = json.loads(got.read_text()), json.loads(want.read_text())
    assert len(got["losses"]) == len(want["losses"]) == 2
    for g, w in zip(got["losses"], want["losses"]):
        assert abs(g - w) <= 1e-5 * max(abs(w), 1.0), (got["losses"], want["losses"])
    for g, w, sums in zip(got["margins"], want["margins"], want["logps"]):
        assert abs(g - w) <= 1e-5 * max(abs(w), 1e-2 * abs(sums)), (got["margins"], want["margins"], sums)


GRPO = ROOT / "examples" / "grpo.py"
GRPO_ARGS = ("--prompt-len", "200", "--chunk-size", "32", "--max-steps", "2", "--seed", "0")


@functools.cache
def grpo_run(num_processes: int, attn: str) -> dict:
    """``examples/grpo.py`` (cached: the warning count reads the same run's output)."""
    return _launched_example(GRPO, GRPO_ARGS, "grpo", num_processes, attn)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grpo_example_sp2_equals_one_sdpa_process() -> None:
    """``examples/grpo.py``: FPDTGRPOTrainer at SP 2 gives the losses, rewards and KL of TRL's GRPOTrainer with sdpa
    on one process (the same sampled completions: the SP group is seeded as that process)."""
    base, fpdt = grpo_run(1, "sdpa"), grpo_run(2, "fpdt")
    assert fpdt["attn"] == "fpdt" and fpdt["sp_size"] == 2 and fpdt["world_size"] == 2
    assert len(base["losses"]) == len(fpdt["losses"]) == 2
    assert base["rewards"][0] > 0 and base["kl"][1] > 0  # the toy reward and the KL term are not trivially zero
    assert fpdt["rewards"] == base["rewards"] and fpdt["completion_lengths"] == base["completion_lengths"]
    for step, (got, want) in enumerate(zip(fpdt["losses"] + fpdt["kl"], base["losses"] + base["kl"])):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-9, (step, got, want)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("example", ["quickstart", "dpo", "grpo"])
def test_example_runs_print_at_most_one_warning_line(example: str) -> None:
    """The README's quickstart shape (sp 2, here with --eval-retrieval too), the DPO and the GRPO example at SP 2,
    launched as a reader launches them: at most one warning line each (issue 37; none at the time of writing).
    Each known cause is removed where hf_fpdt or the example sets it (DDP's find_unused_parameters, transformers'
    renamed activation_checkpointing, DeepSpeed guessing the CPU, the tokenizer's special tokens), and what PEFT and
    TRL raise by calling transformers' deprecated names is filtered around those calls alone."""
    output = {
        "quickstart": lambda: run(2, "fpdt", 2),
        "dpo": lambda: dpo_run(2, "fpdt"),
        "grpo": lambda: grpo_run(2, "fpdt"),
    }
    lines = warning_lines(output[example]()["output"])
    assert len(lines) <= 1, f"{example}: {len(lines)} warning lines:\n" + "\n".join(lines)


SFT = ROOT / "examples" / "sft_long.py"
SFT_ARGS = ("--max-length", "512", "--chunk-size", "64", "--max-steps", "3", "--num-docs", "12")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_example_sp2_equals_one_sdpa_process(packing: bool) -> None:
    """``examples/sft_long.py``: FPDTSFTTrainer at SP 2 gives TRL's SFTTrainer's losses on one plain ``python``
    process, padded (documents of 128-510 tokens, batches of 2) and packed (rows of 512 tokens, documents as
    skipped blocks). SGD at lr 0.5 moves the loss, so a wrong gradient shows in steps 2 and 3; fp32: 1e-5."""
    runs = {}
    for attn, processes in (("sdpa", None), ("fpdt", 2)):
        path = _TMP / f"sft_{attn}_{packing}.json"
        extra = ("--packing",) if packing else ()
        extra += ("--attn", "sdpa") if attn == "sdpa" else ("--sp-size", "2")
        out = ("--output-dir", str(_TMP / f"sft_{attn}_{packing}"), "--metrics-json", str(path))
        launch_as_a_user(SFT, processes, *SFT_ARGS, *extra, *out)
        runs[attn] = json.loads(path.read_text())
    base, fpdt = runs["sdpa"], runs["fpdt"]
    assert fpdt["sp_size"] == 2 and fpdt["world_size"] == 2 and fpdt["packing"] is packing
    assert len(base["losses"]) == len(fpdt["losses"]) == 3 and abs(base["losses"][2] - base["losses"][0]) > 1e-2
    for step, (got, want) in enumerate(zip(fpdt["losses"], base["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)


@pytest.mark.slow
def test_example_runs_on_one_plain_python_process(tmp_path) -> None:
    """``python examples/finetune_lora.py --max-steps 1`` without a launcher trains (it used to fail inside
    TrainingArguments: "Default process group has not been initialized"); --sp-size 2 there says how to launch."""
    short = ("--seq-len", "256", "--chunk-size", "64", "--num-train-samples", "2", "--num-eval-samples", "1")
    out = ("--output-dir", str(tmp_path / "run"), "--metrics-json", str(tmp_path / "m.json"))
    launch_as_a_user(SCRIPT, None, "--max-steps", "1", *short, *out)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == 1 and len(metrics["losses"]) == 1
    with pytest.raises(RuntimeError, match="accelerate launch --config_file accelerate_configs/cpu.yaml --num_pro"):
        launch_as_a_user(SCRIPT, None, "--sp-size", "2", *short, *out)


def test_a_run_refuses_to_replace_another_runs_adapter_or_metrics(tmp_path, monkeypatch) -> None:
    """HF's ``overwrite_output_dir`` convention: another seed (or length, --eval-retrieval...) into the same folder or
    metrics file is refused unless --overwrite-output-dir; the same arguments again replace their own output."""
    example = _example()
    common = sys.modules["_common"]
    for name in ("RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    out, metrics = tmp_path / "run", tmp_path / "metrics.json"
    argv = ["--output-dir", str(out), "--metrics-json", str(metrics)]
    first = example.parse_args(argv)
    record = example.run_record(first, 2)
    common.check_no_overwrite(first, record, out, "the adapter")  # an empty folder
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(common.Refusal, match="holds the adapter of another run"):  # an adapter of unknown origin
        common.check_no_overwrite(first, record, out, "the adapter")
    common.save_record(out, record)
    metrics.write_text(json.dumps({"run": record}))
    common.check_no_overwrite(first, record, out, "the adapter")  # the same run again
    other = example.parse_args([*argv, "--seed", "1"])
    with pytest.raises(common.Refusal, match=r"another run \(differing in: seed\)"):
        common.check_no_overwrite(other, example.run_record(other, 2), out)
    with pytest.raises(common.Refusal, match="differing in: world_size"):
        common.check_no_overwrite(first, example.run_record(first, 4), out)
    (out / common.RUN_RECORD).unlink()
    (out / "adapter_model.safetensors").unlink()
    with pytest.raises(common.Refusal, match="holds another run's metrics"):
        common.check_no_overwrite(other, example.run_record(other, 2), out)
    forced = example.parse_args([*argv, "--seed", "1", "--overwrite-output-dir"])
    common.check_no_overwrite(forced, example.run_record(forced, 2), out)


EXAMPLES = ("finetune_lora.py", "sft_long.py", "dpo_long.py", "grpo.py", "accelerate_loop.py")


class _Checked(Exception):
    """Raised right after an example's output check passed (so no training starts)."""


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_keeps_one_rule_for_existing_output(name: str, tmp_path, monkeypatch) -> None:
    """One rule in every example (issue 43: they handled an existing output four ways): another run's output folder
    or metrics file is refused, the same command again replaces its own, --overwrite-output-dir replaces anything;
    each example calls the shared check (examples/_common.py) with its real output folder before training."""
    example = _example(ROOT / "examples" / name)
    common = sys.modules["_common"]
    for variable in ("RANK", "WORLD_SIZE", "FPDT_SP_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(variable, raising=False)
    checks = []

    def checked(args, record, output_dir, *rest):
        common.check_no_overwrite(args, record, output_dir, *rest)  # the shared rule, as the example calls it
        checks.append((record, output_dir))
        raise _Checked

    monkeypatch.setattr(example, "check_no_overwrite", checked)
    metrics = tmp_path / "metrics.json"
    argv = ["--metrics-json", str(metrics), "--max-steps", "2"]
    argv += ["--output-dir", str(tmp_path / "out")] if name != "accelerate_loop.py" else []

    def passes(*extra: str) -> tuple[dict, Path | None]:
        with pytest.raises(_Checked):
            example.main([*argv, *extra])
        return checks[-1]

    record, folder = passes()  # nothing there yet
    assert (folder is None) == (name == "accelerate_loop.py") and record["max_steps"] == 2
    if folder is not None:
        assert Path(folder).is_relative_to(tmp_path / "out")
        common.save_record(folder, record)
        (Path(folder) / "output.bin").write_bytes(b"")
    common.write_metrics(str(metrics), {"losses": []}, record)
    passes()  # its own output: replaced
    where = "the adapter" if name == "finetune_lora.py" else "the output"
    refused = f"holds {where} of another run" if folder is not None else "holds another run's metrics"
    with pytest.raises(common.Refusal, match=refused):
        example.main([*argv, "--max-steps", "3"])
    passes("--max-steps", "3", "--overwrite-output-dir")


@pytest.mark.parametrize("name", ["finetune_lora.py", "sft_long.py", "grpo.py"])
def test_a_bad_fpdt_sp_size_is_the_librarys_message_in_one_line(name: str, tmp_path, monkeypatch, capsys) -> None:
    """``FPDT_SP_SIZE=abc``: hf_fpdt's message naming the variable (it was a bare ``int()`` traceback), and at the
    example's entry point one line on stderr and exit code 2 (no traceback); other exceptions keep theirs."""
    example = _example(ROOT / "examples" / name)
    common = sys.modules["_common"]
    for variable in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FPDT_SP_SIZE", "abc")
    argv = ["--output-dir", str(tmp_path / "out"), "--metrics-json", str(tmp_path / "m.json")]
    with pytest.raises(ValueError, match=r"FPDT_SP_SIZE='abc': expected a positive integer"):
        example.main(argv)
    monkeypatch.setattr(sys, "argv", [name])
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(lambda: example.main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{name}: error: FPDT_SP_SIZE='abc': expected a positive integer"], err
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher every rank prints its line, its rank first
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        common.run_main(lambda: example.main(argv))
    assert capsys.readouterr().err.startswith(f"[rank 1] {name}: error: FPDT_SP_SIZE='abc'")
    with pytest.raises(ValueError, match="invalid literal"):  # not a refusal: a bug keeps its traceback
        common.run_main(lambda: int("abc"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_refusal_under_accelerate_launch_is_one_line_per_rank() -> None:
    """``--sp-size 4`` on 2 processes: every rank prints its one line, no Python traceback of the example's, a
    non-zero exit; the launcher's failure summary (its own traceback, which a child cannot prevent) ends with the
    message in its root-cause box instead of a pointer to how to get a traceback."""
    with pytest.raises(RuntimeError) as failed:
        launch_as_a_user(SCRIPT, 2, "--sp-size", "4", "--output-dir", str(_TMP / "refused"))
    out = str(failed.value)
    message = "finetune_lora.py: error: --sp-size 4 needs 4 processes, this launch has 2"
    # each rank prints its line as it refuses; the launcher may stop the slower rank first when the other has exited
    assert any(f"[rank {rank}] {message}" in out for rank in (0, 1)), out
    assert 'examples/finetune_lora.py", line' not in out, out  # no traceback of the example's
    assert re.search(rf"traceback : \[rank \d\] {re.escape(message)}", out), out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accelerate_loop_example_sp2_equals_the_loop_without_fpdt() -> None:
    """``examples/accelerate_loop.py``: the hand-written loop with FPDTPlugin at SP 2 gives the per-step losses of
    the same loop on one plain ``python`` process with sdpa (SGD at lr 0.5: later steps show a wrong gradient)."""
    script = ROOT / "examples" / "accelerate_loop.py"
    common = ("--seq-len", "600", "--chunk-size", "64", "--max-steps", "3")
    got, want = _TMP / "loop_sp2.json", _TMP / "loop_sdpa.json"
    launch_as_a_user(script, 2, *common, "--sp-size", "2", "--metrics-json", str(got))
    launch_as_a_user(script, None, *common, "--attn", "sdpa", "--metrics-json", str(want))
    got, want = json.loads(got.read_text())["losses"], json.loads(want.read_text())["losses"]
    assert len(got) == len(want) == 3 and abs(want[2] - want[0]) > 1e-2, want
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), (step, got, want)
