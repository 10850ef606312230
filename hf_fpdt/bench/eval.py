"""Long-context evaluation: passkey retrieval accuracy per length and depth, and perplexity per length.

``python -m hf_fpdt.bench eval`` builds a model (a preset with random weights, an HF config, or a
model folder with weights; ``--adapter`` adds a PEFT adapter), makes it compute with FPDT
(``hf_fpdt.apply``; ``--attn sdpa`` for plain HF), and for every length and depth generates the
answers of ``--samples`` passkey prompts (Mohtashami & Jaggi, 2023)::

    <bos> There is an important info hidden ... filler ... The pass key is 71432. Remember it.
    71432 is the pass key. ... filler ... What is the pass key? The pass key is

``depth`` is the share of the filler before the key (0: right after the introduction, 1: right before
the question); every prompt of a length has exactly that many tokens. An answer counts when the first
digits generated are the key. It prints accuracy per depth (rows) and length (columns), the mean per
length, the seconds of ``generate`` per prompt batch (prefill dominates), and writes a heat map PNG as
long-context papers draw it (``--heatmap``, by default ``out/eval/passkey_<what sets the run apart>.png``; needs
matplotlib: ``pip install hf_fpdt[eval]``). A progress bar counts the ``generate`` calls on a terminal (in a
log: a line per call). With ``--dataset`` (anything :func:`hf_fpdt.data.demo.text_dataset` takes) it adds
perplexity per length.

Generation runs through :mod:`hf_fpdt.attention.cached_attention` (chunked prefill against the KV cache, chunked decode
steps). With ``--sp``, launched on P processes (``torchrun --nproc-per-node P -m hf_fpdt.bench eval
--sp``), all processes form one sequence-parallel group: each prompt's prefill runs sequence-parallel
as training does (each rank its shard of the prompt and its share of the KV cache,
:mod:`hf_fpdt.integrations.sp_generation`), decode steps merge the ranks' attention, every rank gets the
same answers, and rank 0 prints and writes the heat map. Perplexity under ``--sp`` shards each row with
:func:`hf_fpdt.data.layout.shard_batch` and sums the ranks' shares of the loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .cli import add_length
from .common import Progress, count, counts, device_name, dtype_name, fractions, model_name

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


@dataclass
class RetrievalResult:
    """Accuracy per ``(length, depth)`` cell, and the mean ``generate`` seconds per batch of each length."""

    lengths: list[int]
    depths: list[float]
    accuracy: dict[tuple[int, float], float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def mean(self, length: int) -> float:
        """Accuracy at ``length`` over all depths."""
        return sum(self.accuracy[length, d] for d in self.depths) / len(self.depths)

    def overall(self) -> float:
        """Accuracy over every cell."""
        return sum(self.accuracy.values()) / len(self.accuracy)

    def table(self) -> str:
        """Depths as rows, lengths as columns, accuracy in percent; then the mean and the seconds per batch."""
        from .common import format_table

        headers = ["depth"] + [str(n) for n in self.lengths]
        rows = [[f"{d:.2f}"] + [f"{100 * self.accuracy[n, d]:.0f}%" for n in self.lengths] for d in self.depths]
        rows.append(["mean"] + [f"{100 * self.mean(n):.0f}%" for n in self.lengths])
        rows.append(["generate s"] + [f"{self.seconds[n]:.2f}" for n in self.lengths])
        return format_table(headers, rows)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def passkey_prompt(tokenizer, length: int, depth: float, rng: random.Random) -> tuple[list[int], str]:
    """A prompt of exactly ``length`` tokens with a random 5-digit key at ``depth`` of its filler, and the key.

    The texts are :mod:`hf_fpdt.data.demo`'s (the finetuning example trains on the same task).
    """
    from ..data.demo import FILLER, INTRO, KEY, QUESTION

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}: use a fraction of the filler in [0, 1]")
    key = str(rng.randint(10000, 99999))
    head = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + _ids(tokenizer, INTRO)
    key_ids, question = _ids(tokenizer, " " + KEY.format(key=key)), _ids(tokenizer, " " + QUESTION)
    fill = length - len(head) - len(key_ids) - len(question)
    if fill < 0:
        raise ValueError(
            f"a passkey prompt needs at least {length - fill} tokens with this tokenizer; raise the length"
        )
    filler = _ids(tokenizer, " " + FILLER)
    filler = (filler * (fill // len(filler) + 1))[:fill]
    before = round(depth * fill)
    return head + filler[:before] + key_ids + filler[before:] + question, key


def answered(text: str, key: str) -> bool:
    """Whether the first digits of a generated ``text`` (spaces between digits ignored) are ``key``."""
    digits = re.match(r"\D*([\d ]+)", text)
    return digits is not None and digits.group(1).replace(" ", "")[: len(key)] == key


@torch.no_grad()
def retrieval_accuracy(
    model: nn.Module,
    tokenizer,
    lengths: list[int],
    depths: list[float],
    samples: int = 4,
    seed: int = 0,
    batch_size: int | None = None,
    prefill_chunk_size: int | None = None,
    progress: bool = False,
) -> RetrievalResult:
    """Greedy answers of ``samples`` passkey prompts per ``(length, depth)``; see the module docstring.

    Args:
        model: an HF causal LM (FPDT or not; ``generate`` is called on it).
        tokenizer: its tokenizer.
        lengths, depths: the grid (prompt tokens; shares of the filler before the key).
        samples: prompts per cell (different keys).
        seed: the keys' random source.
        batch_size: prompts per ``generate`` call (default: all of a cell).
        prefill_chunk_size: HF's chunked prefill (``GenerationConfig.prefill_chunk_size``), or None.
        progress: a progress bar over the ``generate`` calls on stderr (tqdm; shown only on a terminal) and, where
            stdout is not a terminal (a pipe, a log file), a ``# passkey retrieval [k/N] ...`` line per call.
    """
    device = next(model.parameters()).device
    rng = random.Random(seed)
    answer_len = len(_ids(tokenizer, " 12345")) + 2
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result = RetrievalResult(list(lengths), list(depths))
    was_training = model.training
    step = batch_size or samples
    calls = len(lengths) * len(depths) * -(-samples // step)
    bar = Progress(calls, "passkey retrieval", "generate") if progress else None
    model.eval()
    try:
        for n in lengths:
            seconds = []
            for depth in depths:
                prompts = [passkey_prompt(tokenizer, n, depth, rng) for _ in range(samples)]
                correct = 0
                for i in range(0, samples, step):
                    batch = prompts[i : i + step]
                    ids = torch.tensor([p for p, _ in batch], device=device)
                    t0 = time.perf_counter()
                    out = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=answer_len,
                        do_sample=False,
                        pad_token_id=pad,
                        use_cache=True,  # training scripts switch the config's off
                        prefill_chunk_size=prefill_chunk_size,
                    )
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds.append(time.perf_counter() - t0)
                    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
                    hits = sum(answered(t, key) for t, (_, key) in zip(texts, batch))
                    correct += hits
                    if bar is not None:
                        bar.note(f"length {n}, depth {depth:g}")
                        bar.done(f"length {n}, depth {depth:g}: {hits}/{len(batch)} found ({seconds[-1]:.1f} s)")
                result.accuracy[n, depth] = correct / samples
            result.seconds[n] = sum(seconds) / len(seconds)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    return result


@torch.no_grad()
def perplexity(
    model: nn.Module, tokenizer, dataset: str, lengths: list[int], samples: int = 4, group=None, chunk_size: int = 0
) -> dict[int, float]:
    """Perplexity per length: ``dataset`` packed into rows of each length, token-weighted mean loss.

    With a sequence-parallel ``group`` (the model applied with it, ``chunk_size`` its chunk size) each rank
    runs its shard of a row and the ranks' shares of the loss are summed.
    """
    from ..data.demo import text_dataset
    from ..data.layout import shard_batch
    from ..distributed.all_to_all import group_rank, group_size
    from ..distributed.peers import guarded
    from ..integrations.state import state_of

    device = next(model.parameters()).device
    state = state_of(model)  # the layout's ring degree: the applied model's (1 up to the query heads)
    ring = state.runtime.model_ring_degree(model.config) if state is not None and group is not None else 1
    out = {}
    for n in lengths:
        rows = text_dataset(dataset, tokenizer, n, num_samples=samples)
        total, count = 0.0, 0
        for row in rows:
            ids = torch.tensor([row["input_ids"]], device=device)
            if group is None:
                loss = model(input_ids=ids, labels=ids, position_ids=torch.arange(n, device=device)[None]).loss
            else:
                shard = shard_batch(
                    ids, ids, rank=group_rank(group), sp_size=group_size(group), chunk_size=chunk_size, ring=ring
                )  # fmt: skip
                loss = model(**shard.model_kwargs()).loss  # this rank's share of the row's mean loss
                with guarded(group, "all_reduce of a row's loss (bench eval)"):
                    dist.all_reduce(loss, group=group)
            total += float(loss) * (n - 1)
            count += n - 1
        out[n] = math.exp(total / count)
    return out


def heatmap(result: RetrievalResult, path: str, title: str = "passkey retrieval") -> str:
    """Write the accuracy grid (depth down, length across) as a PNG; returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("the heat map needs matplotlib: pip install 'hf_fpdt[eval]' (or pass --no-heatmap)") from err
    grid = [[result.accuracy[n, d] for n in result.lengths] for d in result.depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(result.lengths), 1.0 + 0.5 * len(result.depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(result.lengths)), [str(n) for n in result.lengths])
    ax.set_yticks(range(len(result.depths)), [f"{100 * d:.0f}%" for d in result.depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("depth of the key")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m hf_fpdt.bench eval``."""
    parser.add_argument(
        "--model", type=model_name, default="tiny-llama", help="preset, HF config path, or model folder [tiny-llama]"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model folder's; presets: "
                        "hf_fpdt.data.demo.word_tokenizer)")  # fmt: skip
    parser.add_argument("--adapter", default=None, help="a PEFT adapter folder to load on the model")
    add_length(parser, "lengths", counts(1), "256,512,1024", "comma-separated prompt lengths [256,512,1024]")
    parser.add_argument(
        "--depths",
        type=fractions(0, 1),
        default=DEFAULT_DEPTHS,
        help=f"comma-separated key depths in [0, 1] [{DEFAULT_DEPTHS}]",
    )
    parser.add_argument("--samples", type=count(1), default=4, help="prompts per length and depth [4]")
    parser.add_argument("--batch-size", type=count(1), default=None, help="prompts per generate call [all of a cell]")
    parser.add_argument("--attn", choices=("fpdt", "sdpa"), default="fpdt", help="fpdt (hf_fpdt.apply) or plain HF")
    parser.add_argument("--chunk-size", type=count(1), default=256, help="FPDT chunk size in tokens [256]")
    parser.add_argument("--prefill-chunk-size", type=count(1), default=None, help="HF chunked prefill [off]")
    parser.add_argument("--dataset", default=None, help="a text dataset (name, folder or file) for perplexity")
    parser.add_argument("--ppl-samples", type=count(1), default=4, help="rows per length for perplexity [4]")
    parser.add_argument("--device", type=device_name, default=None, help="cpu, cuda, ... [the accelerator if any]")
    parser.add_argument(
        "--dtype", type=dtype_name, default="auto", help="fp32, bf16 or auto (fp32 on CPU, bf16 on CUDA)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heatmap",
        default=None,
        help="PNG path [out/eval/passkey_<model>_<attn>_<lengths>_..._seed<N>.png: one per run]",
    )
    parser.add_argument("--no-heatmap", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--sp", action="store_true", help="sequence-parallel over all launched processes (torchrun); rank 0 prints"
    )


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(model in eval mode on ``device``, tokenizer) from ``args.model`` / ``--tokenizer`` / ``--adapter``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data.demo import word_tokenizer
    from ..models.presets import load_model_config
    from .common import build_model

    weights = os.path.isdir(args.model) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(args.model)
    )  # fmt: skip
    if weights:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        model = build_model(load_model_config(args.model), dtype, device, seed=args.seed)
    if args.tokenizer or weights:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    else:  # random weights (a preset or a config): the passkey texts' word-level tokenizer
        tokenizer = word_tokenizer()
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model only {model.config.vocab_size}")
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    return model.eval(), tokenizer


def _sp_group(args: argparse.Namespace, device: torch.device):
    """``(group, whether this process prints)``: the world as one SP group under ``--sp``, else ``(None, True)``.

    A launcher (torchrun) sets the environment; the process group is initialised here unless it already is,
    with torch's default backend for the device."""
    if not args.sp:
        return None, True
    if args.attn != "fpdt":
        raise ValueError("--sp needs --attn fpdt (plain HF attention has no sequence parallelism)")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError("--sp runs on several processes: launch with torchrun --nproc-per-node P -m hf_fpdt.bench")
        dist.init_process_group(device_id=device if device.type != "cpu" else None)
    return dist.group.WORLD, dist.get_rank() == 0


def default_heatmap(args: argparse.Namespace, sp_size: int = 1) -> str:
    """The heat map's path when ``--heatmap`` is not given: named after what sets the run apart (model, adapter,
    attention, SP size, lengths, depths, samples, seed), so another run writes beside it, not over it."""

    def name(path: str) -> str:
        return re.sub(r"[^\w.-]+", "-", os.path.basename(os.path.normpath(path))).strip("-") or "model"

    parts = [name(args.model)] + ([name(args.adapter)] if args.adapter else [])
    parts += [args.attn + (f"-sp{sp_size}" if sp_size > 1 else ""), "-".join(str(n) for n in _ints(args.lengths))]
    parts += [f"{len(_floats(args.depths))}depths", f"{args.samples}samples", f"seed{args.seed}"]
    return os.path.join("out", "eval", "passkey_" + "_".join(parts) + ".png")


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the tables; returns the exit status."""
    import hf_fpdt

    from .common import default_device, parse_dtype

    lengths, depths = _ints(args.lengths), _floats(args.depths)
    if not lengths or not depths or args.samples < 1:
        raise ValueError("give at least one length, one depth and --samples >= 1")
    device = torch.device(args.device) if args.device and args.device != "auto" else default_device()
    dtype = parse_dtype(args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32"))
    if args.sp and device.type != "cpu" and device.index is None:  # one accelerator per process
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
    group, main = _sp_group(args, device)
    model, tokenizer = load_model(args, device, dtype)
    if args.attn == "fpdt":
        hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=args.chunk_size), group=group)
    say = print if main else (lambda *a, **k: None)
    sp = f" sp={dist.get_world_size(group)}" if group is not None else ""
    say(f"[eval] {args.model} attn={args.attn} chunk={args.chunk_size}{sp} on {device} ({dtype})", flush=True)
    result = retrieval_accuracy(
        model,
        tokenizer,
        lengths,
        depths,
        samples=args.samples,
        seed=args.seed,
        batch_size=args.batch_size,
        prefill_chunk_size=args.prefill_chunk_size,
        progress=main,
    )
    say(f"passkey retrieval accuracy ({args.samples} prompts per cell):")
    say(result.table())
    report = {
        "lengths": lengths,
        "depths": depths,
        "accuracy": {f"{n}/{d}": a for (n, d), a in result.accuracy.items()},
        "generate_seconds": result.seconds,
    }
    if not args.no_heatmap and main:
        path = args.heatmap or default_heatmap(args, dist.get_world_size(group) if group is not None else 1)
        say(f"heat map: {heatmap(result, path, title=f'passkey retrieval, {args.model}')}")
        report["heatmap"] = path
    if args.dataset:
        from .common import format_table

        ppl = perplexity(model, tokenizer, args.dataset, lengths, args.ppl_samples, group, args.chunk_size)
        say(f"perplexity on {args.dataset}:")
        say(format_table(["length", "perplexity"], [[str(n), f"{p:.3f}"] for n, p in ppl.items()]))
        report["perplexity"] = ppl
    if args.json and main:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0
