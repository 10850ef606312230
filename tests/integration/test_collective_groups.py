"""The behavioural contract of the (dp, sp) mesh: every collective a GRPO and a DPO step run goes over the group it
must, at world 2 (sp 2) and world 4 (dp 2 x sp 2).

``tests/scripts/collective_groups.py`` wraps every ``torch.distributed`` collective and records its group, its op,
the phase (rollout, scoring, reference precompute, loss, metrics, evaluation) and its caller: TRL's and Trainer's
gathers must run over the DP group (one copy per SP group), hf_fpdt's sequence exchange and agreement over the SP
group, and nothing of those phases over the world except TRL's reference cache (one file for every rank). The
names checked (``compat_trl.MODULE_COLLECTIVES``, the seam's methods) say where the collectives go; this test sees
where they went, so a new world collective in a TRL release fails here.
"""

from __future__ import annotations

import json

import pytest
from launch import SCRIPTS, accelerate_launch

pytest.importorskip("trl")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(tmp_path, world: int, sp: int) -> list[dict]:
    out = tmp_path / "groups.json"
    accelerate_launch(SCRIPTS / "collective_groups.py", world, str(out), str(sp), timeout=900)
    return [json.loads((tmp_path / f"groups.json.{rank}").read_text()) for rank in range(world)]


def _count(result: dict, run: str, *parts: str) -> int:
    """Calls of ``run`` whose ``phases/caller/function/op/kind`` key holds every one of ``parts`` (a phase: any of the
    open ones, ``loop>evaluate>loss``)."""
    found = 0
    for key, n in result["counts"][run].items():
        phases, *rest = key.split("/")
        if all(p in phases.split(">") or p in rest for p in parts):
            found += n
    return found


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2)], ids=["sp2", "dp2_sp2"])
def test_every_collective_runs_over_its_group(tmp_path, world: int, sp: int) -> None:
    ranks = _run(tmp_path, world, sp)
    for rank, result in enumerate(ranks):
        assert result["violations"] == [], f"rank {rank}:\n" + "\n".join(result["violations"])
        # the recorder saw each phase's exchange: the SP all-to-alls of the forward and the SP broadcast of the rewards
        for run, phases in (("grpo", ("rollout", "scoring", "loss", "evaluation")), ("dpo", ("reference", "loss"))):
            for phase in phases:
                assert _count(result, run, phase, "hf_fpdt", "sp") > 0, (rank, run, phase, result["counts"][run])
        assert _count(result, "grpo", "scoring", "broadcast", "sp") > 0, result["counts"]["grpo"]
        if world // sp > 1:  # TRL's gathers went over the DP group (with one DP rank there is none to run)
            assert _count(result, "grpo", "scoring", "trl", "dp") > 0, result["counts"]["grpo"]
            assert _count(result, "grpo", "loss", "trl", "dp") > 0, result["counts"]["grpo"]
            assert _count(result, "dpo", "loss", "trl", "dp") > 0, result["counts"]["dpo"]
            assert _count(result, "dpo", "reference", "trl", "dp") > 0, result["counts"]["dpo"]
            assert _count(result, "dpo", "evaluation", "dp") > 0, result["counts"]["dpo"]
