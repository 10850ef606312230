"""Print the fp32/bf16 error against float64 of the LM head's log-softmax paths at a trained model's logit scale.

    PYTHONPATH=$PWD python tests/scripts/real_scale_numerics.py [--tokens 1023 --hidden 576 --vocab 49152]

Inputs: :func:`realscale.real_scale_head` (logits about -30 to +45, vocabulary 49,152, hidden 576, 1,023 tokens,
as the issue-36 checkpoint). Each row: a path's relative error (norm) against the same computation in float64, and
its ratio to HF's path in the same dtype (HF: ``F.cross_entropy`` of the upcast logits; TRL's unfused path:
``log_softmax`` of them, gathered). The inputs are rounded to the dtype first and the reference computes on the
rounded values, so the figures are the paths' own arithmetic; ``--exact`` puts them on grids where fp32 logits are
exact, leaving the log-softmax and its backward alone. Per token: the largest log-probability error in units of
``eps (1 + |log p|)`` and the largest d-hidden row error in units of eps times the row's condition
(:mod:`realscale`). Run it with ``PYTHONPATH`` at another checkout to see that code's figures.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from realscale import (  # noqa: E402
    FP32_FLOOR,
    ce_logit_grad,
    lm_loss_grads,
    real_scale_head,
    rel,
    row_grad_excess,
    token_logprob_excess,
    token_logprob_grads,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1023)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tiles", type=int, default=16, help="tiles of the tiled paths (default: loss_tiles')")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--exact", action="store_true", help="inputs on grids where fp32 logits are exact")
    args = parser.parse_args()
    import hf_fpdt

    print(f"hf_fpdt from {os.path.dirname(hf_fpdt.__file__)}; torch {torch.__version__}")
    h, w, y = real_scale_head(args.tokens, args.hidden, args.vocab, exact=args.exact)
    z = h @ w.t()
    loss = torch.nn.functional.cross_entropy(z, y).item()
    print(f"logits {z.min().item():.1f} .. {z.max().item():.1f}, mean loss {loss:.3f} nats; floor {FP32_FLOOR:.1e}")
    del z
    ce_names = ("loss", "d hidden", "d head weight")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        # the inputs as this dtype holds them; the reference is float64 on the same values (the paths' own error)
        hx, wx = h.to(dtype), w.to(dtype)
        ref_ce = lm_loss_grads(hx.double(), wx.double(), y, "hf")
        ref_tok = token_logprob_grads(hx.double(), wx.double(), y, "hf")
        ref_dz = ce_logit_grad(hx, wx, y)
        print(f"\n{name}: cross-entropy (mean over tokens)          rel. error vs float64 (ratio to HF)")
        base = dict(zip(ce_names, lm_loss_grads(hx, wx, y, "hf")))
        rows = {"HF F.cross_entropy": base}
        for tiles in sorted({1, args.tiles}):
            rows[f"tiled_lm_loss, {tiles} tiles"] = dict(zip(ce_names, lm_loss_grads(hx, wx, y, "tiled", tiles)))
        _table(rows, dict(zip(ce_names, ref_ce)), base)
        print("per token: largest d-hidden row error / (eps * row condition):")
        for label, got in rows.items():
            print(f"  {label:32s}{row_grad_excess(got['d hidden'], ref_dz, wx):12.3g}")
        print(f"\n{name}: TRL fields (per-token log-probs, their sum, entropy; grads of sum a*logp + 0.01 H)")
        base = token_logprob_grads(hx, wx, y, "hf")
        rows = {"log_softmax, gathered": base}
        rows[f"tiled_token_logprobs, {args.tiles} tiles"] = token_logprob_grads(hx, wx, y, "tiled", args.tiles)
        _table(rows, ref_tok, base)
        print("per token: largest log-prob error / (eps (1 + |log p|)):")
        for label, got in rows.items():
            print(f"  {label:32s}{token_logprob_excess(got['log_probs'], ref_tok['log_probs']):12.3g}")


def _table(rows: dict, ref: dict, base: dict) -> None:
    names = list(ref)
    print(f"{'path':34s}" + "".join(f"{n:>22s}" for n in names))
    for label, got in rows.items():
        cells = []
        for n in names:
            err, b = rel(got[n], ref[n]), rel(base[n], ref[n])
            cells.append(f"{err:9.2e} ({err / max(b, FP32_FLOOR):5.1f}x)")
        print(f"{label:34s}" + "".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
