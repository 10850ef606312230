"""Local long-context data (:mod:`hf_fpdt.data.demo`): the word tokenizer, passkey samples, packed text files."""

from __future__ import annotations

import pytest
from testkit import SCRATCH

from hf_fpdt.data.demo import IGNORE_INDEX, passkey_dataset, passkey_sample, text_dataset, word_tokenizer


def test_word_tokenizer_round_trip() -> None:
    tok = word_tokenizer()
    text = "The pass key is 7 1 4 3 2 . Remember it ."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok("12", add_special_tokens=False)["input_ids"] == tok("1 2", add_special_tokens=False)["input_ids"]
    assert len(tok) < 512  # fits the tiny presets' vocabulary


def test_passkey_rows_are_deterministic_and_right_padded() -> None:
    tok = word_tokenizer()
    a = passkey_dataset(tok, 6, 300, seed=3, min_fill=0.5, progress=False)
    b = passkey_dataset(tok, 6, 300, seed=3, min_fill=0.5, progress=False)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
    counts = set()
    for ids, labels in zip(a["input_ids"], a["labels"]):
        assert len(ids) == len(labels) == 300
        n = sum(label != IGNORE_INDEX for label in labels)
        counts.add(n)
        assert labels[:n] == ids[:n] and all(label == IGNORE_INDEX for label in labels[n:])  # padding at the end
        assert all(i == tok.pad_token_id for i in ids[n:])
        assert ids[0] == tok.bos_token_id and ids[n - 1] == tok.eos_token_id
    assert len(counts) > 1  # documents differ in length, so rows differ in target counts


def test_passkey_answer_is_the_hidden_key() -> None:
    import random

    tok = word_tokenizer()
    row = passkey_sample(tok, 400, random.Random(0), answer_only=True)
    answer = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    key = tok.decode(answer[:-1]).replace(" ", "")  # digits, then EOS
    assert len(key) == 5 and key.isdigit()
    text = tok.decode(row["input_ids"]).replace(" ", "")
    assert f"Thepasskeyis{key}.Rememberit.{key}isthepasskey." in text
    with pytest.raises(ValueError, match="raise seq_len"):
        passkey_sample(tok, 40, random.Random(0))


def test_text_file_is_packed_into_blocks(tmp_path) -> None:
    tok = word_tokenizer()
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(["The sky is blue . Here we go ."] * 20))
    ds = text_dataset(str(path), tok, 32)
    assert ds.cache_files and all(f["filename"].startswith(SCRATCH) for f in ds.cache_files)  # testkit.SCRATCH
    assert len(ds) == (20 * (9 + 1)) // 32  # 9 words + EOS per line
    assert all(len(r) == 32 for r in ds["input_ids"]) and ds["labels"] == ds["input_ids"]
    with pytest.raises(ValueError, match="must end in one of"):
        bad = tmp_path / "docs.xyz"
        bad.write_text("x")
        text_dataset(str(bad), tok, 32)
