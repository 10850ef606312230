"""TRL ``GRPOTrainer`` / ``RLOOTrainer`` runs shared by ``tests/integration/test_trl_grpo.py``: the one-process
baselines (in the test's process, sdpa) and ``FPDTGRPOTrainer`` / ``FPDTRLOOTrainer`` (launched).

Launched: ``grpo_loop.py OUT_JSON SP_SIZE CASE[,CASE...]``; rank 0 writes ``{case: result}`` (see :func:`grpo_run`)
and the trainable parameters' updates to ``OUT_JSON.<case>.pt``. ``SP_SIZE`` 0: TRL's own trainers (sdpa) on every
launched process (plain data parallelism, the reference of a DP x SP run). Each rank also records the error of
the bad combinations (``bad`` case) under ``errors``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import torch
from loop_common import TRAINING, finish, on_rank0
from testkit import tiny_model

CHUNK = 16
METRICS = (
    "loss",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "rewards/count_reward/mean",
    "rewards/count_reward/std",
)
# case: (trainer, PEFT, loss_type, beta, bf16)
CASES = {
    "lora": ("grpo", True, "grpo", 0.1, False),
    "full": ("grpo", False, "dapo", 0.05, False),
    "lora_bnpo": ("grpo", True, "bnpo", 0.0, False),
    "full_dr": ("grpo", False, "dr_grpo", 0.05, False),
    "rloo": ("rloo", False, None, 0.0, False),
    "lora_bf16": ("grpo", True, "grpo", 0.1, True),
    "lora_eval": ("grpo", True, "grpo", 0.1, False),
}
EVAL_TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


def tokenizer():
    from hf_fpdt.data.demo import word_tokenizer

    return word_tokenizer()


def prompts() -> datasets.Dataset:
    """Eight local prompts of 10 to 70 words (sentences of the demo tokenizer's vocabulary)."""
    words = "The grass is green . The sky is blue . The sun is yellow . Here we go . There and back again .".split()
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in torch.randint(10, 70, (8,), generator=g).tolist():
        start = int(torch.randint(0, len(words), (1,), generator=g))
        rows.append(" ".join(words[(start + i) % len(words)] for i in range(n)))
    return datasets.Dataset.from_dict({"prompt": rows})


def count_reward(completions: list, **kwargs) -> list[float]:
    """A deterministic toy reward: how often the completion says "blue", plus a little per word."""
    return [c.split().count("blue") + 0.1 * len(c.split()) for c in completions]


def model_dir(root: Path) -> str:
    """The tiny Llama (the demo tokenizer's vocabulary) saved once under ``root``: TRL loads a full fine-tune's
    reference model from the policy's path."""

    path = root / "tiny_grpo_model"
    if not (path / "config.json").exists():  # every launched rank may get here: each saves, one rename wins
        model = tiny_model("tiny-llama", "sdpa", vocab_size=len(tokenizer()))
        mine = root / f"tiny_grpo_model.{os.getpid()}"
        model.save_pretrained(mine)
        try:
            os.rename(mine, path)
        except OSError:  # another rank's copy (the same weights) is there
            shutil.rmtree(mine, ignore_errors=True)
    return str(path)


def config(case: str, output_dir: str, steps: int = 2, **changes):
    """The run of ``case``: 2 prompts x 4 completions per generation, two optimizer steps on it (the second
    against the old policy: clipping), SGD at a large learning rate so the steps move the policy."""
    from trl import GRPOConfig, RLOOConfig

    kind, _, loss_type, beta, bf16 = CASES[case]
    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=12,
        temperature=1.0,
        beta=beta,
        learning_rate=0.5,
        **TRAINING,
        bf16=bf16,
    )
    if case == "full":
        common["top_entropy_quantile"] = 0.8  # the entropy threshold's quantile over the (DP) batch's tokens
    if case == "lora_eval":
        common.update(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    common.update(changes)
    if kind == "rloo":
        return RLOOConfig(**common)
    return GRPOConfig(**common, loss_type=loss_type, epsilon=0.05)


def grpo_run(case: str, output_dir: str, fpdt=None, args=None, **extra) -> tuple[dict, dict]:
    """``({"metrics": {name: [per step]}, "completions": [...], "sp_heads": [...], "history": [...]},
    {name: update})`` of ``case``: the logged metrics (and the whole log_history), the completions of the last
    generation, whether the policy (and reference model) score through the sequence-parallel fused head, and how
    far training moved each trainable parameter;
    ``fpdt``: an ``FPDTPlugin`` (the FPDT trainer) or None (TRL's trainer, sdpa)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer, RLOOTrainer

    import hf_fpdt

    kind, lora, *_ = CASES[case]
    path = model_dir(Path(output_dir).parent)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    common = dict(
        model=model,
        reward_funcs=count_reward,
        args=args if args is not None else config(case, output_dir),
        train_dataset=prompts(),
        processing_class=tokenizer(),
    )
    common.update(extra)  # e.g. another reward function or a rollout function
    if case == "lora_eval":
        common["eval_dataset"] = prompts().select(range(2))
    if lora:
        common["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    if fpdt is None:
        trainer = (RLOOTrainer if kind == "rloo" else GRPOTrainer)(**common)
    else:
        cls = hf_fpdt.FPDTRLOOTrainer if kind == "rloo" else hf_fpdt.FPDTGRPOTrainer
        trainer = cls(**common, fpdt=fpdt)
    start = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    metrics = {name: [h.get(name) for h in history] for name in METRICS if any(name in h for h in history)}
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    for name in sorted({k for h in evals for k in h if k.startswith("eval_") and k not in EVAL_TIMINGS}):
        metrics[name] = [h.get(name) for h in evals]
    params = {n: p.detach().float() - start[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
    from hf_fpdt.integrations.state import find_forward
    from hf_fpdt.trainers.trl_fused_head import KIND

    policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    ref = getattr(trainer, "ref_model", None)
    heads = [find_forward(m, KIND) is not None for m in (policy, ref) if m is not None]  # sharded fused heads
    completions = list(trainer._logs["completion"])
    return {
        "metrics": metrics,
        "completions": completions,
        "sp_heads": heads,
        "history": trainer.state.log_history,
    }, params


def rank_rollout(prompts: list, trainer) -> dict:
    """A rollout function whose completions depend on the rank: the SP group must not train on them."""
    import torch.distributed as dist

    ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    return {"prompt_ids": ids, "completion_ids": [[5 + dist.get_rank(), 6, 3] for _ in ids], "logprobs": None}


def bad_combinations(sp_size: int, output_dir: str) -> dict[str, str]:
    """The error each bad combination raises on this rank (before any collective)."""
    import hf_fpdt

    found = {}
    for name, case, change, extra in (
        ("vllm", "lora", {"use_vllm": True}, {}),
        ("rloo beta", "rloo", {"beta": 0.1}, {}),
        ("rank-dependent rollout", "lora", {}, {"rollout_func": rank_rollout}),
    ):
        args = config(case, output_dir, **change)
        try:
            grpo_run(case, output_dir, hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=CHUNK), args=args, **extra)
            found[name] = "no error"
        except ValueError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def main(out_path: str, sp_size: int, cases: str) -> None:
    import torch.distributed as dist

    import hf_fpdt

    result: dict = {}
    out = Path(out_path)
    for case in cases.split(","):
        if case == "bad":
            errors = bad_combinations(sp_size, str(out.parent / "grpo_bad"))
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, errors)
            result["errors"] = gathered
            continue
        # the ranks of a group run their chunked pieces on different thread counts (issue 43): nothing may depend
        # on the ranks computing bit-identically
        threads = 1 + int(os.environ.get("RANK", "0")) % 2
        fpdt = None if sp_size == 0 else hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=CHUNK, cpu_threads=threads)
        res, params = grpo_run(case, str(out.parent / f"grpo_{case}"), fpdt)
        result[case] = res
        on_rank0(lambda: torch.save(params, f"{out_path}.{case}.pt"))  # noqa: B023 (called at once)
    finish(lambda: out.write_text(json.dumps(result)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
