"""TRL's fused LM head over whole sequences under sequence parallelism (the preference and RL trainers).

TRL's trainers score sequences with ``model(..., labels=labels, fused_lm_head=True)``
(``trl.trainer.utils.add_fused_lm_head``): per-token log-probabilities (and entropies) of the labels, never
the full logits. Their losses are not sums of token terms (a sigmoid of per-sequence log-probability sums,
a policy loss normalised per sequence), so a rank cannot score its own slice of the sequence alone.

:func:`install_sp_fused_head` puts one wrapper around that forward. A call with ``fused_lm_head=True`` and the
*whole* batch (the same on every rank of the SP group, which it checks) runs this rank's shard through the
model in FPDT's layout (:mod:`hf_fpdt.data.layout`: the labels shifted on the whole sequence first), and
returns TRL's output with every per-token field gathered back into the whole sequence
(:func:`hf_fpdt.distributed.sp_loss.gather_tokens`, differentiable). TRL's loss code then runs unchanged on every
rank and gives one process's value; each rank's backward reaches its own tokens only, scaled by ``grad_scale``
for a wrapper that averages gradients over the world. Memory per rank follows the shard: only the per-token
fields (``[B, S]`` floats) exist for the whole sequence. Other calls (generation, ``fused_lm_head=False``)
pass through.

The head itself: TRL's kernel (``trl.kernels.chunked_logprob``) projects tiles of 4096 tokens x the whole
vocabulary in fp32, whatever the sequence (0.5 GiB a tile at a 32000-token vocabulary, several temporaries on
CPU). Where ``hf_fpdt.apply`` tiled the model's loss (its ``"loss"`` part), the wrapper answers the fused-head call
itself: the backbone, then :func:`hf_fpdt.memory.tiling.tiled_token_logprobs` with tiles sized to the hidden state
(:func:`~hf_fpdt.memory.tiling.loss_tiles`) and the family's logit extras, into TRL's ``FusedCausalLMOutput`` with
TRL's semantics (every per-token field computed; TRL leaves the ones its ``outputs`` omits ``None``). With the
MoE router logits requested, TRL's forward answers (its auxiliary loss). At ``sp_size`` 1 (``group=None``) only
this head is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import IGNORE_INDEX
from ..data.layout import pad_sequence, shard_batch
from ..data.layout import shift_labels as shift
from ..distributed.agreement import SP_ADVICE, agree, tensor_digest
from ..distributed.sp_loss import gather_tokens
from ..integrations.deepspeed import zero3_params
from ..integrations.state import find_forward, install_forward, state_of
from ..memory.tiling import loss_tiles, tiled_token_logprobs
from ..models import parts
from ..models.registry import family

KIND = "trl_sp_fused_head"
WHOLE = "fpdt_whole_batch"  # the keyword the sharding pre-hook hands the forward wrapper: (seq_len, shifted, items)
TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def install_sp_fused_head(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    chunk_size: int,
    *,
    pad_token_id: int = 0,
    grad_scale: float | None = None,
    temperature: float = 1.0,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    head_fp32: bool = False,
) -> None:
    """Make ``model``'s fused-head calls (TRL's head already added to it) use hf_fpdt's tiled head, and run whole
    batches sequence-parallel under SP.

    Two pieces: a forward pre-hook (SP only), first of the model's hooks, that checks the ranks hold the same batch
    and replaces it by this rank's shard (so ``hf_fpdt.apply``'s own input checks then see a shard), and a wrapper
    of the forward that answers the call (hf_fpdt's tiled head where ``apply`` tiled the loss, else TRL's forward)
    and gathers the per-token fields back into the whole sequence. ``hf_fpdt.unapply`` removes both.

    Args:
        model: the model whose ``forward`` TRL patched (for PEFT, the base model TRL patched), FPDT applied.
        group: the SP process group; ``None`` (or one rank): no sharding, only the tiled head.
        chunk_size: the resolved integer chunk size of the layout (``FPDTPlugin.resolved_chunk_size()``).
        pad_token_id: the token id of the layout's padding.
        grad_scale: the gradient factor of the gathered fields (default ``sp_size``: DDP, ZeRO and FSDP average
            gradients over the world; 1 with a reduction that sums over the SP group,
            :func:`hf_fpdt.distributed.sp_loss.reduce_gradients`).
        temperature: the temperature TRL's head divides the logits by (TRL keeps it in its forward's closure; the
            trainer passes its own: GRPO/RLOO ``self.temperature``, DPO/KTO 1.0).
        autocast: the context the tiled head's call runs in (a trainer's ``accelerator.autocast``): Accelerate's
            mixed-precision wrapper of a forward it prepared before this install (the reference model) sits inside
            this wrapper, which answers the call without it.
        head_fp32: the head in float32 outside autocast, the hidden state cast to it (TRL's
            ``cast_lm_head_to_fp32``, GRPO's and RLOO's option).
    """
    if find_forward(model, KIND) is not None:
        return
    state = state_of(model)
    size = 1 if group is None else dist.get_world_size(group)
    if state is None or state.runtime.sp_size != size:
        raise ValueError("install_sp_fused_head: apply FPDT to the model over the same SP group first (hf_fpdt.apply)")
    scale = float(size if grad_scale is None else grad_scale)
    head = (float(temperature), bool(head_fp32))
    ring = state.runtime.model_ring_degree(model.config) if hasattr(model, "config") else 1  # the layout's rounds
    layout = (int(chunk_size), ring)
    install_forward(model, KIND, _gather_fields, group, layout, scale, head, autocast)
    if size > 1:
        hook = partial(_shard_whole_batch, group, layout, int(pad_token_id))
        state.hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))


def _shard_whole_batch(
    group: dist.ProcessGroup, layout: tuple[int, int], pad_token_id: int, module: nn.Module, args: tuple, kwargs: dict
) -> tuple | None:
    """Forward pre-hook: a whole-batch ``fused_lm_head=True`` call becomes a call on this rank's shard (``layout``:
    the chunk size and the ring degree it is sharded with)."""
    chunk_size, ring = layout
    if not kwargs.get("fused_lm_head") or WHOLE in kwargs:
        return None
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", args[0] if args else None)
    labels = kwargs.pop("labels", None)
    targets = kwargs.pop("shift_labels", None)
    given_shifted = targets is not None
    if targets is None and labels is not None:
        targets = shift(labels)
    mask = kwargs.pop("attention_mask", None)
    position_ids = kwargs.pop("position_ids", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    embeds = kwargs.get("inputs_embeds")

    def seen(t: object) -> object:
        return tensor_digest(t) if torch.is_tensor(t) else t

    # first the ranks agree (one small all-gather), so that a bad batch is an error on every rank, never a wait
    agree(
        group,
        {
            "input_ids": seen(input_ids),
            "labels": seen(targets),
            "attention_mask": seen(mask),
            "position_ids": seen(position_ids),
            "inputs_embeds": seen(embeds),
            "positional arguments": len(args),
            "output_router_logits": bool(kwargs.get("output_router_logits")),
        },
        what="the batch the fused LM head scores",
        advice="every rank of an SP group must score the same whole batch (its loader shards over DP only). "
        + SP_ADVICE,
    )
    if len(args) > 1 or embeds is not None or input_ids is None:
        raise ValueError(
            "the sequence-parallel fused LM head takes input_ids (each rank embeds its own tokens) and keyword "
            "arguments; inputs_embeds (e.g. multimodal inputs) train at sp_size 1"
        )
    if targets is None:
        raise ValueError("the fused LM head needs labels (or shift_labels) to score")
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "output_router_logits under sequence parallelism: the MoE load-balancing loss averages over the whole "
            "sequence's router logits, which no rank holds; turn the trainer's router auxiliary loss off, or train "
            "at sp_size 1"
        )
    for name, value in (("labels", targets), ("attention_mask", mask), ("position_ids", position_ids)):
        if value is not None and value.dim() == 2 and tuple(value.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"{name} {tuple(value.shape)} does not fit input_ids {tuple(input_ids.shape)} (the whole batch)"
            )
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"a {mask.dim()}D attention_mask under sequence parallelism: it spans tokens other ranks hold; pass the "
            "2D padding mask (or none), or train at sp_size 1"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = input_ids.shape[1]
    piece = shard_batch(
        input_ids,
        None,
        rank=rank,
        sp_size=size,
        chunk_size=chunk_size,
        position_ids=position_ids,
        pad_id=pad_token_id,
        ring=ring,
    )
    total = piece.index.numel() * size
    local = {
        "input_ids": piece.input_ids,
        "position_ids": piece.position_ids,
        "shift_labels": pad_sequence(targets, total, IGNORE_INDEX)[:, piece.index],
    }
    if mask is not None and not bool(mask.bool().all()):
        local["attention_mask"] = pad_sequence(mask.long(), total, 0)[:, piece.index]
    return (), {**kwargs, **local, WHOLE: (seq_len, given_shifted, targets.ne(IGNORE_INDEX).sum(), num_items)}


def _gather_fields(
    group: dist.ProcessGroup | None,
    layout: tuple[int, int],
    grad_scale: float,
    head: tuple[float, bool],
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
    inner: Callable,
    module: nn.Module,
    *args,
    **kwargs,
) -> Any:
    """The forward wrapper: the fused-head output on the shard (hf_fpdt's tiled head where FPDT tiled the model's
    loss, else TRL's), its per-token fields gathered into the whole sequence under SP."""
    whole = kwargs.pop(WHOLE, None)
    if not kwargs.get("fused_lm_head"):
        return inner(*args, **kwargs)
    state = state_of(module)
    tiled = state is not None and "loss" in state.parts and not _router_logits(module, kwargs)
    if tiled:
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = _tiled_head(state, module, *head, args, kwargs)
    else:
        out = inner(*args, **kwargs)
    if whole is None:
        return out
    seq_len, given_shifted, valid, num_items = whole
    for name in TOKEN_FIELDS:
        value = getattr(out, name, None)
        if torch.is_tensor(value):
            scale = grad_scale if value.requires_grad else 1.0
            full = gather_tokens(value, group, seq_len, layout[0], scale, ring=layout[1])
            out[name] = full if given_shifted else full[:, :-1]
    divisor = valid.clamp(min=1) if num_items is None else num_items
    # TRL's loss over the whole batch: the same value on every rank, its gradients through the gathered log_probs
    out["loss"] = -out["log_probs"].sum() / divisor
    return out


def _router_logits(module: nn.Module, kwargs: dict) -> bool:
    """Whether TRL's forward would ask for router logits (its MoE auxiliary loss): then TRL's forward answers."""
    if "output_router_logits" in kwargs:
        return bool(kwargs["output_router_logits"])
    return bool(getattr(module.config.get_text_config(), "output_router_logits", False))


def _tiled_head(state: Any, module: nn.Module, temperature: float, fp32: bool, args: tuple, kwargs: dict) -> Any:
    """TRL's fused-head forward (``trl.trainer.utils.add_fused_lm_head``) with hf_fpdt's tiled per-token head:
    tiles sized to the hidden state (:func:`~hf_fpdt.memory.tiling.loss_tiles`) instead of TRL's 4096 tokens x
    the whole vocabulary, the family's logit extras as the model's own loss applies them."""
    from .compat_trl import FusedCausalLMOutput  # TRL is optional: imported when TRL's head is answered

    kwargs = dict(kwargs)
    kwargs.pop("fused_lm_head")
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    outputs = module.base_model(*args, **kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        if labels is None:
            raise ValueError("the fused LM head needs labels (or shift_labels) to score")
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    cfg = module.config.get_text_config()
    head = parts.lm_head(family(cfg.model_type), module)
    targets = targets.to(hidden.device)
    width = hidden.shape[-1]
    tiles = loss_tiles(state.runtime, cfg.vocab_size, width, targets.numel())
    params = zero3_params([module.get_output_embeddings()])
    flat = hidden.reshape(-1, width)
    if fp32:  # TRL's cast_lm_head_to_fp32: the projection in float32, outside autocast
        with torch.autocast(flat.device.type, enabled=False):
            fields = tiled_token_logprobs(flat.float(), head, targets.reshape(-1), tiles, params, temperature)
    else:
        fields = tiled_token_logprobs(flat, head, targets.reshape(-1), tiles, params, temperature)
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (f.view(targets.shape) for f in fields)
    mask = targets != IGNORE_INDEX
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq_probs,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
    )
