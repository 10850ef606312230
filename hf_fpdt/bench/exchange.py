"""Step time with the attention's SP all-to-alls synchronous against overlapped with the compute.

``python -m hf_fpdt.bench exchange`` spawns ``--sp`` ranks joined over gloo on the CPU, builds one Llama-shaped model
per variant (hidden 256, 8 heads / 4 KV heads of dim 32, 2 layers, vocab 1024, fp32; the same weights) under
``hf_fpdt.apply``, and times training steps (forward + backward, non-reentrant activation checkpointing as in
training) of one random sample per length, the two variants alternating step by step so both see the same machine:

sync: ``FPDTConfig(sync_exchanges=True)``, each all-to-all waited where it is issued;
overlapped: the default, chunk i+1's q/k/v and chunk i's output (backward: dO, and chunk i's dq/dk/dv) in flight
while chunk i computes (:mod:`hf_fpdt.attention.chunked`).

A step's time is the slowest rank's; the table shows each variant's median over ``--steps`` (after ``--warmup``),
the speed-up (sync / overlapped) and whether the two variants' losses are the same bits. Gloo runs its collectives
on its own threads, which compete with the compute for the CPUs: on a machine with few cores (or a loaded one) the
overlap may not show; the line above the table gives the load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

from .cli import add_length
from .common import count, counts, format_load, format_table, machine_load
from .masked import model_config as masked_model_config

VARIANTS = ("sync", "overlapped")
COLUMNS = ["seq_len", "chunk", "sp", "sync_s", "overlapped_s", "speedup", "same_loss"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m hf_fpdt.bench exchange``."""
    lengths = "4096,8192,16384"
    add_length(parser, "seq_lens", counts(), lengths, f"comma-separated sequence lengths [{lengths}]")
    parser.add_argument("--chunk-size", type=count(), default=1024, help="FPDT attention chunk size in tokens [1024]")
    parser.add_argument("--sp", type=count(2), default=2, help="sequence-parallel ranks (gloo processes) [2]")
    parser.add_argument("--steps", type=count(), default=3, help="timed steps per variant and length [3]")
    parser.add_argument("--warmup", type=count(0), default=1, help="untimed steps per variant first [1]")
    parser.add_argument("--threads", type=count(0), default=0, help="torch threads per rank (0: CPUs / sp) [0]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def model_config():
    """The benchmark's model: the masked bench's causal Llama (hidden 256, 8 heads over 4 KV heads, head dim 32,
    2 layers, vocabulary 1024): small enough for a CPU, GQA."""
    return masked_model_config("causal", {})


def _rank(rank: int, args: dict, out: str) -> None:
    """One spawned rank: every length, both variants alternating; rank 0 writes the rows to ``out``."""
    import torch
    import torch.distributed as dist

    import hf_fpdt

    from ..data.layout import shard_batch
    from ..distributed.groups import build_groups
    from .common import build_model, enable_checkpointing

    sp = args["sp"]
    torch.set_num_threads(args["threads"] or max(1, (os.cpu_count() or 1) // sp))
    dist.init_process_group("gloo", rank=rank, world_size=sp)
    try:
        groups = build_groups(sp)
        models = {}
        for variant in VARIANTS:
            config = hf_fpdt.FPDTConfig(chunk_size=args["chunk_size"], sync_exchanges=variant == "sync")
            model = build_model(model_config(), torch.float32, torch.device("cpu"))  # the same weights (seed 0)
            model = hf_fpdt.apply(model, config, group=groups.sp)
            enable_checkpointing(model)
            models[variant] = model
        rows = []
        for length in args["seq_lens"]:
            ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(length))
            shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=sp, chunk_size=args["chunk_size"])
            times = {v: [] for v in VARIANTS}
            losses = {}
            for step in range(args["warmup"] + args["steps"]):
                for variant in VARIANTS if step % 2 == 0 else VARIANTS[::-1]:
                    model = models[variant]
                    model.zero_grad(set_to_none=True)
                    dist.barrier()  # outside the step: every rank starts together
                    start = time.perf_counter()
                    loss = model(**shard.model_kwargs()).loss
                    loss.backward()
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
                    losses[variant] = loss.detach().clone()
                    if step >= args["warmup"]:
                        times[variant].append(float(took))
            same = torch.tensor([float(torch.equal(losses["sync"], losses["overlapped"]))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            medians = {v: statistics.median(t) for v, t in times.items()}
            rows.append(
                {"seq_len": length, "chunk": args["chunk_size"], "sp": sp, **{f"{v}_s": medians[v] for v in VARIANTS}}
                | {"times": times, "same_loss": bool(same.item())}
            )
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict]:
    """Spawn the ranks and return rank 0's rows."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    payload = {
        "sp": args.sp,
        "chunk_size": args.chunk_size,
        "seq_lens": [int(n) for n in args.seq_lens.split(",") if n.strip()],
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(payload, out), nprocs=args.sp)
        with open(out) as f:
            return json.load(f)


def run(args: argparse.Namespace) -> int:
    load = machine_load()
    rows = measure(args)
    print(f"# hf_fpdt.bench exchange: gloo on CPU, {format_load(load)}")
    table = [
        [
            str(r["seq_len"]),
            str(r["chunk"]),
            str(r["sp"]),
            f"{r['sync_s']:.3f}",
            f"{r['overlapped_s']:.3f}",
            f"{r['sync_s'] / r['overlapped_s']:.2f}x",
            "yes" if r["same_loss"] else "NO",
        ]
        for r in rows
    ]
    print(format_table(COLUMNS, table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "rows": rows}, f, indent=2)
    return 0
