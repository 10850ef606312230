"""What the tests' training scripts (the Trainer, SFT, DPO/KTO and GRPO/RLOO loops) share: the training
arguments every run fixes (SGD, a log line per step, no checkpoints, no reporting, seeded, CPU), and the end of a
launched script (rank 0 writes the results, then every rank meets and leaves the world)."""

from __future__ import annotations

from collections.abc import Callable

# every loop's TrainingArguments / SFTConfig / DPOConfig / KTOConfig / GRPOConfig / RLOOConfig fields besides its own
TRAINING = dict(
    optim="sgd",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    data_seed=0,
    use_cpu=True,
)


def on_rank0(write: Callable[[], object]) -> None:
    """``write()`` on the world's rank 0 only (the results are the same on every rank)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        write()


def finish(write: Callable[[], object] | None = None) -> None:
    """The end of a launched script: rank 0 writes (``write``), then every rank meets and the world is destroyed."""
    import torch.distributed as dist

    if write is not None:
        on_rank0(write)
    dist.barrier()
    dist.destroy_process_group()
