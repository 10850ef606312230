"""Loss and gradient reduction under sequence parallelism (SP), alone or combined with data parallelism.

The SP loss of one sample (or batch) is the sum of its token losses over all SP ranks divided by its
valid-token count over all SP ranks. Each rank computes its *share*::

    local_loss_r = sum_{t on rank r} ce_t / N        N = valid targets of the whole batch (all SP ranks)

so that ``sum_r local_loss_r`` is the one-process loss. ``N`` needs no communication when the data
loader sees the full batch (:attr:`hf_fpdt.data.layout.SPShard.num_items_in_batch`); otherwise
:func:`global_num_items` all-reduces it.

Gradients. The attention's all-to-alls are inside autograd, so every rank's ``local_loss_r.backward()``
(run on all SP ranks together) leaves that rank's *partial* parameter gradients of
``sum_r local_loss_r``; the true gradient is their SUM over the SP group. With world = dp x sp:

* explicit rule: :func:`reduce_gradients` sums over the SP group and averages over the DP group;
* DDP/ZeRO rule: when a wrapper averages gradients over the *whole world* (dp * sp ranks), backward
  ``local_loss * sp_size`` (:func:`ddp_loss_scale`); the world mean then equals the DP mean of the
  SP sums.

The logged loss is :func:`global_loss` (sum over SP, mean over DP, detached). The tiled LM head of
:mod:`hf_fpdt.memory.tiling` produces a local token-loss sum; :func:`sp_loss` turns it into the share.

The same rules hold for any group ``N`` is counted over: ``FPDTPlugin`` counts the valid targets of the whole
step over the world (every DP rank's samples), so its shares sum over the world to the step's loss and its
backward scale is the world size; its ``num_items_in_batch``, ``global_loss`` and ``loss_scale`` are these
functions with the world as the SP group (and its own watch as the guard of the world's collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..config import IGNORE_INDEX
from ..data.chunks import local_token_index, padded_length
from ..data.layout import gather_sequence, pad_sequence
from .all_to_all import group_size
from .peers import guarded

Guard = Callable[[str], contextlib.AbstractContextManager]  # what watches a collective, given its name


def _guard(group: dist.ProcessGroup | None, guard: Guard | None, what: str) -> contextlib.AbstractContextManager:
    return guard(what) if guard is not None else guarded(group, what)


def global_num_items(
    shift_labels: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    ignore_index: int = IGNORE_INDEX,
    guard: Guard | None = None,
) -> torch.Tensor:
    """Valid targets of the local ``shift_labels [B, L]`` (or of several micro-batches' together, gradient
    accumulation) summed over ``group``: a 0-d int64 tensor.

    One all-reduce per step (call it once, not per tile). Not needed when the data loader already
    knows the count (:attr:`hf_fpdt.data.layout.SPShard.num_items_in_batch`). ``guard`` watches the collective
    (default :func:`~hf_fpdt.distributed.peers.guarded` over ``group``).
    """
    batches = [shift_labels] if torch.is_tensor(shift_labels) else list(shift_labels)
    if not batches:
        raise ValueError("global_num_items needs at least one shift_labels tensor")
    count = sum((b != ignore_index).sum().to(torch.int64) for b in batches)
    if group_size(group) > 1:
        with _guard(group, guard, "all_reduce of the valid targets (global_num_items)"):
            dist.all_reduce(count, group=group)
    return count


def sp_loss(local_loss_sum: torch.Tensor, num_items: torch.Tensor | int) -> torch.Tensor:
    """This rank's share ``local_loss_sum / num_items`` (differentiable in ``local_loss_sum``).

    A batch without any valid target (``num_items == 0``: every label ignored) gives NaN on every rank, as one
    process does (HF's mean over no target, or its sum divided by ``num_items_in_batch = 0``); its gradients
    are 0, as HF's (:func:`hf_fpdt.memory.tiling.tiled_lm_loss`)."""
    if torch.is_tensor(num_items):
        return local_loss_sum / num_items.to(device=local_loss_sum.device, dtype=local_loss_sum.dtype)
    return local_loss_sum / int(num_items)  # a tensor divided by 0: NaN (0 / 0), as HF's


def global_loss(
    local_loss: torch.Tensor,
    sp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None = None,
    guard: Guard | None = None,
) -> torch.Tensor:
    """The true loss to log: shares summed over ``sp_group`` (the group ``num_items`` was counted over), then
    averaged over ``dp_group`` (detached). ``guard`` watches the collectives (default: ``guarded``)."""
    loss = local_loss.detach().clone()
    if group_size(sp_group) > 1:
        with _guard(sp_group, guard, "all_reduce of the loss over the SP group (global_loss)"):
            dist.all_reduce(loss, group=sp_group)
    if group_size(dp_group) > 1:
        with _guard(dp_group, guard, "all_reduce of the loss over the DP group (global_loss)"):
            dist.all_reduce(loss, group=dp_group)
        loss /= group_size(dp_group)
    return loss


def ddp_loss_scale(sp_group: dist.ProcessGroup | None) -> int:
    """Factor to multiply the loss by before backward when DDP/ZeRO averages gradients over the whole world
    (``sp_group``: the group ``num_items`` was counted over).

    World mean of ``sp * partial`` = ``(1 / dp) * sum_dp sum_sp partial`` = DP mean of the true SP gradients.
    """
    return group_size(sp_group)


def reduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    sp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None = None,
) -> None:
    """In place: ``grad <- mean over dp_group of (sum over sp_group of grad)`` for every parameter with a grad.

    Call after ``local_loss.backward()`` (unscaled) when no DDP wrapper reduces gradients. Parameters
    must be iterated in the same order on every rank; a parameter without a grad is skipped on all ranks
    alike (the model is the same everywhere).
    """
    sp, dp = group_size(sp_group), group_size(dp_group)
    if sp == 1 and dp == 1:
        return
    buckets: dict = {}  # one flat all-reduce per (device, dtype) instead of one per parameter
    for p in parameters:
        if p.grad is not None:
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if sp > 1:
            with guarded(sp_group, "all_reduce of the gradients over the SP group (reduce_gradients)"):
                dist.all_reduce(flat, group=sp_group)
        if dp > 1:
            with guarded(dp_group, "all_reduce of the gradients over the DP group (reduce_gradients)"):
                dist.all_reduce(flat, group=dp_group)
            flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class _GatherTokens(torch.autograd.Function):
    """``apply(local [B, L, ...], group, seq_len, chunk_size, grad_scale, ring) -> [B, S, ...]`` in sequence order."""

    @staticmethod
    def forward(ctx, local, group, seq_len, chunk_size, grad_scale, ring):
        ctx.group, ctx.seq_len, ctx.chunk_size, ctx.grad_scale, ctx.ring = group, seq_len, chunk_size, grad_scale, ring
        with guarded(group, "all_gather of the per-token results (the sequence's log-probabilities)"):
            return gather_sequence(local.contiguous(), group, seq_len, chunk_size, ring=ring)

    @staticmethod
    def backward(ctx, grad):
        size = group_size(ctx.group)
        rank = dist.get_rank(ctx.group) if size > 1 else 0
        index = local_token_index(ctx.seq_len, ctx.chunk_size, size, rank, ctx.ring).to(grad.device)
        mine = pad_sequence(grad, padded_length(ctx.seq_len, size), 0)[:, index]
        return mine * ctx.grad_scale if ctx.grad_scale != 1 else mine, None, None, None, None, None


def gather_tokens(
    local: torch.Tensor,
    group: dist.ProcessGroup | None,
    seq_len: int,
    chunk_size: int,
    grad_scale: float = 1.0,
    ring: int = 1,
) -> torch.Tensor:
    """Every SP rank's per-token ``local [B, L, ...]`` as the whole sequence ``[B, S, ...]`` (differentiable; ``ring``:
    the layout's ring degree, :mod:`hf_fpdt.data.chunks`).

    For losses that are not sums of token terms (a preference loss of per-sequence log-probability sums, a
    policy loss normalised per sequence): every rank of ``group`` gathers the same ``[B, S]`` tensor and
    computes the same loss from it. Backward takes this rank's positions of the incoming gradient (no
    communication), so each rank's parameter gradients are its part of the loss's gradient and their SUM over
    the SP group is the whole; ``grad_scale = sp_size`` (:func:`ddp_loss_scale`) turns that sum into what a
    wrapper averaging over the world (DDP, ZeRO, FSDP) needs, with the loss's value unchanged.
    """
    if group_size(group) == 1 and grad_scale == 1:
        return gather_sequence(local, None, seq_len, chunk_size)
    return _GatherTokens.apply(local, group, seq_len, chunk_size, grad_scale, ring)
