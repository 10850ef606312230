"""Which group every ``torch.distributed`` collective of a GRPO and a DPO run goes over, by phase (launched by
``tests/integration/test_collective_groups.py``).

``collective_groups.py OUT_JSON SP_SIZE``: every collective of ``torch.distributed`` is wrapped (its group's ranks,
the op, the phase the trainer is in, and who called it: the innermost frame of TRL, transformers or hf_fpdt past
the collective plumbing), then ``FPDTGRPOTrainer`` trains a step with an evaluation and ``FPDTDPOTrainer`` trains a
step with the reference precomputed and an evaluation. Each rank writes ``OUT_JSON.<rank>``: the calls counted by
``phase / caller / function / op / kind`` (``kind``: ``world``, ``sp``, ``dp`` or the ranks of another group) and the
violations of :data:`MUST` (see :func:`violations`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
       "broadcast_object_list", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
       "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier",
       "send", "recv", "isend", "irecv", "batch_isend_irecv")  # fmt: skip
# the trainer's methods that open a phase (the innermost one counts); everything else: "setup" in __init__, else
# "loop" (Trainer's own bookkeeping: the logged loss' mean of equal copies, total_flos of each rank's share)
PHASES = {
    "_generate": "rollout",
    "_generate_and_score_completions": "scoring",
    "_calculate_rewards": "scoring",
    "_precompute_ref_logps": "reference",
    "compute_loss": "loss",
    "log": "metrics",
    "evaluate": "evaluation",
}
CONSTRAINED = ("rollout", "scoring", "reference", "loss", "metrics", "evaluation")
# the group a collective must run over, by who called it: TRL's and Trainer's gathers over the DP group (one copy per
# SP group), hf_fpdt's sequence exchange and agreement over the SP group
MUST = {"trl": "dp", "transformers": "dp", "hf_fpdt": "sp"}
# world-wide by design: TRL's reference cache is one file for every rank (its name broadcast from world rank 0,
# written by world rank 0 behind a world barrier)
WORLD_BY_DESIGN = {
    ("trl", "_precompute_ref_logps", "broadcast_object_list"),
    ("trl", "_precompute_ref_logps", "barrier"),
}
# frames that only carry a collective (not who wants it)
_PLUMBING = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}accelerate{os.sep}",
    f"{os.sep}contextlib.py",
    f"{os.sep}functools.py",
    f"hf_fpdt{os.sep}distributed{os.sep}peers.py",
    f"hf_fpdt{os.sep}trainers{os.sep}dp_seam.py",
    __file__,
)
_LIBRARIES = (("trl", f"{os.sep}trl{os.sep}"), ("transformers", f"{os.sep}transformers{os.sep}"),
              ("hf_fpdt", f"{os.sep}hf_fpdt{os.sep}"))  # fmt: skip


class Recorder:
    """Wraps ``torch.distributed``'s collectives; keeps ``(phases, caller, function, op, group)`` per call (``phases``:
    the open phases, outermost first, joined by ``>``; the innermost one decides)."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.calls: list[tuple[str, str, str, str, object]] = []
        for op in OPS:
            if hasattr(dist, op):
                setattr(dist, op, self._wrap(op, getattr(dist, op)))

    def _wrap(self, op: str, fn):
        signature = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            caller, function = self.caller(sys._getframe(1))
            self.calls.append((">".join(self.phases) or "outside", caller, function, op, group))
            return fn(*args, **kwargs)

        return wrapped

    @staticmethod
    def caller(frame) -> tuple[str, str]:
        """The innermost frame past the plumbing: ``(library, function)``."""
        while frame is not None:
            path = frame.f_code.co_filename
            if not any(p in path for p in _PLUMBING):
                for library, marker in _LIBRARIES:
                    if marker in path:
                        return library, frame.f_code.co_name
                return "other", frame.f_code.co_name
            frame = frame.f_back
        return "other", "?"

    @contextlib.contextmanager
    def phase(self, name: str):
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()

    def phased(self, cls: type) -> type:
        """``cls`` with each method of :data:`PHASES` it has opening its phase."""
        recorder, namespace = self, {}

        def method(name: str, phase: str):
            def run(self, *args, **kwargs):
                with recorder.phase(phase):
                    return getattr(super(sub, self), name)(*args, **kwargs)

            return run

        for name, phase in PHASES.items():
            if hasattr(cls, name):
                namespace[name] = method(name, phase)
        sub = type(cls.__name__, (cls,), namespace)
        return sub

    def take(self, groups) -> list[tuple[str, str, str, str, str, list[int]]]:
        """The calls so far as ``(phase, caller, function, op, kind, ranks)`` (``groups``: the run's mesh)."""
        out = []
        for phase, caller, function, op, group in self.calls:
            if group is None or group is dist.group.WORLD:
                kind, ranks = "world", list(range(dist.get_world_size()))
            else:
                ranks = dist.get_process_group_ranks(group)
                kind = "sp" if group is groups.sp else "dp" if group is groups.dp else f"other{ranks}"
            out.append((phase, caller, function, op, kind, ranks))
        self.calls = []
        return out


def violations(calls: list, run: str) -> list[str]:
    """The calls of a constrained phase that ran over a group other than the one they must (:data:`MUST`)."""
    found = []
    for phase, caller, function, op, kind, ranks in calls:
        inner = phase.split(">")[-1]
        if inner not in CONSTRAINED or caller not in MUST:
            continue
        must = "world" if (caller, function, op) in WORLD_BY_DESIGN else MUST[caller]
        if kind != must:
            found.append(
                f"{run}: {op} in phase {inner} ({phase}), called by {caller}'s {function}, ran over the {kind} group "
                f"(ranks {ranks}); it must run over the {must} group"
            )
    return sorted(set(found))


def grpo(recorder: Recorder, sp_size: int, out: Path) -> list:
    import grpo_loop
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    import hf_fpdt

    path = grpo_loop.model_dir(out.parent)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    args = grpo_loop.config("lora_eval", str(out.parent / "grpo"), steps=1)
    cls = recorder.phased(hf_fpdt.FPDTGRPOTrainer)
    with recorder.phase("setup"):
        trainer = cls(
            model=model,
            reward_funcs=grpo_loop.count_reward,
            args=args,
            train_dataset=grpo_loop.prompts(),
            eval_dataset=grpo_loop.prompts().select(range(2)),
            processing_class=grpo_loop.tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            fpdt=hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=grpo_loop.CHUNK),
        )
    with recorder.phase("loop"):
        trainer.train()
    return recorder.take(trainer.fpdt.groups)


def dpo(recorder: Recorder, sp_size: int, out: Path) -> list:
    import datasets
    import dpo_loop
    from accelerate import PartialState
    from loop_common import TRAINING
    from trl import DPOConfig

    import hf_fpdt
    from hf_fpdt.data.demo import word_tokenizer

    folder = out.parent / "dpo_data"
    with PartialState().main_process_first():  # TRL caches the reference log-probs beside the dataset: one folder
        if not folder.exists():
            dpo_loop.preference_data().save_to_disk(str(folder))
    data = datasets.load_from_disk(str(folder))
    import grpo_loop
    from transformers import AutoModelForCausalLM

    checkpoint = grpo_loop.model_dir(out.parent)  # the tiny Llama of the word tokenizer, saved once
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float32)
    args = DPOConfig(
        output_dir=str(out.parent / "dpo"),
        max_steps=1,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        beta=0.5,
        learning_rate=0.01,
        **TRAINING,
        gradient_checkpointing=False,
        max_length=None,
        dataset_num_proc=None,
        precompute_ref_log_probs=True,
        eval_strategy="steps",
        eval_steps=1,
    )
    cls = recorder.phased(hf_fpdt.FPDTDPOTrainer)
    with recorder.phase("setup"):
        trainer = cls(
            model=model,
            args=args,
            processing_class=word_tokenizer(),
            train_dataset=data,
            eval_dataset=data.select(range(4)),
            fpdt=hf_fpdt.FPDTPlugin(sp_size=sp_size, chunk_size=dpo_loop.CHUNK),
        )
    with recorder.phase("loop"):
        trainer.train()
    return recorder.take(trainer.fpdt.groups)


def main(out_json: str, sp_size: int) -> None:
    recorder = Recorder()
    out = Path(out_json)
    result: dict = {"violations": [], "counts": {}}
    for run, fn in (("grpo", grpo), ("dpo", dpo)):
        calls = fn(recorder, sp_size, out)
        result["violations"] += violations(calls, run)
        counts = Counter("/".join(call[:5]) for call in calls)
        result["counts"][run] = dict(sorted(counts.items()))
    Path(f"{out_json}.{dist.get_rank()}").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
