"""Long-context DPO (or KTO) with TRL and FPDT sequence parallelism: ``hf_fpdt.FPDTDPOTrainer``.

Runs as is on a CPU-only machine with nothing downloaded (a preset model built from its seeded config on every
rank, the reference too; a word-level tokenizer built in memory; preference pairs of random words generated
locally)::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        examples/dpo_long.py --sp-size 2 --prompt-len 1024 --completion-len 512 --max-steps 4

and the one-process baseline beside it (TRL's own ``DPOTrainer``, HF ``sdpa``, no FPDT)::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 1 \\
        examples/dpo_long.py --attn sdpa --prompt-len 1024 --completion-len 512 --max-steps 4

Both print each step's loss and reward margin; they agree to float32 rounding. ``--lora`` trains a LoRA adapter
(the reference is then the adapter disabled), ``--kto`` trains KTO (``FPDTKTOTrainer``) on the same pairs
unpaired. With ``--metrics-json PATH`` the main process writes ``{"losses": [...], "margins": [...], "logps": [...]}``
(per step; ``logps``: the chosen completions' log-probability sums). Existing output follows the examples' one rule
(examples/_common.py): another run's ``--metrics-json`` or output folder (``--output-dir``/<attn>_sp<N>, its
``run.json``) is not replaced unless ``--overwrite-output-dir``; the same command again replaces its own.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

from _common import (
    Refusal,
    add_overwrite_argument,
    check_no_overwrite,
    run_main,
    run_record,
    save_record,
    write_metrics,
)

METRICS = {"losses": "loss", "margins": "rewards/margins", "logps": "logps/chosen"}  # --metrics-json: TRL's log keys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama, small-llama, ...)")
    p.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="sdpa = TRL's DPOTrainer, the baseline")
    p.add_argument("--sp-size", type=int, default=1, help="sequence-parallel size (fpdt)")
    p.add_argument("--chunk-size", type=int, default=256, help="global tokens per attention chunk")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt words per pair")
    p.add_argument("--completion-len", type=int, default=512, help="words per chosen/rejected completion")
    p.add_argument("--num-pairs", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--per-device-batch-size", type=int, default=1, help="pairs per step and DP rank")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--loss-type", default="sigmoid", help="TRL's DPO loss types, comma-separated")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (reference: the adapter disabled)")
    p.add_argument("--kto", action="store_true", help="KTO on the pairs unpaired (FPDTKTOTrainer / KTOTrainer)")
    p.add_argument("--output-dir", default="out/dpo_long")
    p.add_argument("--metrics-json", default=None)
    add_overwrite_argument(p)
    return p.parse_args(argv)


def checkpointing_field(config_class: type) -> str:
    """transformers 5.24 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name warns)."""
    fields = getattr(config_class, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def pairs(n: int, prompt_len: int, completion_len: int, vocab: list[str], kto: bool) -> list[dict]:
    rng = random.Random(0)

    def text(k: int) -> str:
        return " " + " ".join(rng.choice(vocab) for _ in range(rng.randint(k // 2, k)))

    rows = [{"prompt": text(prompt_len), "chosen": text(completion_len), "rejected": text(completion_len)}
            for _ in range(n)]  # fmt: skip
    if not kto:
        return rows
    return [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
            for i, r in enumerate(rows)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.attn == "sdpa" and args.sp_size != 1:
        raise Refusal("--attn sdpa is the one-process baseline: no sequence parallelism (--sp-size 1)")
    out = Path(args.output_dir) / f"{args.attn}_sp{args.sp_size}"
    record = run_record(args, int(os.environ.get("WORLD_SIZE", "1")))
    check_no_overwrite(args, record, out)  # before the imports below: a refusal ends in a second

    import datasets
    import torch
    from accelerate import PartialState
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer
    from hf_fpdt.models.presets import preset_config
    from hf_fpdt.trainers.logs import quiet_library_deprecations

    if not torch.cuda.is_available():  # DeepSpeed (imported by Accelerate when installed) warns when it guesses CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state = PartialState()

    def initial_model() -> torch.nn.Module:  # seeded: the same weights on every rank, no files to share
        torch.manual_seed(0)
        cfg = preset_config(args.model)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the tokenizer's (else TRL aligns, noisily)
            for config in (model.config, model.generation_config):
                setattr(config, name, getattr(tokenizer, name))
        return model

    tokenizer = word_tokenizer()
    model = initial_model()
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
    data = datasets.Dataset.from_list(pairs(args.num_pairs, args.prompt_len, args.completion_len, vocab, args.kto))
    fields = dict(
        output_dir=str(out),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size * (2 if args.kto else 1),  # KTO: rows, not pairs
        train_sampling_strategy="sequential",
        beta=args.beta,
        optim="sgd",
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        **{checkpointing_field(DPOConfig): True},
        ddp_find_unused_parameters=False,  # every trained parameter takes part in each step
        max_length=None,
    )
    config = KTOConfig(**fields) if args.kto else DPOConfig(**fields, loss_type=args.loss_type.split(","))
    kwargs = dict(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    if args.lora:  # the reference: the adapter disabled
        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    else:  # the reference: a copy of the initial weights (FPDT is applied to it over the same SP group)
        kwargs["ref_model"] = initial_model()
    with quiet_library_deprecations():  # TRL toggles checkpointing through transformers' deprecated names
        if args.attn == "sdpa":
            trainer = (KTOTrainer if args.kto else DPOTrainer)(**kwargs)
        else:
            fpdt = hf_fpdt.FPDTPlugin(sp_size=args.sp_size, chunk_size=args.chunk_size)
            trainer = (hf_fpdt.FPDTKTOTrainer if args.kto else hf_fpdt.FPDTDPOTrainer)(**kwargs, fpdt=fpdt)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    metrics = {key: [h[name] for h in logs] for key, name in METRICS.items()}
    if state.is_main_process:
        for step, (loss, margin) in enumerate(zip(metrics["losses"], metrics["margins"]), 1):
            print(f"step {step}: loss {loss:.6f}  rewards/margins {margin:+.6f}")
        write_metrics(args.metrics_json, metrics, record)
        save_record(out, record)


if __name__ == "__main__":
    run_main(main)
