"""``generate()`` under sequence parallelism (:mod:`hf_fpdt.integrations.sp_generation`), 2 ranks over gloo.

Greedy tokens and every step's scores equal one-process ``sdpa`` on the same weights (fp32, tiny Llama and GPT-NeoX, a
prompt of 45 tokens that no chunk of 16 divides, batch 2 with left padding), also with HF's chunked prefill; also when
rank 1 computes other logits than rank 0 (the group decodes SP rank 0's tokens). The prefill ran sequence-parallel:
each rank's cache holds its share of the prompt (23 of 45 tokens) plus the decoded tokens. A prefill's peak memory per
rank (allocations the profiler records during ``generate`` with one new token: activations, attention working set and
the cache) is smaller under SP than on one process. ``python -m hf_fpdt.bench eval --sp`` runs on the group (rank 0
prints) with sdpa's accuracy grid and perplexity.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import random

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from testkit import rel_err, tiny_model
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.bench import eval as bench_eval

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CHUNK, PROMPT, PAD, NEW = 16, 45, 7, 8
CASES = (("tiny-llama", {}), ("tiny-llama", {"prefill_chunk_size": 13}), ("tiny-neox", {}))


def _prompts(length: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 500, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :PAD] = 0  # left padding
        ids[1, :PAD] = 0
    return ids, mask


def _generate(model, ids, mask, new, do_sample=False, **kwargs):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=do_sample,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def prefill_peak_bytes(model, ids, mask) -> int:
    """Peak of the bytes allocated (net of frees) during ``generate`` with one new token: the prefill."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _generate(model, ids, mask, 1)
    events = (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


EVAL = ["--lengths", "100,180", "--depths", "0,1", "--samples", "2", "--chunk-size", "32", "--device", "cpu"]


def _eval(argv: list[str]) -> str:
    parser = argparse.ArgumentParser()
    bench_eval.add_arguments(parser)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert bench_eval.run(parser.parse_args(argv)) == 0
    return out.getvalue()


def _worker(rank: int, world_size: int, memory_prompt: int, eval_argv: list[str]) -> dict:
    results = {"eval": _eval(eval_argv)}  # python -m hf_fpdt.bench eval --sp
    for preset, kwargs in CASES:
        ref = tiny_model(preset, "sdpa", dtype=None).float().eval()
        model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=CHUNK), group=dist.group.WORLD)
        ids, mask = _prompts(PROMPT)
        want = _generate(ref, ids, mask, NEW, **kwargs)
        got = _generate(model, ids, mask, NEW, **kwargs)
        results[preset, tuple(kwargs)] = {
            "equal": torch.equal(got.sequences, want.sequences),
            "scores": rel_err(torch.stack(got.scores), torch.stack(want.scores)),
            "cached": got.past_key_values.layers[0].keys.shape[-2],
        }
    # rank 1 computes other logits than rank 0 (a hook on the LM head; the extreme of ranks that differ in the last
    # bit): the group still decodes SP rank 0's tokens, equal to one process, greedy and sampled
    ref = tiny_model("tiny-llama", "sdpa", dtype=None).float().eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=CHUNK), group=dist.group.WORLD)
    if rank == 1:
        model.lm_head.register_forward_hook(lambda m, args, out: out.flip(-1))  # no random draw
    ids, mask = _prompts(PROMPT)
    same = {}
    for sample in (False, True):
        torch.manual_seed(5)
        want = _generate(ref, ids, mask, NEW, do_sample=sample).sequences
        torch.manual_seed(5)
        same[sample] = torch.equal(_generate(model, ids, mask, NEW, do_sample=sample).sequences, want)
    results["rank 1 perturbed"] = same
    torch.manual_seed(0)  # a prefill called directly: every position's logits, left padding's included
    ref = tiny_model("tiny-llama", "sdpa", dtype=None, seed=None).float().eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=CHUNK), group=dist.group.WORLD)
    ids, mask = _prompts(PROMPT)
    mask[1, : CHUNK + PAD] = 0  # row 1: a whole chunk and more of padding; row 0 none
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True).logits
        got = model(ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=0)
    results["prefill logits"] = rel_err(got.logits, want)
    try:  # ranks called with prompts of different lengths: a ValueError on every rank, no hang
        _generate(model, *_prompts(PROMPT + rank, batch=1), 1)
    except ValueError as err:
        results["disagree"] = str(err)
    ref = tiny_model("tiny-llama", "sdpa", dtype=None).float().eval()
    ids, mask = _prompts(memory_prompt, batch=1)
    one = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=128))
    sp = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=128), group=dist.group.WORLD)
    results["memory"] = {"one process": prefill_peak_bytes(one, ids, mask), "sp": prefill_peak_bytes(sp, ids, mask)}
    return results


def test_sp_generation_matches_sdpa_and_shards_the_prefill(tmp_path):
    text = tmp_path / "text.txt"
    words = "the grass is green . the sky is blue . here we go . there and back again .".split()
    rng = random.Random(0)
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(30)))
    common = [*EVAL, "--dataset", str(text), "--ppl-samples", "2", "--no-heatmap"]
    ranks = run_distributed(_worker, 2, 2048, [*common, "--sp", "--json", str(tmp_path / "sp.json")])
    assert "passkey retrieval accuracy" in ranks[0]["eval"] and "sp=2" in ranks[0]["eval"]
    assert ranks[1]["eval"] == ""  # rank 0 prints
    _eval([*common, "--attn", "sdpa", "--json", str(tmp_path / "sdpa.json")])  # one process, plain HF
    sp, sdpa = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("sp", "sdpa"))
    assert sp["accuracy"] == sdpa["accuracy"]
    for n, value in sdpa["perplexity"].items():
        assert abs(sp["perplexity"][n] - value) < 1e-4 * value
    for results in ranks:
        for preset, kwargs in CASES:
            r = results[preset, tuple(kwargs)]
            assert r["equal"] and r["scores"] < 1e-5, (preset, kwargs, r)
            # the cache holds this rank's share of the prompt (23 of 45; 7 of a first prefill chunk of 13,
            # the later chunks replicated) and the decoded tokens (counted on one rank only)
            first = kwargs.get("prefill_chunk_size", PROMPT)
            assert r["cached"] == -(-first // 2) + (PROMPT - first) + NEW - 1, (preset, kwargs, r)
        assert "rank 0 has 45, rank 1 has 46" in results.get("disagree", ""), results.get("disagree")
        assert results["prefill logits"] < 1e-5, results["prefill logits"]  # pad positions equal sdpa's too
        assert results["rank 1 perturbed"] == {False: True, True: True}, results["rank 1 perturbed"]
        memory = results["memory"]
        assert memory["sp"] < 0.7 * memory["one process"], memory
