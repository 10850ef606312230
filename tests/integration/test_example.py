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
and KL.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from launch import ROOT, SCRIPTS, accelerate_launch
from testkit import SCRATCH

SCRIPT = ROOT / "examples" / "finetune_lora.py"
COMMON = ("--seq-len", "1030", "--chunk-size", "128", "--max-steps", "3", "--optim", "sgd")
COMMON += ("--learning-rate", "1.0", "--seed", "0", "--num-train-samples", "8", "--num-eval-samples", "2")
COMMON += ("--eval-retrieval", "--eval-depths", "0,1")  # generate() after training, prefill sequence-parallel under SP
RTOL = 1e-4
_TMP = Path(SCRATCH) / "example"  # removed at exit (testkit)


@functools.cache
def run(num_processes: int, attn: str, sp_size: int, batch: int = 1, bf16: bool = False) -> dict:
    """Metrics of one launch (cached: several tests share a run); the adapter is in ``metrics['dir']``."""
    name = f"{attn}_np{num_processes}_sp{sp_size}_b{batch}" + ("_bf16" if bf16 else "")
    out_dir, metrics_path = _TMP / name, _TMP / f"{name}.json"
    args = ("--attn", attn, "--sp-size", str(sp_size), "--per-device-batch-size", str(batch))
    args += ("--bf16",) if bf16 else ()
    args += ("--output-dir", str(out_dir), "--metrics-json", str(metrics_path))
    accelerate_launch(SCRIPT, num_processes, *COMMON, *args)
    metrics = json.loads(metrics_path.read_text())
    metrics["dir"] = str(out_dir)
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
    from transformers import AutoModelForCausalLM

    from hf_fpdt.models.presets import preset_config

    fpdt, base = run(2, "fpdt", 2, 1), run(1, "sdpa", 1, 1)
    loaded = {}
    for key, metrics in (("fpdt", fpdt), ("sdpa", base)):
        model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"), dtype=torch.float32)
        model = PeftModel.from_pretrained(model, metrics["dir"])
        loaded[key] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert loaded["fpdt"].keys() == loaded["sdpa"].keys() and loaded["fpdt"]
    trained = [n for n, p in loaded["fpdt"].items() if "lora_B" in n and p.abs().max() > 0]
    assert trained, "lora_B starts at zero; after 3 steps it must not be"
    for name, want in loaded["sdpa"].items():
        got = loaded["fpdt"][name]
        assert (got - want).abs().max() <= RTOL * want.abs().max(), name


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_lora", SCRIPT)
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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dpo_example_sp2_equals_one_process_sdpa() -> None:
    """``examples/dpo_long.py``: FPDTDPOTrainer at SP 2 gives TRL's DPOTrainer's losses and reward margins."""
    script = ROOT / "examples" / "dpo_long.py"
    common = ("--prompt-len", "200", "--completion-len", "100", "--chunk-size", "64", "--max-steps", "2")
    common += ("--output-dir", str(_TMP / "dpo"))
    got, want = _TMP / "dpo_sp2.json", _TMP / "dpo_sdpa.json"
    accelerate_launch(script, 2, *common, "--sp-size", "2", "--metrics-json", str(got))
    accelerate_launch(script, 1, *common, "--attn", "sdpa", "--metrics-json", str(want))
    got, want = json.loads(got.read_text()), json.loads(want.read_text())
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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grpo_example_sp2_equals_one_sdpa_process(tmp_path) -> None:
    """``examples/grpo.py``: FPDTGRPOTrainer at SP 2 gives the losses, rewards and KL of TRL's GRPOTrainer with sdpa
    on one process (the same sampled completions: the SP group is seeded as that process)."""
    runs = {}
    for name, processes, extra in (("sdpa", 1, ("--attn", "sdpa")), ("fpdt", 2, ("--sp-size", "2"))):
        path = tmp_path / f"{name}.json"
        out = ("--output-dir", str(tmp_path / name), "--metrics-json", str(path))
        accelerate_launch(GRPO, processes, *GRPO_ARGS, *extra, *out)
        runs[name] = json.loads(path.read_text())
    base, fpdt = runs["sdpa"], runs["fpdt"]
    assert fpdt["attn"] == "fpdt" and fpdt["sp_size"] == 2 and fpdt["world_size"] == 2
    assert len(base["losses"]) == len(fpdt["losses"]) == 2
    assert base["rewards"][0] > 0 and base["kl"][1] > 0  # the toy reward and the KL term are not trivially zero
    assert fpdt["rewards"] == base["rewards"] and fpdt["completion_lengths"] == base["completion_lengths"]
    for step, (got, want) in enumerate(zip(fpdt["losses"] + fpdt["kl"], base["losses"] + base["kl"])):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-9, (step, got, want)
