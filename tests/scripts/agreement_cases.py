"""What a trainer's step depends on, held differently per rank (launched by ``tests/integration/
test_trainer_agreement.py`` on 2 CPU processes at SP 2): each case builds (and trains) a trainer as a user would, with
one thing that differs between the ranks, and records what every rank raised.

``python agreement_cases.py OUT CASE[,CASE...]``: each rank writes ``OUT/rank{r}.json``: ``{case: "Type: message"
or "no error"}``. The cases:

* ``same``: the same arguments, only ``output_dir`` / ``run_name`` / ``logging_steps`` ... per rank the way a user
  might (``output_dir``, ``run_name``, ``report_to``, ``disable_tqdm``): trains (the control);
* ``trainer_lr``: ``FPDTTrainer`` with another ``learning_rate`` and ``max_grad_norm`` on rank 1;
* ``dpo_beta``: ``FPDTDPOTrainer`` with ``DPOConfig(beta=0.1)`` on rank 0, ``beta=0.5`` on rank 1;
* ``dpo_ref_weights``: ``FPDTDPOTrainer`` whose ``ref_model`` is built with ``seed = rank``;
* ``dpo_precompute_in_memory``: ``precompute_ref_log_probs=True`` with an in-memory dataset;
* ``grpo_rank_reward``: ``FPDTGRPOTrainer`` whose reward function adds ``0.7 * rank`` to every third completion:
  trains on SP rank 0's rewards (issue 43: the group's one DP rank scores), as ``grpo_same`` does;
* ``grpo_same``: ``FPDTGRPOTrainer`` with the toy reward alike on every rank: trains (the control).

GRPO cases also record the logged metrics (``OUT/rank{r}.json``'s ``"<case> metrics"``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dpo_loop import preference_data
from testkit import tiny_model

CHUNK = 16
TIMEOUT = 120  # seconds: a case that leaves one rank behind ends in SPPeerFailure, not a 10-minute wait


def _tokenizer():
    from hf_fpdt.data.demo import word_tokenizer

    return word_tokenizer()


def _lm(seed: int = 0):
    """The tiny Llama with the word tokenizer's vocabulary (seeded)."""
    return tiny_model(seed=seed, vocab_size=len(_tokenizer()))


def _dpo(out: Path, rank: int, *, ref_seed: int | None = None, precompute: bool = False, **fields) -> None:
    from trl import DPOConfig

    import hf_fpdt

    args = DPOConfig(
        output_dir=str(out / f"dpo_rank{rank}"), max_steps=1, per_device_train_batch_size=2, optim="sgd",
        learning_rate=0.01, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, max_length=None,
        dataset_num_proc=None, precompute_ref_log_probs=precompute, **fields,
    )  # fmt: skip
    ref = _lm(ref_seed) if ref_seed is not None else _lm()
    fpdt = hf_fpdt.FPDTPlugin(sp_size=2, chunk_size=CHUNK, sp_timeout=TIMEOUT)
    trainer = hf_fpdt.FPDTDPOTrainer(
        _lm(), ref_model=None if precompute else ref, args=args, processing_class=_tokenizer(),
        train_dataset=preference_data(4), fpdt=fpdt,
    )  # fmt: skip
    trainer.train()


def _trainer(out: Path, rank: int, **fields) -> None:
    from transformers import TrainingArguments, default_data_collator

    import hf_fpdt
    from hf_fpdt.data.demo import passkey_dataset, word_tokenizer

    args = TrainingArguments(
        output_dir=str(out / f"trainer_rank{rank}"), use_cpu=True, per_device_train_batch_size=1, max_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential", **fields,
    )  # fmt: skip
    ds = passkey_dataset(word_tokenizer(), 2, 96, seed=0, progress=False).with_format("torch")
    fpdt = hf_fpdt.FPDTPlugin(sp_size=2, chunk_size=CHUNK, offload=False, sp_timeout=TIMEOUT)
    trainer = hf_fpdt.FPDTTrainer(tiny_model(), args, fpdt=fpdt, train_dataset=ds, data_collator=default_data_collator)
    trainer.train()


def _rank_reward(completions: list, **kwargs) -> list[float]:
    """The toy reward of ``grpo_loop`` plus ``0.7 * rank`` on every third completion (a rank-dependent reward)."""
    bonus = 0.7 * dist.get_rank()
    return [c.split().count("blue") + 0.1 * len(c.split()) + (bonus if i % 3 == 0 else 0.0)
            for i, c in enumerate(completions)]  # fmt: skip


def _grpo(out: Path, rank: int, reward=None) -> dict:
    import grpo_loop

    import hf_fpdt

    args = grpo_loop.config("lora", str(out / "grpo"), steps=1)
    fpdt = hf_fpdt.FPDTPlugin(sp_size=2, chunk_size=grpo_loop.CHUNK, sp_timeout=TIMEOUT)
    extra = {} if reward is None else {"reward_funcs": reward}
    return grpo_loop.grpo_run("lora", str(out / "grpo"), fpdt, args=args, **extra)[0]["metrics"]


def case(name: str, out: Path, rank: int) -> dict | None:
    """Run case ``name``; GRPO cases return their logged metrics."""
    if name == "same":  # per-rank paths and display settings: excluded from the agreement
        _trainer(out, rank, run_name=f"run{rank}", log_level="info" if rank == 0 else "warning")
    elif name == "trainer_lr":
        _trainer(out, rank, learning_rate=1e-3 * (1 + rank), max_grad_norm=1.0 + rank)
    elif name == "dpo_beta":
        _dpo(out, rank, beta=0.1 if rank == 0 else 0.5)
    elif name == "dpo_ref_weights":
        _dpo(out, rank, ref_seed=rank)
    elif name == "dpo_precompute_in_memory":
        _dpo(out, rank, precompute=True)
    elif name == "grpo_rank_reward":
        return _grpo(out, rank, _rank_reward)
    elif name == "grpo_same":  # the toy reward alike on every rank: one step trains
        return _grpo(out, rank)
    else:
        raise ValueError(f"unknown case {name!r}")


def main(out: str, cases: str) -> None:
    from accelerate import PartialState

    PartialState()  # the world (gloo on CPU)
    rank = dist.get_rank()
    if "grpo" in cases:  # the GRPO model's folder, saved once before any rank loads it
        import grpo_loop

        if rank == 0:
            grpo_loop.model_dir(Path(out))
        dist.barrier()
    found: dict[str, object] = {}
    for name in cases.split(","):
        try:
            metrics = case(name, Path(out), rank)
            found[name] = "no error"
            if metrics is not None:
                found[f"{name} metrics"] = metrics
        except Exception as exc:  # recorded for the test, which checks every rank's type and message
            found[name] = f"{type(exc).__name__}: {exc}"
    os.makedirs(out, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
