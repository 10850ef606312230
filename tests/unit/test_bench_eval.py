"""``python -m hf_fpdt.bench eval``: passkey prompts, the accuracy grid, the heat map, perplexity.

The tiny random models retrieve nothing, so the grid logic is checked with a stand-in model that
reads the key out of its prompt (right at some depths, wrong at others); the CLI runs the real tiny
model end to end, and its perplexity must equal plain HF's on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

from hf_fpdt.bench import eval as bench_eval
from hf_fpdt.data.demo import word_tokenizer


def test_passkey_prompt_length_depth_and_answer():
    tok = word_tokenizer()
    rng = random.Random(0)
    positions = {}
    for depth in (0.0, 0.5, 1.0):
        ids, key = bench_eval.passkey_prompt(tok, 300, depth, rng)
        assert len(ids) == 300 and len(key) == 5
        text = tok.decode(ids)
        assert text.replace(" ", "").endswith("Whatisthepasskey?Thepasskeyis")
        assert " ".join(key) in text  # the word tokenizer spells digits one by one
        positions[depth] = text.index(" ".join(key)) / len(text)
    assert positions[0.0] < 0.2 < positions[0.5] < 0.7 < positions[1.0]
    with pytest.raises(ValueError, match="raise the length"):
        bench_eval.passkey_prompt(tok, 20, 0.5, rng)
    assert bench_eval.answered(" 7 1 4 3 2 . Remember", "71432")
    assert bench_eval.answered("71432", "71432") and not bench_eval.answered(" 7 1 4 3 3", "71432")
    assert not bench_eval.answered(" the", "71432")


class KeyReader(nn.Module):
    """Answers with the digits after the first "key is" of its prompt, except when the key sits in the first
    half of the prompt (then it answers 00000): accuracy 1 at deep keys, 0 at shallow ones."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok = tokenizer
        self.weight = nn.Parameter(torch.zeros(1))

    def generate(self, ids, max_new_tokens, **kwargs):
        rows = []
        for row in ids.tolist():
            text = self.tok.decode(row).split(" ")
            at = next(i for i in range(len(text)) if text[i - 1 : i + 1] == ["key", "is"])  # "pass key is 7 1 ..."
            key = text[at + 1 : at + 6] if at > len(text) / 2 else ["0"] * 5
            rows.append(row + self.tok.convert_tokens_to_ids(key) + [self.tok.eos_token_id] * (max_new_tokens - 5))
        return torch.tensor(rows)


def test_accuracy_grid_and_heatmap(tmp_path):
    tok = word_tokenizer()
    model = KeyReader(tok)
    result = bench_eval.retrieval_accuracy(model, tok, [200, 400], [0.0, 0.3, 1.0], samples=3, batch_size=2)
    for n in (200, 400):
        assert result.accuracy[n, 0.0] == 0.0 and result.accuracy[n, 1.0] == 1.0
        assert result.mean(n) == pytest.approx(result.accuracy[n, 0.3] / 3 + 1 / 3)
    assert model.training  # the mode the caller left it in
    table = result.table().splitlines()
    assert table[0].split() == ["depth", "200", "400"] and table[-3].split()[0] == "1.00"
    assert table[-3].split()[1:] == ["100%", "100%"] and table[-2].split()[0] == "mean"
    path = bench_eval.heatmap(result, str(tmp_path / "sub" / "map.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


ARGS = ["--lengths", "100,180", "--depths", "0,1", "--samples", "2", "--chunk-size", "32", "--device", "cpu"]


@pytest.mark.multiprocess
def test_cli_tables_heatmap_and_perplexity_against_sdpa(tmp_path):
    text = tmp_path / "text.txt"
    words = "the grass is green . the sky is blue . here we go . there and back again .".split()
    rng = random.Random(0)
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(30)))
    png, out = tmp_path / "map.png", tmp_path / "fpdt.json"
    ppl = ["--dataset", str(text), "--ppl-samples", "2"]
    cmd = [sys.executable, "-m", "hf_fpdt.bench", "eval", *ARGS, *ppl, "--heatmap", str(png), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    assert "passkey retrieval accuracy" in res.stdout and "perplexity" in res.stdout
    fpdt = json.loads(out.read_text())
    assert set(fpdt["accuracy"]) == {"100/0.0", "100/1.0", "180/0.0", "180/1.0"}
    assert all(0.0 <= a <= 1.0 for a in fpdt["accuracy"].values())
    assert png.read_bytes()[:4] == b"\x89PNG" and fpdt["heatmap"] == str(png)

    parser = argparse.ArgumentParser()  # the same weights on plain HF, in this process
    bench_eval.add_arguments(parser)
    argv = [*ARGS, *ppl, "--attn", "sdpa", "--no-heatmap", "--json", str(tmp_path / "sdpa.json")]
    assert bench_eval.run(parser.parse_args(argv)) == 0
    sdpa = json.loads((tmp_path / "sdpa.json").read_text())
    assert "heatmap" not in sdpa
    for n, value in fpdt["perplexity"].items():
        assert 1.0 < value < 1e4 and abs(value - sdpa["perplexity"][n]) < 1e-4 * value


def test_default_heat_map_is_named_after_its_run(tmp_path):
    """Another run (seed, lengths, depths, samples, attention, adapter, SP size) writes beside a heat map, not over
    it (issue 37: a 3x5 map was replaced by the next run's 2x2); the name stays under out/ (ignored by git)."""
    parser = argparse.ArgumentParser()
    bench_eval.add_arguments(parser)
    base = parser.parse_args([])
    assert base.heatmap is None
    path = bench_eval.default_heatmap(base)
    assert path.startswith(os.path.join("out", "eval", "passkey_tiny-llama_fpdt_256-512-1024_")), path
    others = [["--seed", "1"], ["--lengths", "256,512"], ["--depths", "0,1"], ["--samples", "2"], ["--attn", "sdpa"]]
    from hf_fpdt.models.presets import preset_config

    preset_config("tiny-llama").save_pretrained(tmp_path / "my-model")  # --model is read when parsed: a real folder
    others += [["--adapter", "out/finetune_lora/fpdt_sp2_np2"], ["--model", str(tmp_path / "my-model")]]
    names = {path, bench_eval.default_heatmap(base, sp_size=2)}
    names |= {bench_eval.default_heatmap(parser.parse_args(argv)) for argv in others}
    assert len(names) == len(others) + 2, names


def test_progress_in_a_log_is_a_line_per_generate_call(capsys, monkeypatch):
    """Where stdout is not a terminal (a log, CI) the bar is not seen: every ``generate`` call is a line."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    tok = word_tokenizer()
    bench_eval.retrieval_accuracy(KeyReader(tok), tok, [200], [0.0, 1.0], samples=3, batch_size=2, progress=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# passkey retrieval")]
    assert [line.split("]")[0] for line in lines] == [f"# passkey retrieval [{k}/4" for k in range(1, 5)]
    assert "length 200, depth 1: 2/2 found" in lines[2] and "length 200, depth 1: 1/1 found" in lines[3]
    bench_eval.retrieval_accuracy(KeyReader(tok), tok, [200], [1.0], samples=1)  # progress off: silent
    assert capsys.readouterr().out == ""
