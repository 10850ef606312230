"""The online-softmax merge's cost per block: the out-of-place form it replaced against ``merge_block`` in place.

``python tests/scripts/merge_cost.py [--tokens 4096] [--heads 16] [--dim 64] [--threads 1]``: one float32 block
``[1, tokens, heads, dim]`` merged into a running ``(out, lse)``; the table gives the best of 5 rounds of 10 merges
(milliseconds per merge) and the bytes each merge allocates (torch's profiler, CPU allocator events). The
out-of-place form is the one ``merge_block`` had before issue 44 item 5 (``out - sigmoid(d) * (out - out_b)``: three
chunk-sized temporaries and a new ``out`` per block).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_fpdt.attention.merge import merge_block


def out_of_place(out, lse, block_out, block_lse):
    weight = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)
    out = out - weight * (out - block_out)
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse


def in_place(out, lse, block_out, block_lse):
    return merge_block(out, lse, block_out, block_lse)


def allocated(fn, *args) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (1, args.tokens, args.heads, args.dim)
    g = torch.Generator().manual_seed(0)
    o, bo = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    lse, blse = (torch.randn(1, args.heads, args.tokens, generator=g) for _ in range(2))
    print(f"| merge of a float32 block {list(shape)} | ms per merge | MiB allocated per merge |")
    print("|---|---|---|")
    for name, fn in (("out of place (before)", out_of_place), ("in place (merge_block)", in_place)):
        best = float("inf")
        for _ in range(5):
            a, b = o.clone(), lse.clone()
            t = time.perf_counter()
            for _ in range(10):
                a, b = fn(a, b, bo, blse)
            best = min(best, (time.perf_counter() - t) / 10)
        mib = allocated(fn, o.clone(), lse.clone(), bo, blse) / (1 << 20)
        print(f"| {name} | {best * 1e3:.2f} | {mib:.2f} |")


if __name__ == "__main__":
    main()
