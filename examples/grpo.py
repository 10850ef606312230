"""Long-context GRPO (or RLOO) with TRL and FPDT sequence parallelism: the rollout and the policy's training forward
on prompt + completion run sequence-parallel over the SP group.

Runs as is on a CPU-only machine with nothing downloaded (a preset model built from its config, a word-level
tokenizer built in memory, passkey prompts generated locally, a toy reward)::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        examples/grpo.py --sp-size 2 --prompt-len 1024 --chunk-size 128 --max-steps 4

and the one-process baseline beside it (TRL's own trainer, sdpa, no FPDT), whose losses the run above equals::

    python examples/grpo.py --attn sdpa --prompt-len 1024 --max-steps 4

Each prompt hides a five-digit pass key in filler text and asks for it; the reward is the share of the key's
distinct digits the completion says (``key_reward``), so it is deterministic given the completion. Every rank of an
SP group generates the same completions (same seed; the ranks check it), rewards and advantages are computed
once per group of completions, and each process scores its shard of every sequence (``hf_fpdt.FPDTGRPOTrainer``;
``--trainer rloo``: ``hf_fpdt.FPDTRLOOTrainer``, ``beta`` 0 under SP). LoRA by default (the reference model is
the base model, adapter disabled); ``--no-lora`` fine-tunes every weight, and with ``--beta`` > 0 TRL loads a
reference model from the saved policy. ``--metrics-json PATH``: the main process writes ``{"losses": [...],
"rewards": [...], "kl": [...], "completion_lengths": [...], ...}`` (one entry per optimizer step). Existing output
follows the examples' one rule (examples/_common.py): another run's ``--metrics-json`` or ``--output-dir`` (its
``run.json``) is not replaced unless ``--overwrite-output-dir``; the same command again replaces its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch
from _common import (
    Refusal,
    add_overwrite_argument,
    check_no_overwrite,
    resolve_sp_size,
    run_main,
    run_record,
    save_record,
    write_metrics,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama, ...) or an HF path")
    p.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo")
    p.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="sdpa = TRL's trainer, the baseline")
    p.add_argument("--sp-size", type=int, default=None, help="sequence-parallel size (default: FPDT_SP_SIZE or 1)")
    p.add_argument("--chunk-size", default=None, help="global tokens per attention chunk, or auto")
    p.add_argument("--prompt-len", type=int, default=1024, help="words of filler text per prompt (about tokens)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (a group)")
    p.add_argument("--per-device-batch-size", type=int, default=4, help="completions per step and DP rank")
    p.add_argument("--steps-per-generation", type=int, default=2, help="optimizer steps per generation batch")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--loss-type", default="dapo", help="GRPO's loss_type: grpo, bnpo, dr_grpo, dapo, ...")
    p.add_argument("--beta", type=float, default=None, help="KL coefficient (default: 0.04 for GRPO, 0 for RLOO)")
    p.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="autocast bf16 (as TrainingArguments(bf16=True))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="default: out/grpo/<trainer>_<attn>_sp<N>_np<world>")
    p.add_argument("--metrics-json", default=None, help="write per-step losses, rewards and KL here")
    add_overwrite_argument(p)
    args = p.parse_args(argv)
    if args.chunk_size is not None and args.chunk_size != "auto":
        args.chunk_size = int(args.chunk_size)
    if args.attn == "sdpa" and args.sp_size not in (None, 1):
        p.error("--attn sdpa is TRL's trainer without sequence parallelism: use --sp-size 1 (or --attn fpdt)")
    if args.beta is None:
        args.beta = 0.0 if args.trainer == "rloo" else 0.04
    return args


def passkey_prompts(n: int, words: int, seed: int) -> list[dict]:
    """``n`` prompts of about ``words`` words: filler text with a pass key hidden at a random depth, then the
    question; each row carries its ``key`` (the reward function reads it)."""
    from hf_fpdt.data.demo import FILLER, INTRO, KEY, QUESTION

    rng = random.Random(seed)
    filler = FILLER.split()
    rows = []
    for _ in range(n):
        key = " ".join(str(rng.randrange(10)) for _ in range(5))
        text = [filler[i % len(filler)] for i in range(max(words - 40, 0))]
        depth = rng.randrange(len(text) + 1)
        text[depth:depth] = KEY.format(key=key).split()
        rows.append({"prompt": " ".join([INTRO, *text, QUESTION]), "key": key})
    return rows


def key_reward(completions: list[str], key: list[str], **kwargs) -> list[float]:
    """The share of the pass key's distinct digits that the completion says (a toy reward, deterministic given
    the completion)."""
    scores = []
    for completion, digits in zip(completions, key):
        wanted = set(digits.split())
        scores.append(len(wanted & set(completion.split())) / len(wanted))
    return scores


def build_model(args: argparse.Namespace, tokenizer, output_dir: Path):
    """The policy; a preset is built from its config (seeded) and saved first when TRL must load a reference model
    from its path (full fine-tuning with beta > 0)."""
    from transformers import AutoModelForCausalLM

    from hf_fpdt.models.presets import PRESETS, preset_config

    if args.model not in PRESETS:
        return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    torch.manual_seed(args.seed)
    config = preset_config(args.model)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the tokenizer's (else TRL aligns, noisily)
        setattr(config, name, getattr(tokenizer, name))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if args.lora or args.beta == 0:
        return model
    path = output_dir / "initial_model"  # TRL builds the reference model from the policy's path
    if int(os.environ.get("RANK", "0")) == 0:
        model.save_pretrained(path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = resolve_sp_size(args.sp_size) if args.attn == "fpdt" else 1
    if sp > world:
        raise Refusal(
            f"--sp-size {sp} needs {sp} processes, this launch has {world}: accelerate launch --config_file "
            f"accelerate_configs/cpu.yaml --num_processes {sp} examples/grpo.py ..."
        )
    output_dir = Path(args.output_dir or f"out/grpo/{args.trainer}_{args.attn}_sp{sp}_np{world}")
    record = run_record(args, world)
    check_no_overwrite(args, record, output_dir)  # before the imports below: a refusal ends in a second
    use_cpu = not torch.cuda.is_available()
    if use_cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed (imported by Accelerate) warns when it guesses

    import datasets
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer
    from hf_fpdt.trainers.logs import quiet_library_deprecations

    common = dict(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        num_generations=args.num_generations,
        steps_per_generation=args.steps_per_generation,
        max_completion_length=args.max_completion_length,
        beta=args.beta,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=use_cpu,
        ddp_backend="gloo" if use_cpu and world > 1 else None,
        bf16=args.bf16,
        ddp_find_unused_parameters=False,  # every trained parameter takes part in each step
    )
    # TRL's configs turn checkpointing on by default; transformers 5.24 renamed it (the old name warns there)
    config_class = GRPOConfig if args.trainer == "grpo" else RLOOConfig
    if "activation_checkpointing" in getattr(config_class, "__dataclass_fields__", {}):
        common["activation_checkpointing"] = True
    if args.trainer == "grpo":
        targs = GRPOConfig(**common, loss_type=args.loss_type)
    else:
        targs = RLOOConfig(**common)
    main_process = targs.process_index == 0

    tokenizer = word_tokenizer()
    model = build_model(args, tokenizer, output_dir)
    train = datasets.Dataset.from_list(passkey_prompts(args.num_prompts, args.prompt_len, args.seed))
    kwargs = dict(model=model, reward_funcs=key_reward, args=targs, train_dataset=train, processing_class=tokenizer)
    if args.lora:
        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    with quiet_library_deprecations():  # PEFT and TRL call transformers' deprecated checkpointing names
        if args.attn == "fpdt":
            fpdt = hf_fpdt.FPDTPlugin(sp_size=sp, chunk_size=args.chunk_size, pad_token_id=tokenizer.pad_token_id)
            cls = hf_fpdt.FPDTGRPOTrainer if args.trainer == "grpo" else hf_fpdt.FPDTRLOOTrainer
            trainer = cls(**kwargs, fpdt=fpdt)
        else:
            trainer = (GRPOTrainer if args.trainer == "grpo" else RLOOTrainer)(**kwargs)
        if main_process:
            print(f"[grpo] {args.model} {args.trainer} attn={args.attn} sp={sp} world={world}", flush=True)
        trainer.train()

    history = [h for h in trainer.state.log_history if "loss" in h]
    metrics = {
        "trainer": args.trainer,
        "attn": args.attn,
        "sp_size": sp,
        "world_size": world,
        "losses": [h["loss"] for h in history],
        "rewards": [h.get("reward") for h in history],
        "kl": [h.get("kl") for h in history],
        "completion_lengths": [h.get("completions/mean_length") for h in history],
    }
    if main_process:
        print("[grpo] " + json.dumps({k: metrics[k] for k in ("losses", "rewards", "kl")}), flush=True)
        write_metrics(args.metrics_json, metrics, record)
        save_record(output_dir, record)
    return metrics


if __name__ == "__main__":
    run_main(main)
