"""No abort at interpreter exit (``terminate called without an active exception``) in any documented
script shape, each run ``FPDT_EXIT_REPEATS`` times (CI: 5; the issue's check: 20) on 2 CPU processes (issue 21,
item 5): the README's Accelerate loop
ending with ``end_training()``, ``FPDTTrainer`` (no teardown in the script: it destroys the world it
runs on and the groups it built at exit), and a script calling ``init_process_group`` +
``build_groups`` + ``hf_fpdt.apply`` by hand whose model is refused with a clear ``ValueError``
(``build_groups`` destroys its groups at exit; the world stays the script's). The runs go 4 at a time.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launch import SCRIPTS, launch_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = SCRIPTS / "fault_script.py"
REPEATS, AT_ONCE = int(os.environ.get("FPDT_EXIT_REPEATS", "5")), 4  # each run pays for importing transformers


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,fault,rc",
    [
        pytest.param(
            "loop",
            "none",
            0,
            marks=pytest.mark.xfail(
                reason="1 run in 20 hung (rank 0 done, rank 1 never left end_training()'s teardown); see issue 21",
                raises=TimeoutError,
                strict=False,
            ),
        ),
        ("trainer", "none", 0),
        ("apply", "refuse", 1),
    ],
)
def test_no_abort_at_exit(tmp_path: Path, shape: str, fault: str, rc: int) -> None:
    def one(i: int) -> list[tuple[int, str, float]]:
        return launch_ranks(SCRIPT, 2, shape, fault, "step", "30", str(tmp_path / str(i)), timeout=180)

    with ThreadPoolExecutor(AT_ONCE) as pool:
        runs = list(pool.map(one, range(REPEATS)))
    for i, ranks in enumerate(runs):
        for rank, (code, out, _) in enumerate(ranks):
            assert "terminate called" not in out, f"run {i} rank {rank} aborted at exit:\n{out[-3000:]}"
            assert code == rc, f"run {i} rank {rank}: exit code {code}, expected {rc}:\n{out[-3000:]}"
            if shape == "apply":
                assert "ValueError: sp_size=2: the model's 3 attention heads" in out
                assert "sequence parallelism needs the attention heads divisible" in out


def _trainer_registers_world(rank: int, world_size: int, out: str) -> list:
    """A world that exists before ``FPDTTrainer`` (``TrainingArguments(bf16=True)`` creates it when constructed,
    as a launcher's script does): the trainer registers its destruction at exit."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments

    import hf_fpdt
    import hf_fpdt.trainers.trainer as trainer_module
    from hf_fpdt.models.presets import preset_config

    calls = []
    real = trainer_module.destroy_at_exit
    trainer_module.destroy_at_exit = lambda *groups: calls.append(groups)
    try:
        args = TrainingArguments(output_dir=out, use_cpu=True, bf16=True, report_to=[], max_steps=1)
        model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"), dtype=torch.float32)
        ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 2, "labels": [[1, 2, 3, 4]] * 2})
        hf_fpdt.FPDTTrainer(model, args, fpdt=hf_fpdt.FPDTPlugin(), train_dataset=ds)
    finally:
        trainer_module.destroy_at_exit = real
    return calls


def test_trainer_destroys_the_world_it_runs_on_at_exit(tmp_path: Path) -> None:
    """With ``bf16=True`` the world exists before ``FPDTTrainer`` (was: left to interpreter shutdown, which aborted
    2 of 14 two-rank runs with ``terminate called without an active exception``)."""
    from distributed import run_distributed

    calls = run_distributed(_trainer_registers_world, 1, str(tmp_path))[0]
    assert (None,) in calls
