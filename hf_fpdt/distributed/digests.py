"""What a training step depends on besides the model's structure and the batch's shape, agreed by the ranks.

:func:`hf_fpdt.distributed.agreement.agree` compares the model's structure once and
:class:`~hf_fpdt.distributed.agreement.StepAgreement` each step's shape; neither sees the numbers a step computes
with. Ranks that hold those differently train silently wrong: each rank scores its shard with its own reference, its
own ``beta``, its own rewards, and the update matches no one-process run. Here the ranks compare them as fixed-size
digests (one int64 per field, so the exchange cannot mismatch in size whatever the ranks hold), before the step
depends on them; a difference is an :class:`~hf_fpdt.distributed.agreement.SPAgreementError` on every rank naming
the field and every rank's value, a missing peer an :class:`~hf_fpdt.distributed.peers.SPPeerFailure` within the
group's timeout.

* **Trainer arguments**: :func:`hf_fpdt.trainers.arguments.agree_on_args` (the trainers' concern), through
  :func:`~hf_fpdt.distributed.agreement.agree` like the rest.
* **Weights** (:func:`weights_fingerprint`): every parameter's name, shape, dtype and a digest of its values,
  computed where the parameter lives (:func:`values_digest`: integer arithmetic on its bit pattern, no copy to the
  host), once: a reference model's at the trainer's set-up (:func:`agree_on_weights`), each model's own at its
  first forward under SP (``hf_fpdt.apply``'s step agreement). A parameter sharded by its framework (DeepSpeed
  ZeRO-3, FSDP's ``DTensor``) is compared by its name and full shape only: its owner keeps the shards in step.
* **Per-sample values** (GRPO's rewards and advantages) are not compared: SP rank 0's are broadcast to the group
  (:func:`hf_fpdt.distributed.agreement.from_first_rank`), so no result depends on the ranks computing alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .agreement import agree

_SPAN = 1 << 22  # words per piece: the digest's temporaries stay a few tens of MB per parameter whatever its size
# two digests with their own prime modulus (below 2**31: a word times a coefficient fits an int64, and a span's sum
# of residues stays below 2**53) and their own coefficients per position
_HASHES = ((2_147_483_647, 1_103_515_245, 12_345), (2_147_483_629, 69_069, 1))


def _residues(t: torch.Tensor) -> torch.Tensor:
    """:func:`values_digest`'s two sums as an int64 ``[2]`` tensor on ``t``'s device (no host sync)."""
    flat = t.detach().contiguous().reshape(-1)
    out = torch.zeros(len(_HASHES), dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return out
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    for i, (prime, mul, add) in enumerate(_HASHES):
        for start in range(0, words.numel(), _SPAN):
            w = words[start : start + _SPAN].to(torch.int64).remainder(prime)
            pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
            coeff = (pos.remainder(prime) * mul + add).remainder(prime)
            out[i] = (out[i] + (w * coeff).remainder(prime).sum()).remainder(prime)
    return out


def _hex(residues: list[int]) -> str:
    return "".join(f"{r:08x}" for r in residues)


def values_digest(t: torch.Tensor) -> str:
    """A digest of ``t``'s values (its bit pattern) as 16 hex digits, computed where ``t`` lives.

    The tensor's bytes as 32-bit words (bytes where the size is not a multiple of 4), each times a coefficient of
    its position, summed modulo a prime below ``2**31``, for two primes: exact integer arithmetic, so the same
    values give the same digest on any device and in any summation order, and any change of one word changes it."""
    return _hex(_residues(t).tolist())


def _sharded(p: torch.Tensor) -> bool:
    """A parameter whose local tensor is a shard its framework keeps in step (ZeRO-3, FSDP's DTensor)."""
    return hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"


def weights_fingerprint(model: nn.Module) -> list[str]:
    """``"name [shape] dtype <digest>"`` for every parameter of ``model`` (:func:`values_digest`; a sharded
    parameter by its name and full shape: ``"name [shape] sharded"``)."""
    params = list(model.named_parameters())
    sums: dict[torch.device, list[torch.Tensor]] = {}  # per device: one host read for all its parameters
    for _, p in params:
        if not _sharded(p):
            sums.setdefault(p.device, []).append(_residues(p))
    read = {device: iter(torch.stack(rows).tolist()) for device, rows in sums.items()}
    out = []
    for name, p in params:
        if _sharded(p):
            out.append(f"{name} {list(getattr(p, 'ds_shape', p.shape))} sharded")
        else:
            out.append(f"{name} {list(p.shape)} {str(p.dtype).removeprefix('torch.')} {_hex(next(read[p.device]))}")
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
