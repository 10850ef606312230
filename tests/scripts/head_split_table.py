"""Per-rank heads and all-to-all bytes of the chunked attention over an SP group (issue 51, item 1), measured.

Runs ``P`` gloo processes, each one :func:`hf_fpdt.fpdt_attention` forward and backward at the attention shape of a
model (default Qwen2.5-7B's: 28 query heads over 4 KV heads, head dim 128) in bf16 over a global sequence of ``S``
tokens in one chunk, and records every ``dist.all_to_all_single`` the call makes: the elements each rank sends (to
the other ranks; its own piece stays) and receives (from them), in bytes. Prints a markdown table, one row per rank:
query heads, KV heads received and held by its kernels, bytes sent / received per direction, and per local token.

    PYTHONPATH=.:tests python tests/scripts/head_split_table.py [--sp 8] [--heads 28] [--kv-heads 4] [--seq 1024]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

D = 128


def _worker(rank: int, world: int, heads: int, kv: int, seq: int) -> dict:
    from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention

    g = torch.Generator().manual_seed(0)
    local = seq // world
    q, k, v, do = (torch.randn(1, local, n, D, generator=g).bfloat16() for n in (heads, kv, kv, heads))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=seq, offload=False), group=dist.group.WORLD)
    calls = []
    real = dist.all_to_all_single

    def counted(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        es = inp.element_size()
        n_in, n_out = inp.numel(), out.numel()
        own_in = input_split_sizes[rank] if input_split_sizes else n_in // world
        own_out = output_split_sizes[rank] if output_split_sizes else n_out // world
        calls.append(((n_in - own_in) * es, (n_out - own_out) * es))
        return real(out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, **kw)

    dist.all_to_all_single = counted
    try:
        mine = [t.requires_grad_() for t in (q, k, v)]
        out = fpdt_attention(*mine, runtime)
        forward = len(calls)
        out.backward(do)
    finally:
        dist.all_to_all_single = real
    names = ["q/k/v (fwd)", "o (fwd)", "dO (bwd)", "dq/dk/dv (bwd)"]
    assert forward == 2 and len(calls) == 4, calls  # one chunk: one exchange of each kind
    return {"local": local, "calls": dict(zip(names, calls))}


def main(argv: list[str] | None = None) -> None:
    from distributed import run_distributed

    from hf_fpdt.data.head_split import HeadSplit

    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, default=8)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    a = parser.parse_args(argv)
    split = HeadSplit.of(a.heads, a.kv_heads, a.sp)
    ranks = run_distributed(_worker, a.sp, a.heads, a.kv_heads, a.seq, timeout=900)
    local = ranks[0]["local"]
    print(f"# {split.describe()}; bf16, head dim {D}, {a.seq} tokens in one chunk ({local} per rank)")
    names = list(ranks[0]["calls"])
    print(
        "| rank | query heads | KV heads received | KV heads held | "
        + " | ".join(names)
        + " | total | per local token |"
    )
    print("|---" * (6 + len(names)) + "|")
    for r, res in enumerate(ranks):
        cells = [f"{s / 1024:.0f} / {g / 1024:.0f} KiB" for s, g in res["calls"].values()]
        sent = sum(s for s, _ in res["calls"].values())
        got = sum(g for _, g in res["calls"].values())
        print(
            f"| {r} | {split.counts[r]} | {split.kv_sent[r]} | {split.kv_counts[r]} | "
            + " | ".join(cells)
            + f" | {sent / 1024:.0f} / {got / 1024:.0f} KiB | {sent / local:.0f} / {got / local:.0f} B |"
        )
    print("(cells: sent to the other ranks / received from them)")


if __name__ == "__main__":
    main(sys.argv[1:])
