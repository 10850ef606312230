"""A hand-written Accelerate training loop with FPDT sequence parallelism: ``hf_fpdt.FPDTPlugin``.

Runs as is on a CPU-only machine with nothing downloaded (a preset model built from its seeded config, a word-level
tokenizer built in memory, passkey samples generated locally), on one plain ``python`` process or launched::

    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        examples/accelerate_loop.py --sp-size 2 --seq-len 2048 --chunk-size 256 --max-steps 4

and the one-process baseline beside it (the same loop without the plugin: HF ``sdpa``), whose per-step losses the
run above equals to float32 rounding::

    python examples/accelerate_loop.py --attn sdpa --seq-len 2048 --max-steps 4

The plugin shards each batch into the rank's slice of FPDT's layout, scales the loss so the gradients are those of
one process on the global batch, and ``global_loss`` gives the loss of the whole global batch on every rank
(docs/guides/accelerate-loop.md). ``--metrics-json PATH``: the main process writes ``{"losses": [...]}`` (another
run's file is not replaced unless ``--overwrite-output-dir``; the same command again replaces its own: the examples'
one rule, examples/_common.py).
"""

from __future__ import annotations

import argparse
import json
import os

from _common import Refusal, add_overwrite_argument, check_no_overwrite, run_main, run_record, write_metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama, tiny-neox, ...)")
    p.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="sdpa = the loop without FPDT")
    p.add_argument("--sp-size", type=int, default=1, help="sequence-parallel size")
    p.add_argument("--chunk-size", type=int, default=256, help="global tokens per attention chunk")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--metrics-json", default=None, help="write per-step losses here")
    add_overwrite_argument(p)
    args = p.parse_args(argv)
    if args.attn == "sdpa" and args.sp_size != 1:
        p.error("--attn sdpa is the loop without sequence parallelism: use --sp-size 1 (or --attn fpdt)")
    return args


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    record = run_record(args, int(os.environ.get("WORLD_SIZE", "1")))
    check_no_overwrite(args, record, None)  # before the imports below: a refusal ends in a second
    import torch

    if not torch.cuda.is_available():  # DeepSpeed (imported by Accelerate when installed) warns when it guesses CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, default_data_collator

    import hf_fpdt
    from hf_fpdt.data.demo import passkey_dataset, word_tokenizer
    from hf_fpdt.models.presets import preset_config

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if args.sp_size > accelerator.num_processes:
        raise Refusal(
            f"--sp-size {args.sp_size} needs {args.sp_size} processes, this launch has {accelerator.num_processes}: "
            f"accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes {args.sp_size} "
            "examples/accelerate_loop.py ..."
        )
    tokenizer = word_tokenizer()
    data = passkey_dataset(tokenizer, args.max_steps, args.seq_len, seed=0, progress=False).with_format("torch")
    torch.manual_seed(0)  # the same initial weights on every rank and in the baseline
    model = AutoModelForCausalLM.from_config(preset_config(args.model), attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    loader = DataLoader(data, batch_size=1, shuffle=False, collate_fn=default_data_collator)

    losses = []
    if args.attn == "fpdt":
        fpdt = hf_fpdt.FPDTPlugin(sp_size=args.sp_size, chunk_size=args.chunk_size)
        model, optimizer, loader = fpdt.prepare(accelerator, model, optimizer, loader)
        for batch in loader:
            loss = model(**batch, num_items_in_batch=fpdt.num_items_in_batch(batch)).loss
            accelerator.backward(loss * fpdt.loss_scale)  # gradients are averaged over the whole world
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fpdt.global_loss(loss).item())  # the whole global batch's loss, on every rank
        fpdt.release()  # host buffers back now
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    if accelerator.is_main_process:
        print(f"[accelerate_loop] attn={args.attn} sp={args.sp_size} losses {json.dumps(losses)}", flush=True)
        write_metrics(args.metrics_json, {"losses": losses}, record)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process groups before exit
    return losses


if __name__ == "__main__":
    run_main(main)
