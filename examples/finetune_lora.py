"""Long-context LoRA finetuning with HF Trainer + PEFT, FPDT sequence parallelism, and Accelerate.

Runs as is on a CPU-only machine with nothing downloaded (a preset model built from its config, a
word-level tokenizer built in memory, passkey-retrieval samples generated locally)::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        examples/finetune_lora.py --sp-size 2 --seq-len 4096 --chunk-size 512 --max-steps 10

and the same command shape on GPUs (docs/guides/launch.md); ``accelerate_configs/deepspeed_zero3.yaml`` runs on
CPU too (docs/guides/launch.md, "Launch configs"). On one process plain ``python
examples/finetune_lora.py --max-steps 1`` runs too (``--sp-size`` > 1 needs a launcher: ``accelerate launch
--num_processes N``). ``--attn sdpa`` runs plain HF (no FPDT, no sequence parallelism): the baseline FPDT must
match. With ``--metrics-json PATH`` the main
process writes ``{"losses": [global training loss of each optimizer step], "tokens_per_s": ...,
"peak_memory_bytes": ..., "eval_loss": ..., "eval_accuracy": ..., ...}``; the LoRA adapter is saved to
``--output-dir`` (default: one folder per kind of run, ``out/finetune_lora/<attn>_sp<N>_np<world>[_zero3|_fsdp]``),
with the run's arguments in ``run.json`` beside it: a run with other arguments (another seed, length, ``--eval-
retrieval``...) refuses to replace that adapter or an existing ``--metrics-json`` unless ``--overwrite-output-dir``
(HF's convention) is given; the same command run again replaces its own output (the rule of every example:
examples/_common.py). A refusal ends every process with one line on stderr and exit code 2.
``FPDT_SP_SIZE`` sets the SP size when ``--sp-size`` is not given; with ``--attn sdpa`` a size other
than 1 is refused. ``--eval-retrieval`` adds the passkey retrieval accuracy of the finetuned model
(``retrieval_accuracy``: per length and depth, and overall), generated through ``model.generate`` with
FPDT's KV-cache path (under sequence parallelism by every rank of the SP group, the prompts' prefill
sequence-parallel).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from _common import Refusal, add_overwrite_argument, check_no_overwrite, resolve_sp_size, run_main, save_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama, tiny-neox, ...) or an HF path")
    p.add_argument("--dataset", default=None, help="a datasets name/path with a text column (default: passkey)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sample")
    p.add_argument("--num-train-samples", type=int, default=64)
    p.add_argument("--num-eval-samples", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="sdpa = plain HF, the baseline")
    p.add_argument("--sp-size", type=int, default=None, help="sequence-parallel size (default: FPDT_SP_SIZE or 1)")
    p.add_argument("--chunk-size", default=None, help="global tokens per attention chunk, or auto")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None, help="host offload of chunks")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--per-device-batch-size", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (e.g. sgd, adamw_torch)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="auto: bf16 on GPU")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="mixed precision as TrainingArguments(bf16=True): float32 weights (unless --dtype says otherwise), "
        "forward and backward under torch.autocast(bfloat16)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-dir",
        default=None,
        help="where the adapter goes (default: out/finetune_lora/<attn>_sp<N>_np<world>[_zero3|_fsdp])",
    )
    p.add_argument("--metrics-json", default=None, help="write per-step losses and throughput here")
    add_overwrite_argument(p)
    p.add_argument(
        "--eval-retrieval",
        action="store_true",
        help="after training, generate the answers of passkey prompts (--num-eval-samples per length and depth)\n"
        "and report retrieval accuracy (hf_fpdt.bench.eval; prefill sequence-parallel under --sp-size > 1)",
    )
    p.add_argument("--eval-lengths", default=None, help="prompt lengths of --eval-retrieval (default: --seq-len)")
    p.add_argument("--eval-depths", default="0,0.5,1", help="key depths of --eval-retrieval [0,0.5,1]")
    args = p.parse_args(argv)
    if args.chunk_size is not None and args.chunk_size != "auto":
        args.chunk_size = int(args.chunk_size)
    if args.attn == "sdpa" and args.sp_size not in (None, 1):
        p.error("--attn sdpa is plain HF without sequence parallelism: use --sp-size 1 (or --attn fpdt)")
    env_sp = os.environ.get("FPDT_SP_SIZE", "").strip()
    if args.attn == "sdpa" and args.sp_size is None and env_sp not in ("", "1"):
        p.error(
            f"FPDT_SP_SIZE={env_sp} is set, but --attn sdpa is plain HF without sequence parallelism: unset "
            "FPDT_SP_SIZE (or set it to 1) for the baseline, or use --attn fpdt"
        )
    return args


def launch_kind() -> str:
    """The sharding the Accelerate config asked for, read from the launcher's environment: "fsdp", "zero<stage>"
    (DeepSpeed) or "" (DDP / one process)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '')}"
    return ""


def default_output_dir(args: argparse.Namespace, sp_size: int, world: int) -> str:
    """One folder per kind of run (attention, SP size, processes, sharding), so a baseline never overwrites the
    FPDT run it is compared with, nor a ZeRO-3 or FSDP launch the DDP one."""
    kind = launch_kind()
    return f"out/finetune_lora/{args.attn}_sp{sp_size}_np{world}" + (f"_{kind}" if kind else "")


def run_record(args: argparse.Namespace, world: int) -> dict:
    """What tells this run apart from another one: its arguments, the world size and the launch's sharding."""
    from _common import run_record as record

    return record(args, world, launch=launch_kind() or "ddp")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory of tensors on CUDA; the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def sharded_parameters(model: torch.nn.Module) -> str | None:
    """How the trained model's parameters are sharded: "dtensor" (FSDP2), "zero3" (DeepSpeed), or None."""
    params = list(model.parameters())
    if any(type(p).__name__ == "DTensor" for p in params):
        return "dtensor"
    if any(hasattr(p, "ds_id") for p in params):
        return "zero3"
    return None


def build_model_and_tokenizer(args: argparse.Namespace, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fpdt.data.demo import word_tokenizer
    from hf_fpdt.models.presets import PRESETS, preset_config

    attn = "fpdt" if args.attn == "fpdt" else "sdpa"
    if args.model in PRESETS:
        model = AutoModelForCausalLM.from_config(preset_config(args.model), attn_implementation=attn, dtype=dtype)
        tokenizer = word_tokenizer()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}")
    # The tokenizer's special tokens are the model's: else Trainer aligns them itself, with a notice per process.
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        for config in (model.config, model.generation_config):
            setattr(config, name, getattr(tokenizer, name))
    model.config.use_cache = False
    return model, tokenizer


def build_datasets(args: argparse.Namespace, tokenizer, main: bool):
    from hf_fpdt.data.demo import passkey_dataset, text_dataset

    if args.dataset is None:
        train = passkey_dataset(tokenizer, args.num_train_samples, args.seq_len, seed=args.seed, progress=main)
        evals = passkey_dataset(tokenizer, args.num_eval_samples, args.seq_len, seed=args.seed + 1, progress=main)
        return train, evals
    packed = text_dataset(
        args.dataset, tokenizer, args.seq_len, num_samples=args.num_train_samples + args.num_eval_samples
    )
    if len(packed) <= args.num_eval_samples:
        raise ValueError(
            f"{args.dataset} gives {len(packed)} samples of {args.seq_len} tokens; need more than --num-eval-samples"
        )
    n_eval = args.num_eval_samples
    return packed.select(range(len(packed) - n_eval)), packed.select(range(len(packed) - n_eval, len(packed)))


def evaluate_retrieval(args: argparse.Namespace, model, tokenizer, sp_size: int = 1) -> dict | None:
    """Passkey retrieval accuracy of the finetuned model: ``{"overall": ..., "length/depth": ...}``, and the
    table printed by the main process. Generation runs through hf_fpdt's cached attention; under sequence parallelism
    every rank of each SP group generates (the prompt's prefill runs sequence-parallel, the ranks get the
    same answers), else the main process alone while the others wait."""
    from hf_fpdt.bench.eval import retrieval_accuracy

    result = None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if sp_size > 1 or rank == 0:
        lengths = [int(n) for n in args.eval_lengths.split(",")] if args.eval_lengths else [args.seq_len]
        depths = [float(d) for d in args.eval_depths.split(",")]
        res = retrieval_accuracy(model, tokenizer, lengths, depths, samples=args.num_eval_samples, seed=args.seed + 2)
        if rank == 0:
            print(f"[finetune_lora] passkey retrieval accuracy after finetuning:\n{res.table()}", flush=True)
            result = {"overall": res.overall(), **{f"{n}/{d}": a for (n, d), a in res.accuracy.items()}}
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return result


def check_launch(args: argparse.Namespace, use_cpu: bool) -> None:
    """Refuse launches that would not do what their Accelerate config says (read from the launcher's env)."""
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    zero3 = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and (
        os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )
    if fsdp and use_cpu:
        raise ValueError(
            "Accelerate runs FSDP only on GPUs: on CPU it would train with plain DDP instead. Launch on GPUs, or use "
            "accelerate_configs/cpu.yaml (FSDP2 x sequence parallelism on CPU is tested with fully_shard directly: "
            "tests/integration/test_fsdp2.py)"
        )
    if args.eval_retrieval and (fsdp or zero3):
        raise ValueError(
            "--eval-retrieval is not supported under FSDP or DeepSpeed ZeRO-3: generation gathers sharded parameters "
            "in collectives, so every rank would have to generate in lockstep (the main process alone, or one SP "
            "group, would wait forever). Evaluate the saved adapter instead: python -m hf_fpdt.bench eval --adapter DIR"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    use_cpu = not torch.cuda.is_available()
    check_launch(args, use_cpu)
    # Under `accelerate launch` with a DeepSpeed config DeepSpeed picks its CPU accelerator itself (Accelerate
    # drops DeepSpeed when asked for CPU) and the processes join over gloo (ddp_backend below); any other
    # launch on CPU asks Accelerate for CPU.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    force_cpu = use_cpu and not deepspeed
    if force_cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # torchrun-launched processes otherwise stay unjoined on CPU
    if use_cpu:  # DeepSpeed (imported by Accelerate when installed) warns when it has to guess the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = resolve_sp_size(args.sp_size)
    if args.attn == "fpdt" and sp > world:
        raise Refusal(
            f"--sp-size {sp} needs {sp} processes, this launch has {world}: run it with accelerate launch "
            f"--config_file accelerate_configs/cpu.yaml --num_processes {sp} examples/finetune_lora.py ..."
        )
    if args.output_dir is None:
        args.output_dir = default_output_dir(args, sp if args.attn == "fpdt" else 1, world)
    record = run_record(args, world)
    check_no_overwrite(args, record, args.output_dir, "the adapter")  # before the imports: a refusal ends in a second

    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed

    import hf_fpdt
    from hf_fpdt.trainers.logs import quiet_library_deprecations

    if args.dtype == "auto":
        bf16_weights = not args.bf16 and not use_cpu and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16_weights else torch.float32  # --bf16: float32 master weights, autocast
    else:
        dtype = getattr(torch, args.dtype)

    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name warns there)
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        **{checkpointing: args.gradient_checkpointing},
        learning_rate=args.learning_rate,
        optim=args.optim,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=force_cpu,
        ddp_backend="gloo" if use_cpu and world > 1 else None,  # one plain `python` process: no process group
        ddp_find_unused_parameters=False,
        bf16=args.bf16,
    )
    main_process = targs.process_index == 0
    world = targs.world_size

    set_seed(args.seed)  # every process builds the same base model and LoRA weights
    model, tokenizer = build_model_and_tokenizer(args, dtype)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear")
    with quiet_library_deprecations():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        model = get_peft_model(model, lora)
    train, evals = build_datasets(args, tokenizer, main_process)

    fpdt = None
    if args.attn == "fpdt":
        fpdt = hf_fpdt.FPDTPlugin(
            sp_size=args.sp_size, chunk_size=args.chunk_size, offload=args.offload, pad_token_id=tokenizer.pad_token_id
        )
    dp = world // (fpdt.sp_size if fpdt else 1)
    tokens_per_step = args.seq_len * args.per_device_batch_size * args.gradient_accumulation_steps * dp
    device = targs.device

    class Throughput(TrainerCallback):
        """Tokens/s and peak memory in every log line (so in the progress bar's output)."""

        def __init__(self) -> None:
            self.train_time, self.steps, self._t0 = 0.0, 0, None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.train_time += time.perf_counter() - self._t0
            self.steps += 1

        def tokens_per_s(self) -> float:
            return self.steps * tokens_per_step / max(self.train_time, 1e-9)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None and "loss" in logs:
                logs["tokens_per_s"] = round(self.tokens_per_s(), 1)
                logs["peak_memory_gib"] = round(peak_memory_bytes(device) / 2**30, 3)

    throughput = Throughput()

    def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Under FPDT this runs inside the tiled LM head, one tile of tokens at a time.
        return logits.argmax(-1)

    def token_accuracy(pred) -> dict:
        """Next-token accuracy over the labelled targets (HF's convention: prediction t vs label t + 1)."""
        preds, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
        valid = labels != -100
        return {"accuracy": float((preds[valid] == labels[valid]).mean())}

    common = dict(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[throughput],
        compute_metrics=token_accuracy,
        preprocess_logits_for_metrics=argmax,
    )
    trainer = hf_fpdt.FPDTTrainer(**common, fpdt=fpdt) if fpdt is not None else Trainer(**common)
    if main_process:
        where = f"sp={fpdt.sp_size} x dp={dp}, chunk={fpdt.config.chunk_size}" if fpdt else f"dp={dp}"
        print(f"[finetune_lora] {args.model} attn={args.attn} {where} seq_len={args.seq_len} on {device}", flush=True)

    trainer.train()
    eval_metrics = trainer.evaluate()
    sp_size = fpdt.sp_size if fpdt is not None else 1
    retrieval = evaluate_retrieval(args, model, tokenizer, sp_size) if args.eval_retrieval else None
    trainer.save_model(args.output_dir)  # the LoRA adapter (and the tokenizer)
    if main_process:
        save_record(args.output_dir, record)
    if fpdt is not None:
        fpdt.release()

    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    metrics = {
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],  # FSDP, DEEPSPEED, MULTI_CPU, ...
        "sharded": sharded_parameters(trainer.model_wrapped),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": eval_metrics.get("eval_loss"),
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "output_dir": args.output_dir,
        "tokens_per_s": throughput.tokens_per_s(),
        "peak_memory_bytes": int(peak.item()),
        "attn": args.attn,
        "world_size": world,
        "sp_size": fpdt.sp_size if fpdt else 1,
        "dp_size": dp,
        "seq_len": args.seq_len,
        "chunk_size": fpdt.config.chunk_size if fpdt else None,
        "retrieval_accuracy": retrieval,
        "run": record,
    }
    if main_process:
        print(
            f"[finetune_lora] {json.dumps({k: v for k, v in metrics.items() if k not in ('losses', 'run')})}",
            flush=True,
        )
        if args.metrics_json:
            Path(args.metrics_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.metrics_json).write_text(json.dumps(metrics, indent=1))
    return metrics


if __name__ == "__main__":
    run_main(main)
