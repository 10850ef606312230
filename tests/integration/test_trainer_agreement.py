"""The ranks agree on what a trainer's step depends on (issue 38): trainer arguments and the reference model's
weights held differently per rank end every rank with the same ``SPAgreementError`` naming the field and each rank's
value (before: both ranks trained, silently matching neither rank's TRL run); GRPO's rewards are SP rank 0's,
broadcast (issue 43): a rank-dependent reward trains as the control does; and TRL's
reference precompute with an in-memory dataset is refused up front on every rank (before: rank 1
``FileNotFoundError``, rank 0 ``SPPeerFailure``). One launch of :mod:`agreement_cases` on 2 CPU processes at SP 2
(gloo), each case built as a user would build it.
"""

from __future__ import annotations

import json
import re

import pytest
from launch import SCRIPTS, accelerate_launch

pytest.importorskip("trl")

CASES = ("same", "trainer_lr", "dpo_beta", "dpo_ref_weights", "dpo_precompute_in_memory", "grpo_rank_reward",
         "grpo_same")  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("agreement")
    accelerate_launch(SCRIPTS / "agreement_cases.py", 2, str(out), ",".join(CASES), timeout=1200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _alike(ranks: list[dict], case: str, kind: str = "SPAgreementError") -> str:
    first, second = (r[case] for r in ranks)
    assert first == second, (first, second)  # the same error on every rank
    assert first.startswith(f"{kind}: "), first
    return first


@pytest.mark.multiprocess
@pytest.mark.slow
def test_per_rank_paths_and_display_settings_train(ranks) -> None:
    assert ranks[0]["same"] == ranks[1]["same"] == "no error"  # output_dir, run_name, log_level differ: excluded
    assert ranks[0]["grpo_same"] == ranks[1]["grpo_same"] == "no error"  # rewards and advantages agree


@pytest.mark.multiprocess
@pytest.mark.slow
def test_trainer_arguments_differing_per_rank(ranks) -> None:
    msg = _alike(ranks, "trainer_lr")
    assert "the 2 ranks of the world disagree on the training arguments (TrainingArguments)" in msg, msg
    assert "learning_rate: rank 0 has 0.001, rank 1 has 0.002" in msg
    assert "max_grad_norm: rank 0 has 1.0, rank 1 has 2.0" in msg
    assert "output_dir" not in msg  # only what differs, and per-rank paths are not compared
    msg = _alike(ranks, "dpo_beta")
    assert "training arguments (DPOConfig): beta: rank 0 has 0.1, rank 1 has 0.5." in msg, msg


@pytest.mark.multiprocess
@pytest.mark.slow
def test_reference_weights_differing_per_rank(ranks) -> None:
    msg = _alike(ranks, "dpo_ref_weights")
    assert "disagree on the reference model's weights (ref_model): parameters: rank 0 has 21 entries, #0: " in msg
    assert re.search(r"#0: 'model\.embed_tokens\.weight \[\d+, 64\] float32 [0-9a-f]{16}'", msg), msg
    assert "seed every rank alike" in msg


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rewards_differing_per_rank_train_on_sp_rank_0s(ranks) -> None:
    """A reward that reads the rank (0.7 more on rank 1's every third completion): the group trains on SP rank 0's
    rewards, broadcast (issue 43), so its logged rewards, advantages' effect and loss equal the control's, whose
    reward is rank 0's on every rank. Before, every rank raised SPAgreementError."""
    assert ranks[0]["grpo_rank_reward"] == ranks[1]["grpo_rank_reward"] == "no error"
    got, want = ranks[0]["grpo_rank_reward metrics"], ranks[0]["grpo_same metrics"]
    names = [n for n in want if not n.startswith("rewards/")]  # rewards/<function name>/...: another name
    assert {"reward", "loss", "reward_std"} <= set(names) <= got.keys(), (got, want)
    for name in names:
        for a, b in zip(got[name], want[name], strict=True):
            assert (a is None and b is None) or abs(a - b) <= 1e-6 * max(1.0, abs(b)), (name, got[name], want[name])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_precompute_with_an_in_memory_dataset_is_refused_on_every_rank(ranks) -> None:
    msg = _alike(ranks, "dpo_precompute_in_memory", kind="ValueError")
    assert "precompute_ref_log_probs=True with an in-memory train dataset on 2 processes" in msg, msg
    assert "dataset.save_to_disk(path)" in msg and "datasets.load_from_disk(path)" in msg
