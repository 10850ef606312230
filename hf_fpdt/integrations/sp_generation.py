"""``generate()`` under sequence parallelism: the prompt's prefill runs sequence-parallel, as training does.

Every rank of an SP group calls ``generate`` with the same prompt (HF's loop runs on each rank). The
causal LM patch of ``hf_fpdt.apply`` hands each call with a KV cache to :class:`SPGeneration`:

* **prefill** (an empty cache): each rank takes its shard of the prompt in FPDT's rank-ordinal layout
  (:func:`hf_fpdt.data.chunks.local_token_index`, in the ring's rounds where the SP group is a ring of Ulysses
  groups, ``FPDTConfig.ring_degree``; the prompt padded at the end to a multiple of P, as
  :mod:`hf_fpdt.data.layout` shards a training batch) with its global positions, and runs the base model on
  it. HF's attention modules project the shard's q/k/v and store the shard's keys and values in the
  rank's cache; the attention call runs the training pipeline (:func:`hf_fpdt.attention.chunked.fpdt_attention`:
  chunked all-to-all over the group, no gradients). Left padding is a key mask in global order
  (:class:`hf_fpdt.attention.block_mask.BlockMask` reads it one block at a time: key chunks padded in every row
  are skipped), so every position, padding included, equals sdpa's. The hidden
  state of the prompt's last token is broadcast from the rank that holds it, and every rank computes
  the same next-token logits. First the ranks agree on the prompts and on how they generate
  (:mod:`hf_fpdt.distributed.agreement`: one small all-gather of the prompts' shape and one digest of the token ids,
  the attention mask, the generation arguments (``max_new_tokens``, ``do_sample``, ``temperature``, ... every
  field of the call's ``GenerationConfig``, and the kinds of logits processors and stopping criteria; recorded
  by :func:`agreed_generate`, which ``hf_fpdt.apply`` installs as the model's ``generate``) and, when sampling,
  the random generator's state: ranks that would decode different tokens or a different number of steps raise
  :class:`~hf_fpdt.distributed.agreement.SPAgreementError` alike, naming what differs).
* **decode steps** (and later prefill chunks with ``prefill_chunk_size``): the new tokens are replicated; each rank
  attends over its share of the cache (:mod:`hf_fpdt.attention.cached_attention`) and the shares' ``(out, lse)`` are
  merged over the group (one all-gather per layer). Every rank appends the new tokens' keys to its cache (HF's cache
  update), but only the rank that held the prompt's last token counts them; the others mask them out. The next-token
  logits are SP rank 0's (one broadcast per step), so the group decodes one sequence even where its ranks' own logits
  differ in the last bit. Every collective is guarded: a peer that dies or stalls in a decode step ends the others
  with :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming the step, within the group's timeout.

So per rank the prompt's activations, its cache and the prefill's attention work are ``1 / P`` of one
process's. Shapes, with P ranks, a prompt of S tokens, ``L = ceil(S / P)`` and ``n`` tokens decoded::

    prompt shard  input_ids, position_ids  [B, L]
    cache         keys, values             [B, Hkv, L + n, D]   (this rank's share; the n count on one rank)
    key mask      SPDecode.keys            [B, L + n + q]       (False: left padding, the layout's padding,
                                                                 decoded tokens on the other ranks)

Not sequence-parallel (every rank computes the whole call itself, as without this module): models with
sliding-window layers (a sliding cache keeps the last keys of a rank's shard, not of the sequence),
static caches, ``inputs_embeds`` prompts, and a cache that already holds keys when ``generate`` starts.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..attention.runtime import FPDTRuntime
from ..data.chunk_size import chunk_hints
from ..data.chunks import local_token_index, padded_length
from ..data.layout import gather_sequence, pad_sequence
from ..distributed.agreement import StepAgreement, from_first_rank, settings_values
from ..distributed.all_to_all import group_rank
from ..distributed.peers import guarded
from ..models import parts
from .cache_names import cache_keyword, with_cache

SP_KEYWORD = "fpdt_sp_generation"  # keyword that tells the attention calls the phase (through HF's **kwargs)


@dataclass(frozen=True)
class SPPrefill:
    """The attention calls of a sequence-parallel prefill: ``keys [B, P * L]`` (global order) is False on
    left padding and True elsewhere (the layout's padding at the end included), or None without padding."""

    keys: torch.Tensor | None


@dataclass(frozen=True)
class SPDecode:
    """The attention calls of a decode step: ``keys [B, cache length]``, which of this rank's cached keys count."""

    keys: torch.Tensor


@dataclass(frozen=True)
class _Prompt:
    """What a sequence-parallel prefill left in a cache: the prompt's length, this rank's token indices
    (into the padded prompt) in cache order, and whether this rank counts the decoded tokens."""

    length: int
    index: torch.Tensor
    owner: bool


_NOT_COMPARED = ("inputs", "input_ids", "attention_mask", "position_ids", "streamer")  # prompts: at the prefill


def _compared(value: object) -> object:
    """An argument of ``generate`` as the ranks compare it: numbers, strings and tensors as they are, lists item
    by item, other objects (logits processors, stopping criteria, an assistant model) by their class."""
    if value is None or torch.is_tensor(value) or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_compared(v) for v in value]
    return f"{type(value).__module__}.{type(value).__qualname__}"


def generation_arguments(model: nn.Module, generate: Callable, args: tuple, kwargs: dict) -> dict[str, object]:
    """What a ``generate(*args, **kwargs)`` call of ``model`` decodes with, for the ranks to compare: every field
    of its ``GenerationConfig`` (``generation_config`` or the model's, updated with the keyword arguments, as
    ``generate`` does), the model keyword arguments besides the prompt's, and the classes of the logits
    processors, stopping criteria and other callables given. The streamer is not compared (often rank 0's only)."""
    try:
        bound = dict(inspect.signature(generate).bind_partial(*args, **kwargs).arguments)
    except TypeError:  # generate() itself will say what is wrong
        return {}
    extra = dict(bound.pop("kwargs", None) or {})
    config = bound.pop("generation_config", None) or getattr(model, "generation_config", None)
    values: dict[str, object] = {}
    if config is not None:
        config = copy.deepcopy(config)
        extra = config.update(**extra)  # returns the keyword arguments that are not generation settings
        values.update(config.to_dict())
    for name, value in {**bound, **extra}.items():
        if name not in _NOT_COMPARED:
            values[name] = _compared(value)
    return values


def agreed_generate(sp_generation: SPGeneration, model: nn.Module, generate: Callable, *args, **kwargs):
    """``model.generate`` under sequence parallelism (``hf_fpdt.apply`` installs it): HF's ``generate``, with the
    call's :func:`generation_arguments` kept for the prefill's agreement."""
    sp_generation.arguments.append(generation_arguments(model, generate, args, kwargs))
    try:
        return generate(*args, **kwargs)
    finally:
        sp_generation.arguments.pop()


def _rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of the random generator sampling draws from on ``device`` (None where it cannot be read)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    try:
        return getattr(torch, device.type).get_rng_state(device)
    except (AttributeError, RuntimeError, TypeError):
        return None


def _is_left_padded(mask: torch.Tensor) -> bool:
    """Whether no row of a 2D bool mask has a padding position after a real token."""
    return not bool((mask[:, :-1] & ~mask[:, 1:]).any())


class SPGeneration:
    """Sequence-parallel ``generate`` calls of one causal LM (see the module docstring).

    It keeps, per cache it prefilled (weakly: a cache that dies takes its entry along), the prompt's
    layout, which the decode steps need to mask the cache.
    """

    def __init__(self, runtime: FPDTRuntime, family) -> None:
        self.runtime = runtime
        self.family = family
        self.prompts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.agreement = StepAgreement(runtime.group) if runtime.sp_size > 1 else None
        self.arguments: list[dict] = []  # the generation arguments of the generate() calls running (agreed_generate)

    def handles(self, model: nn.Module, input_ids, inputs_embeds, past_key_values) -> bool:
        """Whether this call runs here: an inference call with a cache this object prefilled, or an empty
        dynamic cache, token ids and no sliding window."""
        if self.runtime.sp_size == 1 or past_key_values is None or torch.is_grad_enabled():
            return False
        try:
            if past_key_values in self.prompts:
                return True
        except TypeError:  # a legacy tuple cache: not weakly referenceable
            return False
        if input_ids is None or inputs_embeds is not None or getattr(past_key_values, "is_compileable", True):
            return False
        if past_key_values.get_seq_length() != 0:
            return False
        if any(getattr(layer, "is_sliding", False) for layer in getattr(past_key_values, "layers", ())):
            return False
        attn = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
        return not any(parts.sliding_window(m) is not None for m in attn)

    def forward(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values,
        logits_to_keep: int | torch.Tensor,
        kwargs: dict,
    ):
        """The causal LM's output for one call (logits and the cache), the same on every rank."""
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "sequence-parallel generation takes a 2D attention mask (batch, length); got "
                f"{attention_mask.dim()} dimensions"
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in ("use_cache", "return_dict")}
        if past_key_values in self.prompts:
            hidden = self._decode(model, input_ids, attention_mask, position_ids, past_key_values, kwargs)
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            hidden = hidden[:, keep]
        else:
            hidden = self._prefill(
                model, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep, kwargs
            )
        logits = parts.lm_head(self.family, model)(hidden)
        if logits.shape[1] == 1:
            # generate's next-token logits: SP rank 0's on every rank. Each rank computes them itself (the attention
            # is merged over the group, the rest runs on every rank), and ranks may differ in the last bit (another
            # thread count or kernel): sampling or an argmax near a tie would then pick different tokens. One
            # broadcast per step (B x V values, small beside the per-layer all-gathers) makes the group decode one
            # sequence; the ranks' random states were agreed at the prefill.
            logits = from_first_rank(self.runtime.group, logits, "the next-token logits (SP generation)")
        return with_cache(CausalLMOutputWithPast, past_key_values, logits=logits)

    def _prefill(self, model, input_ids, attention_mask, position_ids, cache, logits_to_keep, kwargs) -> torch.Tensor:
        runtime, group = self.runtime, self.runtime.group
        ring = runtime.model_ring_degree(model.config)  # the prompt's layout: the ring's rounds (1: Ulysses alone)
        p, rank = runtime.sp_size, group_rank(group)
        batch, length = input_ids.shape
        device = input_ids.device
        dtype = next((w.dtype for w in model.parameters() if w.is_floating_point()), torch.float32)
        total = padded_length(length, p)
        chunk = runtime.global_chunk_size(device, seq_len=total, **chunk_hints(model.config, dtype))
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
        if attention_mask is not None:
            real = attention_mask.to(device=device, dtype=torch.bool)
        arguments = self.arguments[-1] if self.arguments else None
        context = {"prompt input_ids": input_ids, "prompt attention_mask": real, "generation arguments": arguments}
        if arguments and arguments.get("do_sample"):  # the ranks must draw the same tokens
            context["sampling random state"] = _rng_state(device)
        self.agreement.check(  # the ranks hold the same prompts: one small all-gather, a ValueError on every rank
            device,
            context,
            **{
                "batch size": batch,
                "local sequence length": length,  # the whole prompt's length: each rank takes its shard here
                "chunk size": chunk,
                "position_ids given": position_ids is not None,
                **settings_values(runtime.config, model),
                "attention mask": 1,  # the prompt's, compared in the context
            },
        )
        index = local_token_index(length, chunk, p, rank, ring).to(device)
        if not _is_left_padded(real):
            raise ValueError(
                "sequence-parallel generation takes left padding only (padding before each prompt, "
                "tokenizer.padding_side='left'); this attention mask has padding after real tokens"
            )
        if position_ids is None:  # HF's rule under padding: count the real tokens from 0
            position_ids = (real.long().cumsum(-1) - 1).clamp_min(0)
        position_ids = position_ids.to(device).expand(batch, length)
        tail = position_ids[:, -1:] + torch.arange(1, total - length + 1, device=device)  # the layout's padding
        shard_pos = torch.cat([position_ids, tail], dim=1)[:, index]
        keys = None if bool(real.all()) else pad_sequence(real, total, True)  # False: left padding
        out = model.base_model(
            input_ids=pad_sequence(input_ids, total, 0)[:, index],
            attention_mask=None,
            position_ids=shard_pos,
            use_cache=True,
            **{cache_keyword(model.base_model.forward): cache},
            **kwargs,
            **{SP_KEYWORD: SPPrefill(keys)},
        )
        hidden = out.last_hidden_state  # [B, L, E]: this rank's tokens
        owner = next(r for r in range(p) if bool((local_token_index(length, chunk, p, r, ring) == length - 1).any()))
        self.prompts[cache] = _Prompt(length, index, rank == owner)
        if isinstance(logits_to_keep, int) and logits_to_keep == 1:  # generate's case: the last token only
            if rank == owner:
                last = hidden[:, int((index == length - 1).nonzero()[0, 0])].unsqueeze(1).contiguous()
            else:
                last = hidden.new_empty(batch, 1, hidden.shape[-1])
            with guarded(group, "broadcast of the prompt's last hidden state (SP generation's prefill)"):
                dist.broadcast(last, src=dist.get_global_rank(group, owner), group=group)
            return last
        with guarded(group, "all_gather of the prompt's hidden states (SP generation's prefill)"):
            full = gather_sequence(hidden, group, length, chunk, ring=ring)  # [B, S, E]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return full[:, keep]

    def _decode(self, model, input_ids, attention_mask, position_ids, cache, kwargs) -> torch.Tensor:
        prompt = self.prompts[cache]
        batch, new = input_ids.shape
        device = input_ids.device
        local = prompt.index.numel()
        done = cache.get_seq_length() - local  # tokens after the prompt already cached
        total = padded_length(prompt.length, self.runtime.sp_size)
        if attention_mask is None:
            attention_mask = torch.ones(batch, prompt.length + done + new, dtype=torch.bool, device=device)
        mask = attention_mask.to(device=device, dtype=torch.bool)
        if mask.shape[1] != prompt.length + done + new:
            raise ValueError(
                f"sequence-parallel generation: the attention mask covers {mask.shape[1]} tokens, but the cache "
                f"holds a prompt of {prompt.length} and {done} more tokens and the call adds {new}; pass the mask of "
                "the whole sequence (as generate() does)"
            )
        shard = pad_sequence(mask[:, : prompt.length], total, False)[:, prompt.index]
        after = mask[:, prompt.length :]
        keys = torch.cat([shard, after if prompt.owner else torch.zeros_like(after)], dim=1)
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -new:]
        what = f"SP generation's decode step {done + 1} (all_gather of the attention's merge over the ranks)"
        with guarded(self.runtime.group, what):
            out = model.base_model(
                input_ids=input_ids,
                attention_mask=None,
                position_ids=position_ids,
                use_cache=True,
                **{cache_keyword(model.base_model.forward): cache},
                **kwargs,
                **{SP_KEYWORD: SPDecode(keys)},
            )
        return out.last_hidden_state
