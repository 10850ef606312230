"""Per-rank step time, memory and bytes moved at one SP size as Ulysses alone and with a ring (issue 51, item 2).

Runs SP ``P`` gloo processes (CPU) once per ``(U, R)`` with ``U x R = P`` (default P 4: U 4, U 2 x R 2, U 1 x R 4),
each ``--steps`` training steps of one Llama-shaped model under ``hf_fpdt.apply`` (4 query heads over 2 KV heads by
default, so that every split runs) with gradient checkpointing, and records every collective of the step after the
first: the bytes each rank receives from the other ranks, by kind (the Ulysses all-to-alls of q/k/v, o, dO and
dq/dk/dv; the ring's all-gather of k, v and all-to-all of dk, dv; the rest: the loss, the input check). Prints a
markdown table, one row per ``(U, R)`` and rank: the step time (mean of the steps after the first), the peak RSS
growth over the steps, and the bytes per step.

    PYTHONPATH=.:tests python tests/scripts/ring_table.py [--sp 4] [--seq 4096] [--chunk 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch
import torch.distributed as dist


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _worker(rank: int, world: int, ring: int, args: dict) -> dict:
    from testkit import tiny_model

    import hf_fpdt
    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.integrations.state import state_of

    model = tiny_model(
        "llama", "sdpa", vocab_size=1024, hidden_size=args["hidden"], intermediate_size=2 * args["hidden"],
        num_hidden_layers=2, num_attention_heads=args["heads"], num_key_value_heads=args["kv_heads"],
        max_position_embeddings=args["seq"],
    )  # fmt: skip
    config = hf_fpdt.FPDTConfig(chunk_size=args["chunk"], offload=False, ring_degree=ring)
    model = hf_fpdt.apply(model, config, group=dist.group.WORLD)
    model.gradient_checkpointing_enable()
    model.train()
    runtime = state_of(model).runtime
    ids = torch.randint(0, 1024, (1, args["seq"]), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=rank, sp_size=world, chunk_size=args["chunk"], ring=ring)
    counts: dict[str, int] = {"ulysses": 0, "ring": 0, "other": 0}
    real_a2a, real_gather = dist.all_to_all_single, dist.all_gather
    groups = {}

    def kind(group, op: str) -> str:
        if not groups:
            rg = runtime.ring_groups(args["heads"], args["kv_heads"])
            groups.update({"ulysses": dist.group.WORLD if rg is None else rg.ulysses, "ring": getattr(rg, "ring", 0)})
        if group is groups.get("ring"):
            return "ring"
        if group is groups.get("ulysses") and op == "a2a":
            return "ulysses"
        return "other"

    def a2a(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        own = output_split_sizes[me] if output_split_sizes else out.numel() // size
        counts[kind(group, "a2a")] += (out.numel() - own) * out.element_size()
        return real_a2a(out, inp, output_split_sizes, input_split_sizes, group=group, **kw)

    def gather(tensors, tensor, group=None, **kw):
        counts[kind(group, "gather")] += (len(tensors) - 1) * tensor.numel() * tensor.element_size()
        return real_gather(tensors, tensor, group=group, **kw)

    times, base = [], _rss_kib()
    for step in range(args["steps"]):
        if step == 1:
            dist.all_to_all_single, dist.all_gather = a2a, gather
        dist.barrier()
        start = time.perf_counter()
        out = model(**shard.model_kwargs(), use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 1:
            dist.all_to_all_single, dist.all_gather = real_a2a, real_gather
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"time": sum(times[1:]) / max(1, len(times) - 1), "rss": max(0, peak - base), "bytes": counts}


def main(argv: list[str] | None = None) -> None:
    from distributed import run_distributed

    from hf_fpdt.config import sp_degrees

    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    a = parser.parse_args(argv)
    args = {k: getattr(a, k) for k in ("seq", "chunk", "hidden", "heads", "kv_heads", "steps")}
    rings = [r for r in range(1, a.sp + 1) if a.sp % r == 0 and a.sp // r <= a.heads]
    print(
        f"# SP {a.sp} on CPU (gloo): Llama-shaped, {a.heads} query / {a.kv_heads} KV heads, hidden {a.hidden}, "
        f"2 layers, fp32, seq {a.seq}, chunk {a.chunk}, batch 1, gradient checkpointing, offload off; "
        f"{torch.get_num_threads()} torch threads in the parent"
    )
    print(
        "| U x R | rank | step time (s) | peak RSS growth (MiB) | Ulysses all-to-all (MiB) | ring (MiB) | other (KiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for ring in rings:
        u, r = sp_degrees(a.heads, a.kv_heads, a.sp, ring)
        for rank, res in enumerate(run_distributed(_worker, a.sp, ring, args, timeout=1800)):
            b = res["bytes"]
            print(
                f"| U {u} x R {r} | {rank} | {res['time']:.3f} | {res['rss'] / 1024:.1f} | "
                f"{b['ulysses'] / 2**20:.2f} | {b['ring'] / 2**20:.2f} | {b['other'] / 1024:.1f} |"
            )
    print("(bytes: received from the other ranks in one training step, per rank)")


if __name__ == "__main__":
    main(sys.argv[1:])
