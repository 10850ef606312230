"""Peak memory and time of one training step with masked blocks, against the plain causal step of the same shape.

``python -m hf_fpdt.bench masked`` runs one forward + backward (activation checkpointing on, as in training) of a
small model under ``hf_fpdt.apply`` per case, each in a fresh process (:func:`hf_fpdt.bench.common.run_child`), with
the block kernel backend forced (``--backend math`` by default: the path every masked or softcapped block takes where
no fused kernel has the mask):

causal: plain causal attention, the reference row (Llama-shaped: hidden 256, 8 heads / 4 KV, 2 layers);
documents: packed documents (``position_ids`` restarting at 0, as TRL's padding-free SFT), cut blocks;
padding: a left-padded row (``attention_mask`` with zeros, labels -100 there), a key mask on every block;
window: a sliding window shorter than the chunk (Mistral-shaped, the same sizes), windowed blocks;
softcap: Gemma 2's attention logit softcap (Gemma-2-shaped, the same sizes), against the same model without it
(``causal-gemma2``).

The table: case, peak memory growth of the step (CPU: resident-set peak growth, ``VmHWM``; CUDA:
``max_memory_allocated``), its ratio to the plain causal step of the same shape, and the step's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from ..config import BACKENDS

CASES = ("causal", "documents", "padding", "window", "softcap")
# the plain causal row of the same shape each case is compared with (default "causal")
_REFERENCE = {"softcap": "causal-gemma2", "causal-gemma2": "causal-gemma2"}


def _positive(raw: str) -> int:
    """An argparse type: an int >= 1 (anything else: one usage line, exit code 2)."""
    if not raw.strip().isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {raw!r}")
    return int(raw)


def _cases(raw: str) -> list[str]:
    """``--cases``: a comma-separated subset of :data:`CASES`."""
    cases = [c.strip() for c in raw.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(CASES)}, got {raw!r}")
    return cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m hf_fpdt.bench masked``."""
    parser.add_argument("--length", type=_positive, default=16384, help="tokens of the training sequence [16384]")
    parser.add_argument("--chunk-size", type=_positive, default=4096, help="FPDT attention chunk size in tokens [4096]")
    parser.add_argument("--cases", type=_cases, default=list(CASES), help=f"comma-separated subset of {CASES}")
    parser.add_argument(
        "--backend",
        default="math",
        choices=("auto", *BACKENDS),
        help="block kernel backend of every block (FPDTConfig.backend) [math]",
    )
    parser.add_argument("--window", type=_positive, default=1000, help="the window case's window in tokens [1000]")
    parser.add_argument("--documents", type=_positive, default=7, help="packed documents in the documents case [7]")
    parser.add_argument("--softcap", type=float, default=50.0, help="the softcap case's attention softcap [50.0]")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto [auto]")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each case's process (0: torch's)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case [1800]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def model_config(case: str, args: dict):
    """The case's model config: hidden 256, 8 heads / 4 KV heads (head dim 32), 2 layers, vocab 1024."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    sizes = dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1 << 20,
    )
    if case in ("softcap", "causal-gemma2"):
        cap = args["softcap"] if case == "softcap" else None
        # Gemma 2's sliding layers get a window longer than the sequence: the softcap is the only mask here.
        return Gemma2Config(
            **sizes,
            attn_logit_softcapping=cap,
            final_logit_softcapping=None,
            sliding_window=1 << 20,
            query_pre_attn_scalar=32,
        )
    if case == "window":
        return MistralConfig(**sizes, sliding_window=args["window"])
    return LlamaConfig(**sizes)


def _batch(case: str, length: int, args: dict, device) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (1, length), generator=g)
    labels = ids.clone()
    pos = torch.arange(length).unsqueeze(0)
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if case == "documents":  # uneven documents, none aligned to a chunk
        n = args["documents"]
        cuts = sorted(int(c) for c in torch.randperm(length - 1, generator=g)[: n - 1] + 1)
        starts = torch.zeros(length, dtype=torch.long)
        starts[cuts] = 1
        doc = starts.cumsum(0)
        first = torch.zeros(n, dtype=torch.long)
        first[1:] = torch.tensor(cuts)
        batch["position_ids"] = (torch.arange(length) - first[doc]).unsqueeze(0)
    if case == "padding":  # left padding of a tenth of the row
        pad = length // 10
        mask = torch.ones(1, length, dtype=torch.long)
        mask[:, :pad] = 0
        labels[:, :pad] = -100
        batch["attention_mask"] = mask
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: v.to(device) for k, v in batch.items()}


def measure(payload: dict) -> dict:
    """One case in this process: build, apply, one timed step under :class:`~hf_fpdt.bench.common.PeakMemory`."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_fpdt

    from .common import PeakMemory, default_device, enable_checkpointing

    if payload["threads"]:
        torch.set_num_threads(payload["threads"])
    device = default_device() if payload["device"] == "auto" else torch.device(payload["device"])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    case = payload["case"]
    config = model_config(case, payload)
    torch.manual_seed(0)
    with torch.device(device):  # eager: HF has no sdpa for Gemma 2 (apply switches every model to fpdt)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype).train()
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=payload["chunk_size"], backend=payload["backend"]))
    enable_checkpointing(model)
    batch = _batch(case, payload["length"], payload, device)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return {
        "case": case,
        "peak_bytes": mem.bytes,
        "measure": mem.how,
        "seconds": seconds,
        "loss": float(loss.detach()),
        "device": str(device),
    }


def rows(results: list[dict]) -> list[list[str]]:
    """Table rows: case, peak growth, ratio to the plain causal row of the same shape, seconds."""
    from .common import format_bytes

    by_case = {r["case"]: r for r in results}
    out = []
    for r in results:
        if "error" in r:
            out.append([r["case"], r["error"], "-", "-"])
            continue
        ref = by_case.get(_REFERENCE.get(r["case"], "causal"))
        ratio = "-" if ref is None or not ref.get("peak_bytes") else f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x"
        out.append([r["case"], format_bytes(r["peak_bytes"]), ratio, f"{r['seconds']:.1f}"])
    return out


def run(args: argparse.Namespace) -> int:
    """Every case (and each one's causal reference row) in its own process; prints the table."""
    from .common import format_load, format_table, machine_load, run_child

    cases = args.cases
    order = [c for c in ("causal", "documents", "padding", "window") if c in cases or c == "causal"]
    if "softcap" in cases:
        order += ["causal-gemma2", "softcap"]
    payload = {k: getattr(args, k) for k in ("length", "chunk_size", "backend", "window", "documents", "softcap")}
    payload.update(device=args.device, threads=args.threads)
    results = []
    for case in order:
        print(f"  {case} ...", file=sys.stderr, flush=True)
        try:
            results.append(run_child("hf_fpdt.bench.masked", {**payload, "case": case}, timeout=args.timeout))
        except RuntimeError as err:  # the child failed (out of memory: killed): its last line, in the row
            results.append({"case": case, "error": str(err).rsplit(": ", 1)[-1][:60]})
        except subprocess.TimeoutExpired:
            results.append({"case": case, "error": f"timed out after {args.timeout:.0f}s"})
    measure_how = next((r["measure"] for r in results if "measure" in r), "n/a")
    print(
        f"masked blocks: {args.length} tokens, chunk {args.chunk_size}, backend {args.backend}, one training step "
        f"(peak: {measure_how}; {format_load(machine_load())})"
    )
    print(format_table(["case", "peak growth", "vs causal", "seconds"], rows(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":  # one case, in the child process run_child starts: its JSON result on the last line
    print(json.dumps(measure(json.loads(sys.argv[1]))))
