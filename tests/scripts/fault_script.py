"""One documented script shape with a fault on one rank (launched by ``tests/integration/test_faults.py``).

``python fault_script.py SHAPE FAULT WHERE TIMEOUT OUT`` on every rank (torchrun's environment):

* SHAPE: ``loop`` (the README's Accelerate loop with ``FPDTPlugin``), ``trainer`` (``FPDTTrainer``),
  ``apply`` (``init_process_group`` + ``build_groups`` + ``hf_fpdt.apply`` by hand), or ``generate`` (the
  ``apply`` shape, then greedy ``generate`` of 8 tokens under SP);
* FAULT: ``none``, ``late`` (world rank 1 sleeps ``LATE`` seconds, env ``FAULT_DELAY``, default 15) or
  ``kill`` (world rank 1 kills itself with SIGKILL), at step 2 at WHERE (``step``: before the step's
  first collective; ``forward``: after ``num_items_in_batch``, before the forward), or in the ``loop``
  shape's set-up (``prepare``: before ``FPDTPlugin.prepare``; ``apply``: after ``FPDTPlugin.setup``, before
  ``prepare`` applies the model, whose chunk size is then ``"auto"``), or before the ``generate`` shape's
  decode step 3 (``decode``);
  ``refuse``: the ``apply`` shape's model is refused with a ``ValueError`` on every rank;
* TIMEOUT: ``FPDTPlugin(sp_timeout=TIMEOUT)`` / ``build_groups(timeout=TIMEOUT)``;
* OUT: each rank writes ``OUT/rank{r}.json``: ``{"entered": t, "error": ..., "type": ..., "done": t}``
  (wall-clock times of entering the faulty step and of leaving the script's body; the ``loop`` shape also
  ``"teardown": t``, written when its teardown starts). ``SIGUSR1`` dumps every thread's Python stack.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import torch
from testkit import tiny_model
from torch.utils.data import DataLoader

SHAPE, FAULT, WHERE, TIMEOUT, OUT = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
RANK = int(os.environ["RANK"])
DELAY = float(os.environ.get("FAULT_DELAY", "15"))
record: dict = {"entered": None}
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that sees a rank hang dumps its Python stacks


def fault(step: int | None, where: str) -> None:
    """The fault, at step 2 of WHERE (``step`` None: a point met once, e.g. in the set-up)."""
    if step not in (None, 2) or where != WHERE or RANK != 1:
        return
    if FAULT == "late":
        time.sleep(DELAY)
    elif FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def data(n: int = 6):
    from transformers import default_data_collator

    from hf_fpdt.data.demo import passkey_dataset, word_tokenizer

    ds = passkey_dataset(word_tokenizer(), n, 160, seed=0, progress=False).with_format("torch")
    return ds, default_data_collator


def loop() -> None:
    from accelerate import Accelerator

    import hf_fpdt

    accelerator = Accelerator(cpu=True)
    chunk = "auto" if WHERE == "apply" else 32
    fpdt = hf_fpdt.FPDTPlugin(sp_size=2, chunk_size=chunk, offload=False, sp_timeout=TIMEOUT)
    ds, collate = data()
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(ds, batch_size=1, collate_fn=collate)
    if WHERE in ("prepare", "apply"):
        if WHERE == "apply":
            fpdt.setup(accelerator)
        record["entered"] = time.time()
        fault(None, WHERE)
    model, optimizer, loader = fpdt.prepare(accelerator, model, optimizer, loader)
    for step, batch in enumerate(loader, 1):
        record["entered"] = record["entered"] if step != 2 else time.time()
        fault(step, "step")
        n = fpdt.num_items_in_batch(batch)
        fault(step, "forward")
        loss = model(**batch, num_items_in_batch=n).loss
        accelerator.backward(loss * fpdt.loss_scale)
        optimizer.step()
        optimizer.zero_grad()
        fpdt.global_loss(loss)
        if step == 3:
            break
    record["teardown"] = time.time()  # the README's teardown starts: a rank hung in it is told from a slow one
    save()
    fpdt.release()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def trainer() -> None:
    from transformers import TrainerCallback, TrainingArguments

    import hf_fpdt

    class Fault(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step = state.global_step + 1
            record["entered"] = record["entered"] if step != 2 else time.time()
            fault(step, "step")

    args = TrainingArguments(
        output_dir=os.path.join(OUT, "trainer"), use_cpu=True, per_device_train_batch_size=1, max_steps=3,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, train_sampling_strategy="sequential",
    )  # fmt: skip
    fpdt = hf_fpdt.FPDTPlugin(sp_size=2, chunk_size=32, offload=False, sp_timeout=TIMEOUT)
    ds, collate = data()
    t = hf_fpdt.FPDTTrainer(tiny_model(), args, fpdt=fpdt, train_dataset=ds, data_collator=collate)
    t.add_callback(Fault())
    t.train()


def apply_shape() -> None:
    import torch.distributed as dist

    import hf_fpdt

    dist.init_process_group("gloo")
    groups = hf_fpdt.build_groups(2, timeout=TIMEOUT)
    model = tiny_model()
    config = hf_fpdt.FPDTConfig(chunk_size=32, offload=False, sp_size=2)
    if FAULT == "refuse":  # fewer heads than SP ranks with Ulysses alone: a clear ValueError on every rank
        model.config.num_attention_heads = 1
        config = hf_fpdt.FPDTConfig(chunk_size=32, offload=False, sp_size=2, ring_degree=1)
    hf_fpdt.apply(model, config, groups.sp)
    ids = torch.arange(64).view(1, 64) % 50
    model(input_ids=ids, labels=ids, position_ids=torch.arange(64).view(1, 64))


def generate_shape() -> None:
    import torch.distributed as dist
    from transformers import LogitsProcessor, LogitsProcessorList

    import hf_fpdt

    class Fault(LogitsProcessor):  # runs after each forward: its third call comes before decode step 3
        calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                record["entered"] = time.time()
                fault(None, "decode")
            return scores

    dist.init_process_group("gloo")
    groups = hf_fpdt.build_groups(2, timeout=TIMEOUT)
    config = hf_fpdt.FPDTConfig(chunk_size=16, offload=False, sp_size=2)
    model = hf_fpdt.apply(tiny_model().eval(), config, groups.sp)
    ids = torch.randint(5, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    processors = LogitsProcessorList([Fault()])
    model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, logits_processor=processors)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    try:
        {"loop": loop, "trainer": trainer, "apply": apply_shape, "generate": generate_shape}[SHAPE]()
    except BaseException as exc:
        record.update(error=str(exc), type=type(exc).__name__)
        raise
    finally:
        record["done"] = time.time()
        save()


def save() -> None:
    """Write this rank's record (whole: written to a new file, then renamed over the old one)."""
    path = os.path.join(OUT, f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
