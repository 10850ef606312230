"""The conformance matrix: fpdt equals HF ``sdpa`` on every call HF and its users make (issue 20).

One parametrised test over {attention alone, ``apply``, ``apply`` + LoRA} x {fp32, autocast bf16} x {no mask,
right padding, left padding, holes, 4D mask} x {grad, no_grad} x {no cache, dynamic cache, static cache} x
{sp 1, sp 2 where it applies}, tiny Llama (2 layers, GQA 4/2 heads), 2 rows of 40 tokens, chunk 16 (so a
padding run covers whole blocks and parts of others). Compared with sdpa on the same inputs: the logits
(every position, padding included), the loss, every trainable parameter's gradient.

* fp32: max error over the reference's largest magnitude <= 1e-5.
* autocast bf16 (CPU): per tensor, fpdt's distance to an fp32 sdpa reference is within ``k`` times sdpa's own
  distance under the same autocast, plus a floor of 1% of bf16's rounding step (``AUTOCAST_FLOOR``), for two
  distances: the relative L2 norm of the error (``k = 2``, flash-attention's rule) and the max error over the
  reference's largest magnitude (``k = 3``, which still catches one wrong element the norm would average away).
  The constants and the measurements behind them: ``BF16_RATIO`` below.
* where sdpa raises, fpdt raises too.

sp 2 applies to ``apply`` and ``apply`` + LoRA without a cache and with 2D masks (a 4D mask spans tokens other
ranks hold: the SP collator refuses it; SP generation has its own tests); its cells run in one gloo launch
(two processes) whose results every sp 2 cell reads.

Run as a script for the worst value per column and its bound (optionally only the cells whose id contains every
argument), from the repository root: ``PYTHONPATH=.:tests python tests/integration/test_conformance.py bf16 sp1``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from dataclasses import dataclass

import pytest
import torch
from testkit import tiny_model
from transformers import DynamicCache, StaticCache

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.config import IGNORE_INDEX
from hf_fpdt.integrations.state import state_of

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ENTRIES = ("attention", "apply", "apply+lora")
PRECISIONS = ("fp32", "bf16")
MASKS = ("none", "right", "left", "holes", "4d")
GRADS = ("grad", "no_grad")
CACHES = ("none", "dynamic", "static")
SPS = (1, 2)
B, S, CHUNK = 2, 40, 16
FP32_TOL = 1e-5
# Floor of the 2x rule, as tests/unit/test_autocast.py: 1% of bf16's rounding step. A loss is one number whose bf16
# error is a sum of signed logit errors: sdpa's cancels to 2e-6 on one batch and fpdt's to 1e-5 on the same
# (both 800x under bf16's eps, gradients within 1.9x); the floor keeps such luck from deciding a cell.
AUTOCAST_FLOOR = 0.01 * torch.finfo(torch.bfloat16).eps
# bf16: the bound on (fpdt's distance to the fp32 reference) / (sdpa's distance + AUTOCAST_FLOOR / 2), per distance.
# Two bf16 paths that round at different points (fpdt's blocks and tiles, or HF's own eager against sdpa) make
# errors of the same size but not the same elements, so the ratio scatters around 1 and its tail is what a bound
# must clear. Measured on this suite's sp 1 bf16 cells (every tensor; an AVX-512 BF16 CPU without AMX, under
# ONEDNN_MAX_CPU_ISA = AVX2, AVX512_CORE, AVX512_CORE_BF16 and ATEN_CPU_CAPABILITY = avx2): fpdt/sdpa median
# 0.97-0.99 on both distances, worst 1.39 (L2; 1.42 under ATEN avx2) and 1.96 (max, LoRA and norm weights of
# 64-256 elements: the max of a few dozen rounding errors is a noisy statistic); HF eager/sdpa on the same
# cells (no 4D or left-padding masks, where eager's empty rows differ): median 0.97-0.99, worst 1.31 (L2) and
# 1.89 (max). fpdt is not systematically further than sdpa (an fp32 block kernel instead of bf16 moved neither
# median nor tail), so the bounds sit above the tail of that spread with margin: 2 on L2 (1.4x the worst), 3
# on max (1.5x the worst; an AMX-BF16 CPU measured 2.02 there, issue 36).
BF16_RATIO = {"l2": 2.0, "max": 3.0}


@dataclass(frozen=True)
class Cell:
    entry: str
    precision: str
    mask: str
    grad: str
    cache: str
    sp: int

    @property
    def id(self) -> str:
        return "-".join(str(v) for v in (self.entry, self.precision, self.mask, self.grad, self.cache, f"sp{self.sp}"))


def _applies(c: Cell) -> bool:
    return c.sp == 1 or (c.entry != "attention" and c.cache == "none" and c.mask != "4d")


CELLS = [Cell(*v) for v in itertools.product(ENTRIES, PRECISIONS, MASKS, GRADS, CACHES, SPS)]
CELLS = [c for c in CELLS if _applies(c)]


def _inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (B, S), generator=g)
    masks: dict[str, torch.Tensor | None] = {"none": None}
    right = torch.ones(B, S, dtype=torch.long)
    right[1, 31:] = 0
    left = torch.ones(B, S, dtype=torch.long)
    left[1, :21] = 0  # more than a chunk: a whole block of padding keys, and padding rows that see no key
    holes = torch.ones(B, S, dtype=torch.long)
    holes[0, 5:12] = 0
    holes[1, 17:19] = 0
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    four = causal[None, None] & left.bool()[:, None, None, :]
    four = four & (torch.rand(B, 1, S, S, generator=g) > 0.2)  # a random cut inside the causal triangle
    masks.update(right=right, left=left, holes=holes, **{"4d": four})
    return ids, masks


def _labels(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    labels = ids.clone()
    if mask is not None and mask.dim() == 2:
        labels[mask == 0] = IGNORE_INDEX
    return labels


@functools.cache
def _base_state() -> dict:
    return tiny_model("tiny-llama", "sdpa", dtype=None).state_dict()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, lora)


def _model(entry: str, fpdt: bool, group=None) -> torch.nn.Module:
    """The cell's model: sdpa (``fpdt=False``) or fpdt, with the same weights (LoRA's too)."""
    model = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None)
    model.load_state_dict(_base_state())
    if entry == "apply+lora":
        model = _lora(model)
    if not fpdt:
        return model
    if entry == "attention":
        model.set_attn_implementation("fpdt")
        return hf_fpdt.configure(model, FPDTConfig(chunk_size=CHUNK, offload=True))
    return hf_fpdt.apply(model, FPDTConfig(chunk_size=CHUNK, offload=True), group=group)


def _cache(kind: str, model: torch.nn.Module):
    config = model.config
    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "static":
        return StaticCache(config=config, max_cache_len=S + 8)
    return None


def _precision(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _run(model: torch.nn.Module, c: Cell, precision: str | None = None, **inputs) -> dict:
    """One call of the cell: logits (where the model returns them), loss, trainable gradients."""
    model.train(c.grad == "grad")
    grad = torch.enable_grad() if c.grad == "grad" else torch.no_grad()
    cache = _cache(c.cache, model)
    extra = {} if cache is None else {"past_key_values": cache, "use_cache": True}
    with grad, _precision(precision or c.precision):
        out = model(**inputs, **extra)
    res = {"loss": out.loss.detach().float()}
    state = state_of(model)
    sp = state.runtime.sp_size if state is not None else 1
    if out.logits is not None and sp == 1:  # under SP a rank's logits are a slice: reading them raises (FPDTTrainer)
        res["logits"] = out.logits.detach().float()
    if c.grad == "grad":
        out.loss.backward()
        res["grads"] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return res


def _flat(res: dict) -> dict[str, torch.Tensor]:
    flat = {k: v for k, v in res.items() if k != "grads"}
    flat.update({f"grad:{n}": g for n, g in res.get("grads", {}).items()})
    return flat


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / (scale if scale > 0 else 1.0)


_DISTANCES = {"l2": _rel_l2, "max": _rel}


def _inputs_of(mask_name: str) -> dict:
    ids, masks = _inputs()
    mask = masks[mask_name]
    inputs = {"input_ids": ids, "labels": _labels(ids, mask)}
    if mask is not None:
        inputs["attention_mask"] = mask
    return inputs


def _call(c: Cell, fpdt: bool, precision: str | None = None):
    try:
        return _run(_model(c.entry, fpdt), c, precision, **_inputs_of(c.mask))
    except Exception as exc:  # compared in errors(): where sdpa raises, fpdt must too
        return exc


def _sdpa(c: Cell, precision: str) -> dict | Exception:
    """sdpa's result for the cell's call at ``precision`` (shared by the sp 1 and sp 2 cells, and by the bf16
    cells as their fp32 reference)."""
    return _sdpa_call(c.entry, precision, c.mask, c.grad, c.cache)


@functools.cache
def _sdpa_call(entry: str, precision: str, mask: str, grad: str, cache: str) -> dict | Exception:
    return _call(Cell(entry, precision, mask, grad, cache, 1), False)


def _one_process(c: Cell) -> dict:
    """``{"sdpa": result | exception, "fpdt": ..., "fp32": the fp32 sdpa reference}``."""
    return {"sdpa": _sdpa(c, c.precision), "fpdt": _call(c, True), "fp32": _sdpa(c, "fp32")}


def _sp_cells(rank: int, world_size: int, cells: list[Cell]) -> dict:
    """Every sp 2 cell on this rank (one gloo launch): the group's loss and gradients summed over the ranks."""
    import torch.distributed as dist

    from hf_fpdt.data.collate import SPCollator

    ids, masks = _inputs()
    results = {}
    for c in cells:
        mask = masks[c.mask]
        batch = {"input_ids": ids, "labels": _labels(ids, mask)}
        if mask is not None:
            batch["attention_mask"] = mask
        shard = SPCollator(rank, world_size, CHUNK, inner=lambda f: f[0])([batch])
        shard["num_items_in_batch"] = (shard["shift_labels"] != IGNORE_INDEX).sum()
        dist.all_reduce(shard["num_items_in_batch"])
        try:
            res = _run(_model(c.entry, True, group=dist.group.WORLD), c, **shard)
            dist.all_reduce(res["loss"])
            for g in res.get("grads", {}).values():
                dist.all_reduce(g)
            res.pop("logits", None)
        except Exception as exc:
            res = exc
        results[c.id] = res
    return results


@functools.cache
def _sp2_results() -> dict:
    from distributed import run_distributed

    cells = [c for c in CELLS if c.sp == 2]
    return run_distributed(_sp_cells, 2, cells, timeout=600)[0]


def _result(c: Cell) -> dict:
    if c.sp == 1:
        return _one_process(c)
    return {"sdpa": _sdpa(c, c.precision), "fpdt": _sp2_results()[c.id], "fp32": _sdpa(c, "fp32")}


def errors(c: Cell, res: dict) -> dict[str, float]:
    """Per compared tensor: the fp32 relative error, or for bf16 the ratio of fpdt's distance to sdpa's (both
    against the fp32 reference) as ``"l2:<name>"`` and ``"max:<name>"`` (``BF16_RATIO``). Raises AssertionError
    where fpdt and sdpa disagree on raising."""
    sdpa, fpdt = res["sdpa"], res["fpdt"]
    if isinstance(sdpa, Exception):
        assert isinstance(fpdt, Exception), f"sdpa raises ({sdpa!r}) but fpdt does not"
        return {}
    if isinstance(fpdt, Exception):
        raise AssertionError(f"fpdt raises where sdpa runs: {fpdt!r}")
    got, want = _flat(fpdt), _flat(sdpa)
    keys = [k for k in want if k in got]
    assert "loss" in keys and (c.grad == "no_grad" or any(k.startswith("grad:") for k in keys))
    if c.precision == "fp32":
        return {k: _rel(got[k], want[k]) for k in keys}
    ref = _flat(res["fp32"])
    out = {}
    for k in keys:
        for name, distance in _DISTANCES.items():
            mine, theirs = distance(got[k], ref[k]), distance(want[k], ref[k])
            out[f"{name}:{k}"] = mine / (theirs + AUTOCAST_FLOOR / 2)  # <= r exactly when mine <= r * theirs + ...
    return out


def bound(c: Cell, key: str) -> float:
    """The bound on :func:`errors`' value ``key`` of cell ``c``."""
    return FP32_TOL if c.precision == "fp32" else BF16_RATIO[key.split(":", 1)[0]]


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id) for c in CELLS])
def test_conformance(cell: Cell):
    errs = errors(cell, _result(cell))
    bad = {k: f"{v:.3g} > {bound(cell, k)}" for k, v in errs.items() if not v <= bound(cell, k)}
    assert not bad, f"{cell.id}: {bad}"


def main(argv: list[str]) -> int:
    """Worst value per column value and overall (fp32: relative error vs sdpa; bf16: fpdt's distance / sdpa's,
    vs fp32, per distance), against its bound; ``argv``: substrings every cell id run must contain (e.g.
    ``bf16 sp1``). Run under each ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` to see the spread. A progress
    bar counts the cells on a terminal."""
    cells = [c for c in CELLS if all(a in c.id for a in argv)]
    worst: dict[tuple[str, str], float] = {}
    top: dict[str, tuple[float, str]] = {}
    failures = []
    from tqdm.auto import tqdm  # comes with transformers; a bar on a terminal only (tqdm's rule: disable=None)

    for c in tqdm(cells, desc="conformance cells", unit="cell", disable=None, leave=False):
        try:
            errs = errors(c, _result(c))
        except AssertionError as exc:
            failures.append(f"{c.id}: {exc}")
            continue
        for k, value in errs.items():
            measure = c.precision if c.precision == "fp32" else f"bf16 {k.split(':', 1)[0]}"
            if value > top.get(measure, (-1.0, ""))[0]:
                top[measure] = (value, f"{c.id} {k}")
            if not value <= bound(c, k):
                failures.append(f"{c.id}: {k} {value:.3g} > {bound(c, k)}")
            columns = (("entry", c.entry), ("mask", c.mask), ("grad", c.grad), ("cache", c.cache), ("sp", c.sp))
            for column, v in columns:
                key = (measure, f"{column}={v}")
                worst[key] = max(worst.get(key, 0.0), value)
    print(f"{len(cells)} cells ({sum(c.sp == 2 for c in cells)} at sp 2)")
    for measure, (value, where) in top.items():
        limit = FP32_TOL if measure == "fp32" else BF16_RATIO[measure.split()[1]]
        what = "relative error vs sdpa" if measure == "fp32" else "fpdt distance / sdpa distance, vs fp32"
        print(f"{measure}: worst {what} {value:.3g} (bound {limit:g}) at {where}")
        for (m, column), v in worst.items():
            if m == measure:
                print(f"  {column:22s} {v:.3g}")
    print(f"{len(failures)} failed")
    for f in failures:
        print("  " + f[:300])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
