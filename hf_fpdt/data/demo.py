"""Long-context training data made locally: passkey retrieval in filler text, or any text dataset in blocks.

Nothing here downloads anything. :func:`word_tokenizer` builds a small word-level tokenizer in memory
(a real :class:`~transformers.PreTrainedTokenizerFast`, so it saves next to an adapter), and
:func:`passkey_dataset` writes samples in the style of the passkey retrieval task (Mohtashami & Jaggi,
2023): a number hidden at a random depth of long, repetitive filler text, asked for at the end::

    <bos> There is an important info hidden inside a lot of irrelevant text ... filler ...
    The pass key is 7 1 4 3 2 . Remember it . 7 1 4 3 2 is the pass key . ... filler ...
    What is the pass key ? The pass key is 7 1 4 3 2 <eos> <pad> <pad> ...

Every row has exactly ``seq_len`` tokens: the document takes a random share of them (so rows differ in
their number of target tokens, which makes token-count bugs visible) and the rest is right padding
with label -100. Rows are ready for ``transformers.default_data_collator``; under sequence parallelism
the FPDT collator (:class:`hf_fpdt.data.collate.SPCollator`) shards them. Demo data only: the training path
(collator, plugin, trainer) never imports this module or ``datasets``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..config import IGNORE_INDEX

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
SPECIAL_TOKENS = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


def word_tokenizer(extra_text: str = "") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the passkey texts (plus the words of ``extra_text``), built in memory.

    Words, punctuation marks and single digits are tokens; anything else maps to ``<unk>``. The vocabulary
    is small (about 50 entries), so it fits every preset model's embedding.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    words: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    corpus = " ".join([INTRO, FILLER, KEY.format(key="0123456789"), QUESTION, extra_text])
    for word, _ in pre.pre_tokenize_str(corpus):
        words.setdefault(word, len(words))
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="right", **SPECIAL_TOKENS)


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tid is not None:
            return tid
    return 0


def passkey_sample(
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    rng: random.Random,
    doc_len: int | None = None,
    answer_only: bool = False,
) -> dict[str, list[int]]:
    """One row: ``input_ids`` and ``labels`` of exactly ``seq_len`` tokens (document, then right padding).

    Args:
        tokenizer: any HF tokenizer (its BOS/EOS are used when it has them).
        seq_len: tokens per row.
        rng: the random source (passkey, its depth, and the document length when ``doc_len`` is None).
        doc_len: tokens of the document (the rest is padding); default: the whole row.
        answer_only: labels only on the passkey answer at the end; otherwise on every document token.
    """
    doc_len = seq_len if doc_len is None else doc_len
    if not 1 <= doc_len <= seq_len:
        raise ValueError(f"doc_len={doc_len} must lie in [1, seq_len={seq_len}]")
    key = str(rng.randint(10000, 99999))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    head = bos + _ids(tokenizer, INTRO)
    key_ids = _ids(tokenizer, KEY.format(key=key))
    question = _ids(tokenizer, QUESTION)
    answer = _ids(tokenizer, " " + key) + eos
    fill = doc_len - len(head) - len(key_ids) - len(question) - len(answer)
    if fill < 0:
        raise ValueError(
            f"a passkey document needs at least {doc_len - fill} tokens with this tokenizer; raise seq_len "
            f"(got a document of {doc_len})"
        )
    filler = _ids(tokenizer, FILLER)
    filler = (filler * (fill // len(filler) + 1))[:fill]
    depth = rng.randint(0, fill)
    doc = head + filler[:depth] + key_ids + filler[depth:] + question + answer
    pad = seq_len - len(doc)
    labels = [IGNORE_INDEX] * (len(doc) - len(answer)) + answer if answer_only else list(doc)
    return {
        "input_ids": doc + [_pad_id(tokenizer)] * pad,
        "labels": labels + [IGNORE_INDEX] * pad,
    }


def passkey_dataset(
    tokenizer: PreTrainedTokenizerBase,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    min_fill: float = 0.75,
    answer_only: bool = False,
    progress: bool = True,
) -> datasets.Dataset:
    """``num_samples`` passkey rows of ``seq_len`` tokens each (documents fill ``[min_fill, 1]`` of a row).

    Deterministic in ``seed``: every process of a launch builds the same dataset.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: need at least one sample")
    if not 0.0 < min_fill <= 1.0:
        raise ValueError(f"min_fill={min_fill}: use a fraction in (0, 1]")
    rng = random.Random(seed)
    rows: dict[str, list] = {"input_ids": [], "labels": []}
    for _ in tqdm(range(num_samples), desc="passkey samples", disable=not progress, leave=False):
        doc_len = rng.randint(math.ceil(min_fill * seq_len), seq_len)
        row = passkey_sample(tokenizer, seq_len, rng, doc_len=doc_len, answer_only=answer_only)
        for k, v in row.items():
            rows[k].append(v)
    return datasets.Dataset.from_dict(rows)


_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _load(name: str, split: str) -> datasets.Dataset:
    path = Path(name)
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(f"{name}: a data file must end in one of {sorted(_FILE_BUILDERS)}")
        return datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), split=split)
    return datasets.load_dataset(name, split=split)


def text_dataset(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    split: str = "train",
    text_column: str = "text",
    num_samples: int | None = None,
) -> datasets.Dataset:
    """A text dataset packed into ``seq_len`` blocks.

    ``name`` is anything ``datasets.load_dataset`` takes (hub name, local folder), or one data file
    (``.txt`` lines, ``.json``/``.jsonl``, ``.csv``, ``.parquet``).

    Documents are tokenized, joined with EOS and cut into rows of ``seq_len`` tokens; labels are the
    input ids (causal LM). A dataset that already has ``input_ids`` is only packed.
    """
    raw = _load(name, split)
    if "input_ids" not in raw.column_names:
        if text_column not in raw.column_names:
            raise ValueError(f"dataset {name!r} has no {text_column!r} column (columns: {raw.column_names})")
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        raw = raw.map(
            lambda batch: {"input_ids": [_ids(tokenizer, t) + eos for t in batch[text_column]]},
            batched=True,
            remove_columns=raw.column_names,
            desc="tokenize",
        )

    def pack(batch: dict) -> dict:
        flat = [t for ids in batch["input_ids"] for t in ids]
        blocks = [flat[i : i + seq_len] for i in range(0, len(flat) - seq_len + 1, seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    packed = raw.map(pack, batched=True, batch_size=1000, remove_columns=raw.column_names, desc="pack")
    if len(packed) == 0:
        raise ValueError(f"dataset {name!r} has fewer than seq_len={seq_len} tokens in a batch of documents")
    if num_samples is not None:
        packed = packed.select(range(min(num_samples, len(packed))))
    return packed
