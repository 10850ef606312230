"""Every metric a trainer logs under SP equals one process's: the whole ``log_history`` (every entry, every key) of
the FPDT trainers at SP 2 (2 CPU processes, gloo) against the plain HF/TRL trainer with sdpa on one process, same
data and seed, 2 steps on the tiny Llama.

Runs (``tests/scripts/logged_metrics.py``): ``FPDTSFTTrainer`` on TRL's padded batches (rows of different lengths;
rows of one length, which the SP collator gives no ``attention_mask``, ending on an uneven last batch), on
padding-free rows and on packed rows; ``FPDTDPOTrainer`` (sigmoid, the reference from the checkpoint);
``FPDTGRPOTrainer`` (LoRA, KL term, a clipped second step); ``FPDTTrainer`` with ``include_num_input_tokens_seen``.
The rows of one length and the Trainer's are also evaluated after each step (3 rows in batches of 2: ``eval_*``).
The sequences are not multiples of the SP layout's, so a count that includes the layout's padding shows.

What is compared: counts (``num_tokens``, ``num_input_tokens_seen``, ``total_flos``, ``step``, ``epoch``) exactly;
metrics (losses, gradient norms, TRL's entropy / accuracy / rewards / log-probs / logits / KL / clip ratios /
completion lengths) within :data:`RTOL`; timings (``*_runtime``, ``*_per_second``, GRPO's ``step_time``) cannot be
equal across runs, so the count each rate is made of is checked instead: rate x runtime gives one process's number
of samples / steps, and ``train_tokens_per_second`` x runtime gives the entry's ``num_input_tokens_seen``.
"""

from __future__ import annotations

import functools
import json

import pytest
from launch import SCRIPTS, accelerate_launch
from testkit import SCRATCH

pytest.importorskip("trl")
from dpo_loop import tiny_checkpoint  # noqa: E402
from grpo_loop import model_dir  # noqa: E402
from logged_metrics import RUNS, history  # noqa: E402

RTOL = 1e-5  # the suite's rule for metrics (fp32 losses and everything computed from the same log-probs)
ATOL = 1e-7  # a metric that is 0 on one process (clip ratios, the first step's KL) may be fp32 rounding off it
# counts (and the schedule's values): integers or exact functions of them, the same on every run
COUNTS = {"num_tokens", "num_input_tokens_seen", "total_flos", "step", "epoch", "learning_rate"}
# DPO: a reward (beta x a difference of per-sequence log-prob sums, hundreds) and so the loss round like those
# sums: compared relative to them (tests/integration/test_trl_dpo.py's rule)
LOGP_SUMS = ("rewards/", "loss", "train_loss")
# what each run must log (so a metric that stops being logged is seen, not silently compared as absent)
EXPECTED = {
    "sft": {"num_tokens", "mean_token_accuracy", "entropy", "total_flos"},
    "dpo": {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "num_tokens", "entropy", "mean_token_accuracy"},
    "grpo": {"completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "reward",
             "reward_std", "entropy", "num_tokens"},
    "trainer": {"num_input_tokens_seen", "train_tokens_per_second", "total_flos", "eval_loss",
                "eval_samples_per_second"},
    "sft_padded_equal": {"eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"},
}  # fmt: skip


@functools.cache
def baseline(run: str) -> list[dict]:
    """The plain trainer with sdpa on one process."""
    return history(run, f"{SCRATCH}/metrics_sdpa_{run}", tiny_checkpoint(SCRATCH))


def _is_timing(key: str) -> bool:
    return key.endswith(("_runtime", "_per_second")) or key == "step_time"


def _rate_count(entry: dict, key: str) -> tuple[float, float]:
    """The count a rate was made of (rate x runtime) and how far rounding may move it: Trainer's ``speed_metrics``
    rounds the runtime to 4 decimals and the rate to 3, so ``|rate x runtime - count| <= 5e-4 runtime + 5e-5
    rate`` (plus the rate's own rounding in the second term)."""
    runtime = entry[key.split("_")[0] + "_runtime"]
    rate = entry[key]
    return rate * runtime, 5e-4 * runtime + 5e-5 * (rate + 5e-4) + 1e-9


def assert_same_history(got: list[dict], want: list[dict], run: str) -> None:
    assert len(got) == len(want), (run, len(got), len(want))
    logged = {k for entry in want for k in entry}
    expected = EXPECTED[run.split("_")[0]] | EXPECTED.get(run, set())
    assert expected <= logged, (run, expected - logged)
    scale = max(abs(e.get("logps/chosen", 0.0)) for e in want) * 1e-2  # DPO's sums (0 elsewhere)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{run} entry {i}: keys only in SP 2 {g.keys() - w.keys()}, only in one " \
                                     f"process {w.keys() - g.keys()}"  # fmt: skip
        for key, value in w.items():
            where = f"{run} entry {i} {key}: SP 2 {g[key]} vs one process {value}"
            if not isinstance(value, int | float) or isinstance(value, bool):
                assert g[key] == value, where
            elif _is_timing(key):
                assert g[key] > 0, where
                if key.endswith("_per_second"):
                    (count, bound), (ref, ref_bound) = _rate_count(g, key), _rate_count(w, key)
                    assert abs(count - ref) <= bound + ref_bound, f"{where} (counts {count} vs {ref})"
                    if key == "train_tokens_per_second":  # the count: this entry's num_input_tokens_seen
                        assert abs(count - g["num_input_tokens_seen"]) <= bound, f"{where} (count {count})"
            elif key in COUNTS:
                assert g[key] == value, where
            else:
                tol = RTOL * max(abs(value), scale if key.startswith(LOGP_SUMS) else 0.0) + ATOL
                assert abs(g[key] - value) <= tol, where


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sp2_log_history_equals_one_process(tmp_path) -> None:
    out = tmp_path / "metrics.json"
    model_dir(tmp_path)  # GRPO's model, saved here once: both ranks saving it at once have read a partial copy
    accelerate_launch(
        SCRIPTS / "logged_metrics.py", 2, str(out), "2", tiny_checkpoint(SCRATCH), ",".join(RUNS), timeout=900
    )
    result = json.loads(out.read_text())
    for run in RUNS:
        assert_same_history(result[run], baseline(run), run)
