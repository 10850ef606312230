"""TRL's ``GRPOTrainer`` / ``RLOOTrainer`` under FPDT SP (``hf_fpdt.FPDTGRPOTrainer``, ``FPDTRLOOTrainer``).

Two optimizer steps on one generation batch (2 prompts x 4 sampled completions, the second step clipped against
the old policy), tiny Llama, fp32, a deterministic toy reward: launched at SP 2 and SP 4 (gloo, CPU), every
rank's SP group samples what one process samples (same seed), and the logged metrics (loss, reward, KL,
entropy, clip ratios, completion lengths, token count) and the parameter updates equal TRL's trainer on one
process with sdpa; LoRA (the reference is the disabled adapter) and full fine-tuning (a separate reference model
TRL loads, FPDT applied to it; with the entropy mask's quantile over the batch), the loss types grpo, dapo, bnpo
and dr_grpo, RLOO, and evaluation (generation and loss under SP). bf16 autocast stays within 2x sdpa's bf16
error. dp 2 x sp 2 equals TRL's own run on 2 data-parallel processes. Bad combinations (vLLM, RLOO's KL penalty
under SP, a rollout whose completions differ between the ranks of an SP group) raise on every rank.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from launch import SCRIPTS, accelerate_launch
from testkit import SCRATCH, max_err

pytest.importorskip("trl")
from grpo_loop import CHUNK, grpo_run  # noqa: E402

import hf_fpdt  # noqa: E402

RTOL = 1e-5
pytestmark = pytest.mark.multiprocess


@functools.cache
def baseline(case: str, tmp: str = SCRATCH) -> tuple[dict, dict]:
    """TRL's trainer on one process with sdpa."""
    return grpo_run(case, f"{tmp}/grpo_sdpa_{case}")


def _launch(tmp_path, processes: int, sp_size: int, cases: str) -> dict:
    out = tmp_path / f"grpo_{processes}_{sp_size}.json"
    accelerate_launch(SCRIPTS / "grpo_loop.py", processes, str(out), str(sp_size), cases, timeout=600)
    result = json.loads(out.read_text())
    for case in cases.split(","):
        if case != "bad":
            result[case]["updates"] = torch.load(f"{out}.{case}.pt")
    return result


def _assert_equal_run(got: dict, want: tuple[dict, dict], case: str) -> None:
    ref, updates = want
    assert got["completions"] == ref["completions"], case  # the SP group sampled one process's completions
    assert len(ref["metrics"]["loss"]) == 2 and abs(ref["metrics"]["loss"][1] - ref["metrics"]["loss"][0]) > 1e-3
    for name, values in ref["metrics"].items():
        assert name in got["metrics"], (case, name)
        for step, (g, w) in enumerate(zip(got["metrics"][name], values, strict=True)):
            if w is None:
                assert g is None, (case, name, step)
            else:
                assert abs(g - w) <= RTOL * abs(w) + 1e-7, f"{case} step {step} {name}: fpdt {g} vs sdpa {w}"
    assert _update_err(got["updates"], updates) < RTOL, case


def _update_err(got: dict, want: dict) -> float:
    """The largest difference of the parameter updates over the largest update (an update is final minus initial
    parameters; relative to each tensor's own update, the LoRA A matrices' first, tiny updates would compare fp32
    round-off of the parameters)."""
    assert got.keys() == want.keys()
    scale = max(float(u.abs().max()) for u in want.values())
    return max(max_err(got[n], u) for n, u in want.items()) / scale


def _assert_errors(errors: list[dict]) -> None:
    for rank_errors in errors:  # every rank raises, before any collective
        assert re.match(r"ValueError: FPDTGRPOTrainer: vLLM generation under sequence parallelism", rank_errors["vllm"])
        assert re.match(r"ValueError: FPDTRLOOTrainer under sequence parallelism .* supports beta=0.0 only",
                        rank_errors["rloo beta"])  # fmt: skip
        assert re.match(r"SPAgreementError: .*the completions generated.*completion_ids",
                        rank_errors["rank-dependent rollout"], re.S)  # fmt: skip


def test_sp1_equals_sdpa(tmp_path) -> None:
    got, updates = grpo_run("lora", str(tmp_path / "lora"), hf_fpdt.FPDTPlugin(sp_size=1, chunk_size=CHUNK))
    _assert_equal_run({**got, "updates": updates}, baseline("lora"), "lora")


@pytest.mark.slow
def test_sp2_equals_one_process(tmp_path) -> None:
    result = _launch(tmp_path, 2, 2, "lora,full,rloo,lora_eval,lora_bf16,bad")
    for case in ("lora", "full", "rloo", "lora_eval"):
        assert all(result[case]["sp_heads"])  # policy (and reference) scored through the SP fused head
        _assert_equal_run(result[case], baseline(case), case)
    assert len(result["full"]["sp_heads"]) == 2  # full fine-tune with beta > 0: a separate reference model
    assert result["lora"]["metrics"]["kl"][1] > 0 and result["full"]["metrics"]["clip_ratio/region_mean"][1] > 0
    assert len(result["lora_eval"]["metrics"]["eval_loss"]) == 2  # evaluation (generation included) under SP
    _assert_errors(result["errors"])

    # bf16 autocast: the error against fp32 within 2x sdpa's bf16 error (same completions: generation is fp32)
    fp32, fp32_updates = baseline("lora")
    bf16, bf16_updates = baseline("lora_bf16")
    got = result["lora_bf16"]
    assert got["completions"] == bf16["completions"] == fp32["completions"]
    for step in range(2):
        want = fp32["metrics"]["loss"][step]
        sdpa_err = abs(bf16["metrics"]["loss"][step] - want)
        assert abs(got["metrics"]["loss"][step] - want) <= 2 * sdpa_err + 1e-6, step
    assert _update_err(got["updates"], fp32_updates) <= 2 * _update_err(bf16_updates, fp32_updates) + 1e-6


@pytest.mark.slow
def test_sp4_equals_one_process(tmp_path) -> None:
    result = _launch(tmp_path, 4, 4, "lora_bnpo,full_dr,bad")
    for case in ("lora_bnpo", "full_dr"):
        assert all(result[case]["sp_heads"])
        _assert_equal_run(result[case], baseline(case), case)
    _assert_errors(result["errors"])


@pytest.mark.slow
def test_dp2_sp2_equals_trl_on_two_processes(tmp_path) -> None:
    """dp 2 x sp 2: each SP group samples what TRL's data-parallel process of its DP rank samples; rewards and
    advantages over the DP group (the generation batch spans both groups), metrics and updates equal TRL's."""
    cases = "lora,full"
    fpdt = _launch(tmp_path, 4, 2, cases)
    trl = _launch(tmp_path, 2, 0, cases)  # TRL's trainers, sdpa, plain data parallelism
    for case in cases.split(","):
        assert all(fpdt[case]["sp_heads"]) and not any(trl[case]["sp_heads"])
        _assert_equal_run(fpdt[case], (trl[case], trl[case]["updates"]), case)


def test_model_name_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the model object"):
        hf_fpdt.FPDTGRPOTrainer("some/model", reward_funcs=len)
