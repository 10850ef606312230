"""TRL ``DPOTrainer``/``KTOTrainer`` runs shared by ``tests/integration/test_trl_dpo.py``: the one-process baseline
(in the test's process, sdpa) and ``FPDTDPOTrainer``/``FPDTKTOTrainer`` (launched by ``accelerate launch``).

Launched: ``dpo_loop.py CHECKPOINT OUT_DIR SP_SIZE CASE[,CASE...]`` (``SP_SIZE`` 0: TRL's trainer with sdpa under
DDP, the baseline of data-parallel runs); rank 0 writes ``OUT_DIR/<case>.pt`` with the
run's :func:`dpo_run` result for every case (one launch, several cases: a process start costs more than a run).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from pathlib import Path

import datasets
import torch
from loop_common import TRAINING, finish, on_rank0
from testkit import tiny_model

PROMPT, COMPLETION = (100, 160), (40, 110)  # token ranges: pairs of 140-270 tokens, several chunks of 64
CHUNK = 64
# every loss type of TRL 1.16's DPOTrainer (each a function of per-sequence sums or per-token fields)
ALL_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
# case -> (trainer, model setup, DPOConfig/KTOConfig fields)
CASES: dict[str, tuple[str, str, dict]] = {
    "sigmoid": ("dpo", "full", {"loss_type": ["sigmoid"]}),  # the reference loaded again from the checkpoint
    "ipo_ref": ("dpo", "full_ref", {"loss_type": ["ipo"], "ld_alpha": 0.5, "use_weighting": True}),  # a ref_model
    "hinge_lora": ("dpo", "lora", {"loss_type": ["hinge"]}),  # the adapter disabled: the reference
    "rpo_lora": ("dpo", "lora", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    "precompute": ("dpo", "full", {"loss_type": ["sigmoid"], "precompute_ref_log_probs": True}),
    "all_losses": ("dpo", "full_ref", {"loss_type": list(ALL_LOSSES), "label_smoothing": 0.1}),  # summed
    "kto_lora": ("kto", "lora", {}),
    "kto_full": ("kto", "full_ref", {}),
}


def words() -> list[str]:
    """The word tokenizer's words (every one a single token)."""
    from hf_fpdt.data.demo import word_tokenizer

    vocab = word_tokenizer().get_vocab()
    return sorted(w for w in vocab if w.isalpha())


def preference_data(n: int = 8) -> datasets.Dataset:
    """``n`` text pairs (prompt, chosen, rejected) of random words; completions of different lengths."""
    rng, vocab = random.Random(0), words()

    def text(lo: int, hi: int) -> str:
        return " " + " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": text(*PROMPT), "chosen": text(*COMPLETION), "rejected": text(*COMPLETION)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def kto_data(n: int = 8) -> datasets.Dataset:
    """``n`` unpaired rows (prompt, completion, label), half desirable."""
    pairs = preference_data(n)
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen"] if i % 2 == 0 else r["rejected"], "label": i % 2 == 0}
        for i, r in enumerate(pairs)
    ]
    return datasets.Dataset.from_list(rows)


@functools.cache
def tiny_checkpoint(folder: str) -> str:
    """The tiny Llama the runs start from, saved once per process under ``folder`` (TRL loads the reference from
    its path); its path."""
    path = str(Path(folder) / "tiny_llama")
    tiny_model("tiny-llama", "sdpa", dtype=None).save_pretrained(path)
    return path


def dpo_run(
    case: str,
    checkpoint: str,
    output_dir: str,
    fpdt=None,
    *,
    dp: int = 1,
    bf16: bool = False,
    steps: int = 2,
) -> dict:
    """One run: ``{"logs": [each step's logged dict], "delta": {param: final - initial}`` of the trained
    parameters, ``"history": the whole log_history}``. ``fpdt``: an ``FPDTPlugin`` (the FPDT trainer) or None
    (TRL's trainer, sdpa, one process with the global batch of ``dp`` replicas)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer

    kind, setup, fields = CASES[case]
    load = dict(attn_implementation="sdpa", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **load)
    kwargs: dict = {}
    if setup == "full_ref":
        kwargs["ref_model"] = AutoModelForCausalLM.from_pretrained(checkpoint, **load)
    if setup == "lora":
        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    batch = 2 * (1 if fpdt is not None else dp)
    config_cls = DPOConfig if kind == "dpo" else KTOConfig
    args = config_cls(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        train_sampling_strategy="sequential",  # the same samples per step in one process and under DP
        beta=0.5,
        learning_rate=0.1 if setup == "lora" else 0.01,  # the second step depends on the first step's gradients
        **TRAINING,
        bf16=bf16,
        gradient_checkpointing=False,
        max_length=None,
        dataset_num_proc=None,
        **fields,
    )
    common = dict(model=model, args=args, processing_class=word_tokenizer(), **kwargs)
    data = preference_data() if kind == "dpo" else kto_data()
    if args.precompute_ref_log_probs:  # TRL caches the log-probs next to the dataset: one folder for every rank
        from accelerate import PartialState

        folder = Path(output_dir) / "data"
        with PartialState().main_process_first():
            if not folder.exists():
                data.save_to_disk(str(folder))
        data = datasets.load_from_disk(str(folder))
    common["train_dataset"] = data
    if fpdt is None:
        trainer = (DPOTrainer if kind == "dpo" else KTOTrainer)(**common)
    else:
        trainer = (hf_fpdt.FPDTDPOTrainer if kind == "dpo" else hf_fpdt.FPDTKTOTrainer)(**common, fpdt=fpdt)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    before = {n: p.detach().clone() for n, p in unwrapped.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    delta = {n: (after[n].detach() - p).float() for n, p in before.items()}
    return {"logs": logs, "delta": delta, "history": trainer.state.log_history}


def main(checkpoint: str, out_dir: str, sp_size: int, cases: str) -> None:
    import hf_fpdt

    for case in cases.split(","):
        bf16 = case.endswith("@bf16")
        name = case.removesuffix("@bf16")
        # SP_SIZE 0: TRL's own trainer with sdpa on the launched processes (DDP), the baseline of DP runs
        # the ranks of a group run their chunked pieces on different thread counts (issue 43)
        threads = 1 + int(os.environ.get("RANK", "0")) % 2
        fpdt = hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=CHUNK, cpu_threads=threads) if sp_size else None
        result = dpo_run(name, checkpoint, str(Path(out_dir) / f"run_{case}"), fpdt, bf16=bf16)
        on_rank0(lambda: torch.save(result, Path(out_dir) / f"{case}.pt"))  # noqa: B023 (called at once)
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
