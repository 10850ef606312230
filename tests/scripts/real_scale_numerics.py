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
    parser.add_argument("--model", action="store_true", help="also the whole real-scale model, per part")
    args = parser.parse_args()
    import hf_fpdt

    print(f"hf_fpdt from {os.path.dirname(hf_fpdt.__file__)}; torch {torch.__version__}")
    if args.model:
        _model_table()
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


PARTS = {
    "loss": ("loss",),
    "attention (q/k/v/o)": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "MLP (gate/up/down)": ("gate_proj", "up_proj", "down_proj"),
    "norms": ("norm",),
    "embedding = head (tied)": ("embed_tokens",),
}


def _model_table() -> None:
    """:func:`realscale.real_scale_model` (8 layers, vocabulary 49,152), 256 tokens, chunk 64: loss and gradients
    of each path against the float64 model, the worst tensor of each part (relative norm) and its ratio to sdpa's."""
    import copy

    from realscale import float64_step, own_samples, real_scale_model

    import hf_fpdt

    def step(model):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return {"loss": out.loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    model = real_scale_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(3))
    labels = own_samples(model, ids)
    ref = float64_step(copy.deepcopy(model).double(), ids, labels)
    os.environ["FPDT_CHUNK_SIZE"] = "64"  # the attention-only path's chunk
    paths = {
        "HF sdpa fp32": step(model),
        "hf_fpdt.apply fp32": step(hf_fpdt.apply(real_scale_model(), hf_fpdt.FPDTConfig(chunk_size=64))),
        'attn="fpdt" fp32': step(real_scale_model(attn="fpdt")),
    }
    worst = {
        path: {part: max(rel(g[n], ref[n]) for n in ref if any(k in n for k in keys)) for part, keys in PARTS.items()}
        for path, g in paths.items()
    }
    base = worst["HF sdpa fp32"]
    print("\nmodel (8 layers, vocab 49152, 256 tokens, chunk 64): worst tensor per part vs float64 (ratio to sdpa)")
    print(f"{'path':24s}" + "".join(f"{p:>26s}" for p in PARTS))
    for path, errs in worst.items():
        cells = "".join(f"{errs[p]:14.2e} ({errs[p] / max(base[p], FP32_FLOOR):5.1f}x)" for p in PARTS)
        print(f"{path:24s}{cells}")


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
