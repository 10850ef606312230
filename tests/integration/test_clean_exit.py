"""No abort at interpreter exit (``terminate called without an active exception``) and no hang in any documented
script shape, on 2 CPU processes (issues 21 and 38): the README's Accelerate loop ending with ``fpdt.release()``
then ``accelerator.end_training()`` (run ``FPDT_EXIT_LOOP_REPEATS`` times, CI: 20, which sees a 1-in-20 event with
64% chance; 40 runs in every CI since issue 38's fix found none, so CI's time goes elsewhere: set it higher to look
harder), ``FPDTTrainer`` (no teardown in the script: it destroys the world it runs on and the groups it
built at exit) and a script calling ``init_process_group`` + ``build_groups`` + ``hf_fpdt.apply`` by hand whose
model is refused with a clear ``ValueError`` (``build_groups`` destroys its groups at exit; the world stays the
script's), each ``FPDT_EXIT_REPEATS`` times (CI: 5). The runs go 4 at a time.

A run is judged by its teardown, not by its wall time (a loaded machine makes the imports and the steps slow, and
a slow run is no hang): each rank records when its teardown starts (the loop: before ``fpdt.release()``; the
others: the end of the script body), and a rank still alive :data:`TEARDOWN_BOUND` seconds after that is hung in
the teardown; its Python stacks (``faulthandler`` on ``SIGUSR1`` in the script) and its record are then in the
failure message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launch import IMPORT_PATH, ROOT, SCRIPTS, _free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = SCRIPTS / "fault_script.py"
REPEATS, AT_ONCE = int(os.environ.get("FPDT_EXIT_REPEATS", "5")), 4  # each run pays for importing transformers
LOOP_REPEATS = int(os.environ.get("FPDT_EXIT_LOOP_REPEATS", "20"))
# Seconds from a rank's end of the script body to its exit: destroying the groups, closing gloo's connections and
# the interpreter's shutdown take a few seconds even on a loaded machine; a rank still alive after this is hung.
TEARDOWN_BOUND = 120.0
RUN_BOUND = 900.0  # a whole run (imports and steps included) on a machine shared by many test processes


def run_ranks(out: Path, shape: str, fault: str) -> list[dict]:
    """One run of ``fault_script.py SHAPE FAULT step 30 OUT`` on 2 ranks (torchrun's environment, no agent):
    per rank ``{"rc", "out", "exit", "hung", **its record}``; a rank hung in its teardown (or past
    :data:`RUN_BOUND`) gets its Python stacks dumped into its output, then is killed."""
    port, procs, logs = _free_port(), [], []
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_")}
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([IMPORT_PATH, env.get("PYTHONPATH", "")])
        log = open(out / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below, after the process ends)
        cmd = [sys.executable, str(SCRIPT), shape, fault, "step", "30", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    start, exits, hung = time.time(), {}, set()

    def record(rank: int) -> dict:
        path = out / f"rank{rank}.json"
        try:
            return json.loads(path.read_text()) if path.exists() else {}
        except json.JSONDecodeError:  # being written
            return {}

    while len(exits) + len(hung) < 2:
        now = time.time()
        for rank, proc in enumerate(procs):
            if rank in exits or rank in hung:
                continue
            if proc.poll() is not None:
                exits[rank] = now
                continue
            mine = record(rank)
            done = mine.get("teardown", mine.get("done"))  # the loop records when its teardown starts
            if (done is not None and now - done > TEARDOWN_BOUND) or now - start > RUN_BOUND:
                hung.add(rank)
                proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's Python stack into the log
                time.sleep(3)
                proc.kill()
        time.sleep(0.2)
    ranks = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        ranks.append(
            {"rc": proc.returncode, "out": text, "exit": exits.get(rank), "hung": rank in hung, **record(rank)}
        )
    return ranks


def _runs(tmp_path: Path, shape: str, fault: str, repeats: int) -> list[list[dict]]:
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return list(pool.map(lambda i: run_ranks(tmp_path / str(i), shape, fault), range(repeats)))


def _check(runs: list[list[dict]], rc: int) -> None:
    for i, ranks in enumerate(runs):
        for rank, r in enumerate(ranks):
            where = f"run {i} of {len(runs)} rank {rank}"
            times = {k: r.get(k) for k in ("entered", "teardown", "done", "exit")}
            peer = {k: ranks[1 - rank].get(k) for k in ("teardown", "done", "exit")}
            assert not r["hung"], (
                f"{where} did not exit within {TEARDOWN_BOUND:g} s of the start of its teardown ({times}; its peer "
                f"{peer}); its stacks:\n{r['out'][-6000:]}"
            )
            assert "terminate called" not in r["out"], f"{where} aborted at exit:\n{r['out'][-3000:]}"
            assert r["rc"] == rc, f"{where}: exit code {r['rc']}, expected {rc}:\n{r['out'][-3000:]}"


@pytest.mark.slow
def test_readme_loop_exits_every_run(tmp_path: Path) -> None:
    """The README's loop (``fpdt.release()``, ``accelerator.wait_for_everyone()``, ``accelerator.end_training()``):
    every rank of every run exits with code 0 (was: 1 run in 20 timed out in CI, marked xfail)."""
    runs = _runs(tmp_path, "loop", "none", LOOP_REPEATS)
    _check(runs, 0)
    for ranks in runs:  # every rank trained its 3 steps and left its body without an error
        assert all(r.get("done") is not None and r.get("error") is None for r in ranks), ranks


@pytest.mark.slow
@pytest.mark.parametrize("shape,fault,rc", [("trainer", "none", 0), ("apply", "refuse", 1)])
def test_no_abort_at_exit(tmp_path: Path, shape: str, fault: str, rc: int) -> None:
    runs = _runs(tmp_path, shape, fault, REPEATS)
    _check(runs, rc)
    if shape == "apply":
        for ranks in runs:
            for r in ranks:
                assert "ValueError: ring_degree=1 (FPDTConfig.ring_degree / FPDT_RING_DEGREE)" in r["out"]
                assert "leaves 2 ranks to split the model's 1 attention heads" in r["out"]


def _trainer_registers_world(rank: int, world_size: int, out: str) -> list:
    """A world that exists before ``FPDTTrainer`` (``TrainingArguments(bf16=True)`` creates it when constructed,
    as a launcher's script does): the trainer registers its destruction at exit."""
    import datasets
    from testkit import tiny_model
    from transformers import TrainingArguments

    import hf_fpdt
    import hf_fpdt.trainers.adapter as adapter_module  # where FPDTTrainer sets up the world

    calls = []
    real = adapter_module.destroy_at_exit
    adapter_module.destroy_at_exit = lambda *groups: calls.append(groups)
    try:
        args = TrainingArguments(output_dir=out, use_cpu=True, bf16=True, report_to=[], max_steps=1)
        model = tiny_model("tiny-llama", None, seed=None)
        ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 2, "labels": [[1, 2, 3, 4]] * 2})
        hf_fpdt.FPDTTrainer(model, args, fpdt=hf_fpdt.FPDTPlugin(), train_dataset=ds)
    finally:
        adapter_module.destroy_at_exit = real
    return calls


def test_trainer_destroys_the_world_it_runs_on_at_exit(tmp_path: Path) -> None:
    """With ``bf16=True`` the world exists before ``FPDTTrainer`` (was: left to interpreter shutdown, which aborted
    2 of 14 two-rank runs with ``terminate called without an active exception``)."""
    from distributed import run_distributed

    calls = run_distributed(_trainer_registers_world, 1, str(tmp_path))[0]
    assert (None,) in calls
