"""Long-context supervised finetuning with TRL's SFTTrainer and FPDT sequence parallelism: ``hf_fpdt.FPDTSFTTrainer``.

Runs as is on a CPU-only machine with nothing downloaded (a preset model built from its seeded config on every rank,
a word-level tokenizer built in memory, documents of random words of different lengths generated locally)::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        examples/sft_long.py --sp-size 2 --max-length 2048 --chunk-size 256 --max-steps 4

and the one-process baseline beside it (TRL's own ``SFTTrainer``, HF ``sdpa``, no FPDT), whose losses the run above
equals to float32 rounding::

    python examples/sft_long.py --attn sdpa --max-length 2048 --max-steps 4

By default TRL pads the documents of a batch to its longest (``--per-device-batch-size`` documents per step and
DP rank); ``--packing`` packs them into rows of ``--max-length`` tokens instead, each document attending only
to itself (documents as skipped blocks: docs/guides/packed-sequences.md). Full fine-tuning by default, ``--lora``
trains a LoRA adapter. No weights are saved; ``--metrics-json PATH``: the main process writes
``{"losses": [global training loss of each optimizer step], ...}`` there. Existing output follows the examples'
one rule (examples/_common.py): another run's ``--metrics-json`` or ``--output-dir`` (its ``run.json``) is not
replaced unless ``--overwrite-output-dir``; the same command again replaces its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random

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
    p.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama, tiny-neox, ...)")
    p.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="sdpa = TRL's SFTTrainer, the baseline")
    p.add_argument("--sp-size", type=int, default=None, help="sequence-parallel size (default: FPDT_SP_SIZE or 1)")
    p.add_argument("--chunk-size", type=int, default=256, help="global tokens per attention chunk")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per row (the longest document, or a pack)")
    p.add_argument("--num-docs", type=int, default=32, help="documents of max-length/4 .. max-length words")
    p.add_argument("--packing", action="store_true", help="pack documents into rows of --max-length tokens")
    p.add_argument("--per-device-batch-size", type=int, default=2, help="rows per step and DP rank")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter on every linear layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="TRL's output_dir (default: out/sft_long/<attn>_sp<N>_np<world>)")
    p.add_argument("--metrics-json", default=None, help="write per-step losses here")
    add_overwrite_argument(p)
    args = p.parse_args(argv)
    if args.attn == "sdpa" and args.sp_size not in (None, 1):
        p.error("--attn sdpa is TRL's trainer without sequence parallelism: use --sp-size 1 (or --attn fpdt)")
    return args


def documents(n: int, max_words: int, vocab: list[str], seed: int) -> list[dict]:
    """``n`` texts of ``max_words // 4`` to ``max_words - 2`` random words (one token each; room for BOS/EOS)."""
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choices(vocab, k=rng.randint(max_words // 4, max_words - 2)))} for _ in range(n)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    use_cpu = not torch.cuda.is_available()
    if use_cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # torchrun-launched processes otherwise stay unjoined on CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed (imported by Accelerate) warns when it guesses
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = resolve_sp_size(args.sp_size) if args.attn == "fpdt" else 1
    if sp > world:
        raise Refusal(
            f"--sp-size {sp} needs {sp} processes, this launch has {world}: accelerate launch --config_file "
            f"accelerate_configs/cpu.yaml --num_processes {sp} examples/sft_long.py ..."
        )
    kind = "packed" if args.packing else "padded"
    output_dir = args.output_dir or f"out/sft_long/{kind}_{args.attn}_sp{sp}_np{world}"
    record = run_record(args, world)
    check_no_overwrite(args, record, output_dir)  # before the imports below: a refusal ends in a second

    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer
    from hf_fpdt.models.presets import preset_config
    from hf_fpdt.trainers.logs import quiet_library_deprecations

    tokenizer = word_tokenizer()
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in the baseline
    config = preset_config(args.model)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the tokenizer's (else TRL aligns, noisily)
        setattr(config, name, getattr(tokenizer, name))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
    train = datasets.Dataset.from_list(documents(args.num_docs, args.max_length, vocab, args.seed))

    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name warns there)
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in SFTConfig.__dataclass_fields__
        else ("gradient_checkpointing")
    )
    targs = SFTConfig(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        max_length=args.max_length,
        packing=args.packing,
        optim="sgd",
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=use_cpu,
        bf16=False,  # fp32, so the SP run and the baseline agree to float32 rounding
        ddp_backend="gloo" if use_cpu and world > 1 else None,
        ddp_find_unused_parameters=False,  # every trained parameter takes part in each step
        **{checkpointing: True},
    )
    kwargs = dict(model=model, args=targs, train_dataset=train, processing_class=tokenizer)
    if args.lora:
        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    with quiet_library_deprecations():  # PEFT and TRL call transformers' deprecated checkpointing names
        if args.attn == "fpdt":
            fpdt = hf_fpdt.FPDTPlugin(sp_size=sp, chunk_size=args.chunk_size, pad_token_id=tokenizer.pad_token_id)
            trainer = hf_fpdt.FPDTSFTTrainer(**kwargs, fpdt=fpdt)
        else:
            trainer = SFTTrainer(**kwargs)
        main_process = trainer.accelerator.is_main_process
        if main_process:
            print(f"[sft_long] {args.model} {kind} attn={args.attn} sp={sp} world={world}", flush=True)
        trainer.train()

    metrics = {
        "attn": args.attn,
        "sp_size": sp,
        "world_size": world,
        "packing": args.packing,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    if main_process:
        print("[sft_long] " + json.dumps(metrics), flush=True)
        write_metrics(args.metrics_json, metrics, record)
        save_record(output_dir, record)
    if args.attn == "fpdt":
        fpdt.release()
    return metrics


if __name__ == "__main__":
    run_main(main)
