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
(``causal-gemma2``);
mask4d: a user's 4D bool mask ``[1, 1, S, S]`` (causal, the first tenth of the keys dropped for every query, as a
left-padded row's), every block's verdict found by a scan of the mask and its cut blocks read a row slice at a time;
scan4d: that scan alone (the :class:`~hf_fpdt.attention.block_mask.BlockMask` of the same mask, no model), against
nothing (``-``);
prefill: ``generate()``'s prefill of the whole sequence (one new token, a KV cache, no gradients: the cache path of
:mod:`hf_fpdt.attention.cached_attention`) under a sliding window (Mistral-shaped, ``--window``), against the plain
causal prefill of the same shape (``prefill-causal``);
prefill-attn: that prefill's attention alone, one layer's (``cached_attention`` over random queries, keys and values
of the model's shape, 8 heads / 4 KV heads of 32, the cache path's blocks and kernels), under the window against
none (``prefill-attn-causal``): the model's other peaks (MLP, cache) do not hide the attention's.

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
from .cli import add_length

CASES = ("causal", "documents", "padding", "window", "softcap", "mask4d", "scan4d", "prefill", "prefill-attn")
# the plain causal row of the same shape each case is compared with (default "causal")
_REFERENCE = {
    "softcap": "causal-gemma2",
    "causal-gemma2": "causal-gemma2",
    "prefill": "prefill-causal",
    "prefill-causal": "prefill-causal",
    "prefill-attn": "prefill-attn-causal",
    "prefill-attn-causal": "prefill-attn-causal",
    "scan4d": None,
}


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
    add_length(parser, "length", _positive, 16384, "tokens of the training sequence (one length) [16384]")
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
    if case in ("window", "prefill"):
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
    if case in ("mask4d", "scan4d"):  # causal, the first tenth of the keys dropped (rows that keep nothing: -100)
        pad = length // 10
        mask = torch.ones(length, length, dtype=torch.bool).tril_()
        mask[:, :pad] = False
        labels[:, :pad] = -100
        batch["attention_mask"] = mask[None, None]
    return {k: v.to(device) for k, v in batch.items()}


def _scan(batch: dict, chunk: int):
    """The block pattern of the mask4d case's mask, as the chunk pipeline builds it (one per layer and call)."""
    from ..attention.block_mask import MaskSpec

    length = batch["input_ids"].shape[1]
    lengths = tuple(min(chunk, length - a) for a in range(0, length, chunk))
    return MaskSpec(dense_mask=batch["attention_mask"]).blocks(lengths)


def _attention_alone(case: str, payload: dict, device, dtype) -> dict:
    """One layer's prefill attention on the cache path (no model): queries, keys and values of the bench models'
    shape over the whole sequence, the window or none, chunk and backend as the options say."""
    import torch

    from ..attention.cached_attention import cached_attention
    from .common import PeakMemory

    g = torch.Generator().manual_seed(0)
    length, window = payload["length"], payload["window"] if case == "prefill-attn" else None
    q = torch.randn(1, length, 8, 32, generator=g).to(device, dtype)
    k, v = (torch.randn(1, length, 4, 32, generator=g).to(device, dtype) for _ in range(2))
    backend = None if payload["backend"] == "auto" else payload["backend"]
    with PeakMemory(device) as mem, torch.no_grad():
        t0 = time.perf_counter()
        cached_attention(q, k, v, 32**-0.5, payload["chunk_size"], backend=backend, window=window)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return {"case": case, "peak_bytes": mem.bytes, "measure": mem.how, "seconds": seconds, "device": str(device)}


def _prefill(model, batch: dict):
    """generate()'s prefill of the whole row and one new token (greedy; the logits of the last position only). The
    attention mask is passed, all ones: without one ``generate`` reads the ids equal to ``pad_token_id`` as padding,
    holes that would cut every block."""
    import torch

    ids = batch["input_ids"]
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)


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
    batch = _batch(case, payload["length"], payload, device)
    loss = None
    if case == "scan4d":
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            _scan(batch, payload["chunk_size"])
            seconds = time.perf_counter() - t0
        return {"case": case, "peak_bytes": mem.bytes, "measure": mem.how, "seconds": seconds, "device": str(device)}
    if case.startswith("prefill-attn"):
        return _attention_alone(case, payload, device, dtype)
    config = model_config(case, payload)
    torch.manual_seed(0)
    with torch.device(device):  # eager: HF has no sdpa for Gemma 2 (apply switches every model to fpdt)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype).train()
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=payload["chunk_size"], backend=payload["backend"]))
    if case.startswith("prefill"):
        model.eval()
    else:
        enable_checkpointing(model)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        if case.startswith("prefill"):
            with torch.no_grad():
                _prefill(model, batch)
        else:
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
        "loss": None if loss is None else float(loss.detach()),
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
    training = ("causal", "documents", "padding", "window", "mask4d")  # each against the causal step
    order = [c for c in training if c in cases or c == "causal" and set(training) & set(cases)]
    if "softcap" in cases:
        order += ["causal-gemma2", "softcap"]
    if "scan4d" in cases:
        order += ["scan4d"]
    if "prefill" in cases:
        order += ["prefill-causal", "prefill"]
    if "prefill-attn" in cases:
        order += ["prefill-attn-causal", "prefill-attn"]
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
