"""What a training step depends on besides the model's structure and the batch's shape, agreed by the ranks.

:func:`hf_fpdt.core.agreement.agree` compares the model's structure once and :class:`~hf_fpdt.core.agreement.
StepAgreement` each step's shape; neither sees the numbers a step computes with. Ranks that hold those differently
train silently wrong: each rank scores its shard with its own reference, its own ``beta``, its own rewards, and the
update matches no one-process run. Here the ranks compare them as fixed-size digests (one int64 per field, so the
exchange cannot mismatch in size whatever the ranks hold), before the step depends on them; a difference is an
:class:`~hf_fpdt.core.agreement.SPAgreementError` on every rank naming the field and every rank's value, a
missing peer an :class:`~hf_fpdt.core.peers.SPPeerFailure` within the group's timeout.

* **Trainer arguments** (:func:`agree_on_args`, at a trainer's set-up): *every* dataclass field of the
  ``TrainingArguments`` / TRL config (``beta``, ``loss_type``, ``temperature``, ``learning_rate``,
  ``lr_scheduler_type``, ``gradient_accumulation_steps``, ``max_grad_norm``, ``bf16``, ``seed``, ...; new fields of
  later versions too), except :data:`ARGS_EXCLUDED`: fields that name where this process writes, logs or reports,
  or that the launcher sets per process, which change no number of the step.
* **Weights** (:func:`weights_fingerprint`): every parameter's name, shape, dtype and a digest of its values,
  computed where the parameter lives (:func:`values_digest`: integer arithmetic on its bit pattern, no copy to the
  host), once: a reference model's at the trainer's set-up (:func:`agree_on_weights`), each model's own at its
  first forward under SP (``hf_fpdt.apply``'s step agreement). A parameter sharded by its framework (DeepSpeed
  ZeRO-3, FSDP's ``DTensor``) is compared by its name and full shape only: its owner keeps the shards in step.
* **Per-sample values** (:func:`agree_on_values`, each step): GRPO's rewards and advantages of every completion.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from .agreement import agree

# Fields of the arguments that differ between processes of one job without changing any number of the step, or
# name per-process places; every other field is compared. Each entry says why.
ARGS_EXCLUDED: dict[str, str] = {
    "output_dir": "a path (a process may write under its own)",
    "logging_dir": "a path (older transformers: timestamped per process)",
    "run_name": "a label for trackers (defaults to output_dir)",
    "local_rank": "set per process by the launcher",
    "report_to": "where metrics go, not what they are",
    "project": "a tracker's project name",
    "trackio_space_id": "a tracker's space",
    "trackio_bucket_id": "a tracker's bucket",
    "trackio_static_space_id": "a tracker's space",
    "hub_token": "a credential (never exchanged)",
    "push_to_hub_token": "a credential (older transformers; never exchanged)",
    "hub_model_id": "where the Hub copy goes",
    "hub_strategy": "when the Hub copy is pushed",
    "hub_private_repo": "the Hub copy's visibility",
    "hub_always_push": "Hub pushes",
    "hub_revision": "the Hub copy's branch",
    "push_to_hub": "whether rank 0 pushes a copy",
    "log_level": "console verbosity",
    "log_level_replica": "console verbosity of the other processes",
    "log_on_each_node": "console verbosity per node",
    "disable_tqdm": "a progress bar (its default follows each process's log level)",
    "skip_memory_metrics": "a memory report",
    "num_completions_to_print": "console output (TRL)",
    "log_completions_hub_repo": "where completions are logged (TRL)",
}


def args_values(args: object) -> dict[str, object]:
    """Every field of ``args`` (a dataclass such as ``TrainingArguments`` or a TRL config; another object: its
    attributes) except :data:`ARGS_EXCLUDED`, by name. Nested dataclasses (``accelerator_config``) become dicts of
    their fields, so :func:`~hf_fpdt.core.agreement.fingerprint` compares their contents."""
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        names = [f.name for f in dataclasses.fields(args)]
    else:
        names = sorted(k for k in vars(args) if not k.startswith("_"))
    return {n: _plain(getattr(args, n, None)) for n in names if n not in ARGS_EXCLUDED}


def _plain(value: object, depth: int = 0) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 4:
        return {f.name: _plain(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):  # e.g. lr_scheduler_type, save_strategy: by value, not by class
        return value.value
    return value


ARGS_ADVICE = (
    "Every process must train with the same arguments: build them from the same command line or config file on "
    "every rank (only the fields named in hf_fpdt.core.step_inputs.ARGS_EXCLUDED may differ)"
)


def agree_on_args(group: dist.ProcessGroup | None, args: object, what: str = "the training arguments") -> None:
    """The ranks of ``group`` (the world; ``None``: one process, nothing to do) hold equal ``args``
    (:func:`args_values`), or every rank raises the same ``SPAgreementError`` naming each differing field and every
    rank's value. One all-gather of one int64 per field, plus the differing values when some differ."""
    if group is None or dist.get_world_size(group) < 2:
        return
    agree(group, args_values(args), what=f"{what} ({type(args).__name__})", advice=ARGS_ADVICE, scope="world")


# --- weights ------------------------------------------------------------------------------------------------

_SPAN = 1 << 22  # words per piece: the digest's temporaries stay a few tens of MB per parameter whatever its size
# two digests with their own prime modulus (below 2**31: a word times a coefficient fits an int64, and a span's sum
# of residues stays below 2**53) and their own coefficients per position
_HASHES = ((2_147_483_647, 1_103_515_245, 12_345), (2_147_483_629, 69_069, 1))


def values_digest(t: torch.Tensor) -> str:
    """A digest of ``t``'s values (its bit pattern) as 16 hex digits, computed where ``t`` lives.

    The tensor's bytes as 32-bit words (bytes where the size is not a multiple of 4), each times a coefficient of
    its position, summed modulo a prime below ``2**31``, for two primes: exact integer arithmetic, so the same
    values give the same digest on any device and in any summation order, and any change of one word changes it."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return "0" * 16
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    out = []
    for prime, mul, add in _HASHES:
        acc = 0
        for start in range(0, words.numel(), _SPAN):
            w = words[start : start + _SPAN].to(torch.int64).remainder(prime)
            pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
            coeff = (pos.remainder(prime) * mul + add).remainder(prime)
            acc = (acc + int((w * coeff).remainder(prime).sum())) % prime
        out.append(f"{acc:08x}")
    return "".join(out)


def _sharded(p: torch.Tensor) -> bool:
    """A parameter whose local tensor is a shard its framework keeps in step (ZeRO-3, FSDP's DTensor)."""
    return hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"


def weights_fingerprint(model: nn.Module) -> list[str]:
    """``"name [shape] dtype <digest>"`` for every parameter of ``model`` (:func:`values_digest`; a sharded
    parameter by its name and full shape: ``"name [shape] sharded"``)."""
    out = []
    for name, p in model.named_parameters():
        if _sharded(p):
            out.append(f"{name} {list(getattr(p, 'ds_shape', p.shape))} sharded")
        else:
            out.append(f"{name} {list(p.shape)} {str(p.dtype).removeprefix('torch.')} {values_digest(p)}")
    return out


WEIGHTS_ADVICE = (
    "Every rank must hold the same weights: load them from the same checkpoint, or seed every rank alike before "
    "building a model from a config (torch.manual_seed / transformers.set_seed)"
)


def agree_on_weights(group: dist.ProcessGroup | None, model: nn.Module, what: str) -> None:
    """The ranks of ``group`` hold the same weights in ``model`` (:func:`weights_fingerprint`), or every rank raises
    the same ``SPAgreementError`` naming the first parameter that differs and its digest on every rank. ``what``
    names the model (e.g. ``"the reference model's weights (ref_model)"``)."""
    if group is None or dist.get_world_size(group) < 2:
        return
    agree(group, {"parameters": weights_fingerprint(model)}, what=what, advice=WEIGHTS_ADVICE, scope="world")


# --- per-sample values --------------------------------------------------------------------------------------

_SHOWN_VALUES = 4096  # a tensor up to this many elements travels as its numbers (named in the error), else digested


def readable_values(t: torch.Tensor) -> object:
    """A small tensor as its numbers (nested lists; NaN as ``"nan"``), a large one as its digest."""
    if t.numel() > _SHOWN_VALUES:
        return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} {values_digest(t)}"
    return _no_nan(t.detach().to("cpu").tolist())


def _no_nan(value: object) -> object:
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return "nan" if isinstance(value, float) and value != value else value


REWARDS_ADVICE = (
    "Every rank of an SP group scores the same completions and must get the same rewards: reward functions (and "
    "reward models) must not depend on the rank, the process or its random state"
)


def agree_on_values(
    group: dist.ProcessGroup | None, values: Mapping[str, torch.Tensor | None], what: str, advice: str
) -> None:
    """The ranks of ``group`` (an SP group) hold equal ``values`` (name -> tensor, e.g. the rewards of every
    completion), or every rank raises the same ``SPAgreementError`` naming the field and every rank's values."""
    if group is None or dist.get_world_size(group) < 2:
        return
    shown = {k: None if v is None else readable_values(v) for k, v in values.items()}
    agree(group, shown, what=what, advice=advice)
