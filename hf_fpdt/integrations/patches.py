"""Model-independent halves of the model patches ``hf_fpdt.apply`` installs.

Each patch replaces ``forward`` on one module *instance* (never a class, never a transformers
function) with an :class:`~hf_fpdt.integrations.state.InstalledForward`, which hands the patch the forward
it found (``original``) for the cases it does not handle (a KV cache, generation) and gives it back on
``hf_fpdt.unapply``. The family registry (:mod:`hf_fpdt.models.registry`) says which
pieces a model has; :mod:`hf_fpdt.models.parts` projects and rotates one hidden chunk with them and
builds the LM head with its logit extras.

* attention: hidden chunk -> q/k/v + RoPE -> FPDT pipeline (:func:`hf_fpdt.attention.projection.projected_attention`)
  -> output projection; full-sequence q/k/v never exist.
* MLP: :func:`hf_fpdt.memory.tiling.tiled_mlp` over the module's own forward.
* causal LM: base model -> last hidden state -> :func:`hf_fpdt.memory.tiling.tiled_lm_loss` when labels are
  given (no logits are returned then); with ``logits_fn`` (evaluation: a token-wise reduction such as
  argmax), ``logits`` holds its per-token results, computed tile by tile
  (:func:`hf_fpdt.memory.tiling.tiled_head_map`); HF's own forward otherwise.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils import can_return_tuple

from ..attention.projection import projected_attention
from ..attention.runtime import FPDTRuntime
from ..config import IGNORE_INDEX
from ..distributed.peers import guarded
from ..distributed.sp_loss import global_num_items, sp_loss
from ..memory.tiling import (
    check_label_dtype,
    loss_tiles,
    mlp_tiles,
    tiled_experts,
    tiled_head_map,
    tiled_lm_loss,
    tiled_mlp,
)
from ..models import parts
from ..models.registry import Family
from .cache_names import cache_from, cache_keyword, output_cache, pop_cache, with_cache
from .compiled import traced_inference
from .deepspeed import zero3_params
from .mask_spec import mask_spec, padding_mask, propagate_mask_nan
from .registration import check_dropout
from .sp_generation import SPGeneration
from .state import install_forward, remove_forward

__all__ = ["loss_tiles", "mlp_tiles", "patch_attention", "patch_causal_lm", "patch_mlp", "patch_moe"]


def _install(module: nn.Module, kind: str, func: Callable, *args) -> None:
    """``func(*args, original, module, ...)`` as ``module.forward``; patching a patched module again replaces
    the patch (``original`` stays HF's forward)."""
    remove_forward(module, kind)
    install_forward(module, kind, func, *args)


def _attention_forward(family: Family, runtime: FPDTRuntime, original: Callable, self: nn.Module, *args, **kwargs):
    bound = inspect.signature(original).bind(*args, **kwargs)
    named = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    hidden = named.get("hidden_states")
    cache = cache_from(named)
    embeddings = named.get("position_embeddings")
    if traced_inference(runtime):  # under torch.compile without gradients: HF's path, its attention call traced
        return original(*args, **kwargs)
    if (
        cache is not None
    ):  # generation: HF's path, whose attention call hf_fpdt.attention.cached_attention serves (told so:
        return original(*args, **kwargs, fpdt_cached=True)  # an empty cache's prefill looks like training)
    if family.rotary == "none" and hidden is not None:  # NoPE attention (Kimi Linear's MLA): empty rotary tables
        embeddings = (hidden.new_empty(1, hidden.shape[1], 0),) * 2
    mask = named.get("attention_mask")
    inference = padding_mask(mask) is not None and not torch.is_grad_enabled() and runtime.sp_size == 1
    if inference or embeddings is None or hidden is None:
        # a mask without gradients on one process (hf_fpdt.attention.cached_attention), or no rotary tables: HF's path
        return original(*args, **kwargs)
    dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
    check_dropout(dropout)
    spec = mask_spec(
        runtime, self, mask, named, hidden.shape[1], parts.sliding_window(self), parts.attn_softcap(family, self)
    )
    if family.rotary == "complex":  # DeepSeek-V2's freqs_cis [B, S, R / 2] (complex): as real [B, S, R / 2, 2]
        cos = sin = torch.view_as_real(embeddings)
    else:
        cos, sin = embeddings
    heads, kv_heads = parts.heads(self, family)
    out = projected_attention(
        hidden,
        cos,
        sin,
        functools.partial(parts.project, family, self),
        zero3_params(parts.proj_modules(family, self)),
        heads,
        kv_heads,
        runtime,
        self.scaling,
        spec,
        parts.attn_sinks(family, self),
    )
    out = propagate_mask_nan(out, mask)  # sdpa's NaN rows of a float 4D mask holding NaN
    if family.q_gate:
        out = _gated_output(family, runtime, self, out, hidden)
    else:
        # [B, S, H, D] -> [B, S, H * D] -> output projection (a full-sequence GEMM of hidden width: no spike)
        out = getattr(self, family.out_proj)(out.reshape(*hidden.shape[:-1], -1))
    if family.out_dropout is not None:
        out = F.dropout(out, p=getattr(self, family.out_dropout), training=self.training)
    return out, None


def _gate_and_project(family: Family, module: nn.Module, width: int, x: torch.Tensor) -> torch.Tensor:
    """One tile ``x = [attention output | hidden]`` -> ``out_proj(o * sigmoid(gate))``, the gate being the second
    half of each head of ``q_proj(hidden)`` (Qwen3-Next, HF's ops in HF's order)."""
    o, h = x.split([width, x.shape[-1] - width], dim=-1)
    d = parts.head_dim(module)
    gate = getattr(module, family.qkv_names[0])(h).view(*h.shape[:-1], -1, 2 * d)[..., d:]
    return getattr(module, family.out_proj)(o * torch.sigmoid(gate.reshape(*h.shape[:-1], -1)))


def _gated_output(
    family: Family, runtime: FPDTRuntime, module: nn.Module, out: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """A gated attention's output projection, tiled over the sequence: the gate comes from ``q_proj`` again per tile
    (its ``[S, 2 H D]`` output for the whole sequence never exists)."""
    o = out.reshape(*hidden.shape[:-1], -1)
    x = torch.cat((o, hidden), dim=-1)  # [B, S, H D + E]: one input for the token-wise tiles
    fn = functools.partial(_gate_and_project, family, module, o.shape[-1])
    mods = [getattr(module, family.qkv_names[0]), getattr(module, family.out_proj)]
    return tiled_mlp(fn, x, mlp_tiles(runtime, x.shape[1], x.device), zero3_params(mods))


def patch_attention(module: nn.Module, family: Family, runtime: FPDTRuntime) -> None:
    """Make ``module`` project q/k/v chunk by chunk inside the FPDT pipeline."""
    _install(module, "attention", _attention_forward, family, runtime)


def _mlp_forward(runtime: FPDTRuntime, original: Callable, self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3 or traced_inference(runtime):
        return original(x)
    tiles = mlp_tiles(runtime, x.shape[1], x.device)
    params = zero3_params([self])
    # a MoE block tiled with its own forward (DeepSeek's) flattens its tile with .view: a tile [B, s, E] of a batch
    # of several rows is a strided view of x, so it gets a contiguous copy
    fn = functools.partial(_contiguous_call, original) if hasattr(self, "experts") else original
    with runtime.threads.scope(x.device):  # the tiles' many small kernels on this process's CPUs (attention.threads)
        return tiled_mlp(fn, x, tiles, params)


def _contiguous_call(forward: Callable, x: torch.Tensor) -> torch.Tensor:
    return forward(x.contiguous())


def _moe_forward(family: Family, runtime: FPDTRuntime, original: Callable, self: nn.Module, x: torch.Tensor):
    if x.dim() != 3 or traced_inference(runtime):
        return original(x)
    b, s, e = x.shape
    if self.training and getattr(self, "jitter_noise", 0) > 0:  # Mixtral's router jitter, as HF draws it
        x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    h = x.reshape(-1, e)
    # The router over the whole sequence (its logits are [N, experts], narrow; HF's output recorder sees
    # them once, with their graph, for the auxiliary loss); the experts tile by tile.
    _, weights, index = getattr(self, family.moe_router)(h)
    tiles = mlp_tiles(runtime, s, x.device)
    params = zero3_params([self.experts])
    out = tiled_experts(self.experts, h, index, weights, tiles, params).reshape(b, s, e)
    if family.shared_expert is not None:  # added after the routed experts, as HF does
        shared = functools.partial(_shared_expert, family, self)
        mods = [getattr(self, name) for name in (family.shared_expert, family.shared_expert_gate) if name]
        out = out + tiled_mlp(shared, x, tiles, zero3_params(mods))
    return (out, weights) if family.moe_scores else out  # gpt-oss's block returns its router scores too


def _shared_expert(family: Family, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A MoE block's shared expert on one tile, times ``sigmoid(shared_expert_gate(x))`` where the family has one."""
    y = getattr(moe, family.shared_expert)(x)
    if family.shared_expert_gate is not None:
        y = torch.sigmoid(getattr(moe, family.shared_expert_gate)(x)) * y
    return y


def patch_moe(module: nn.Module, runtime: FPDTRuntime, family: Family) -> None:
    """Make an HF sparse-MoE block (``family.moe_router`` router + ``experts``, and ``family``'s shared expert) run
    its experts tile by tile."""
    _install(module, "moe", _moe_forward, family, runtime)


def patch_mlp(module: nn.Module, runtime: FPDTRuntime) -> None:
    """Make ``module`` (a token-wise MLP ``[B, S, E] -> [B, S, E]``) run and recompute tile by tile."""
    _install(module, "mlp", _mlp_forward, runtime)


class DeferredLogits(torch.Tensor):
    """The logits ``[B, S, V]`` of an evaluation forward that computed its loss tile by tile, formed when first used.

    A forward given labels returns the loss without full logits (the largest tensor of a long-context
    step). HF's ``Trainer`` still reads ``outputs.logits`` beside the loss when it predicts (``predict``,
    ``evaluate`` with ``compute_metrics``) and only then: this tensor's shape is known at once, and the
    first operation on it (Trainer's ``detach``, an ``argmax``, indexing) forms the logits with the model's
    output layer over the kept last hidden state, as the ``sdpa`` model returns them, in float32 (as
    Accelerate's mixed precision returns logits; declaring float32 also keeps that wrapper from forming
    them for a loss-only step). Under sequence parallelism a rank holds a slice of the sequence only, so
    using them raises, naming what to use instead.
    """

    @staticmethod
    def __new__(
        cls, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab: int, sp_size: int
    ) -> DeferredLogits:
        shape = (*hidden.shape[:-1], vocab)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=hidden.device)
        out._hidden, out._head, out._sp_size, out._value = hidden, head, sp_size, None
        return out

    def __init__(self, *args, **kwargs) -> None:
        pass

    def materialize(self) -> torch.Tensor:
        """The full logits (formed once, then kept)."""
        if self._value is None:
            if self._sp_size > 1:
                raise ValueError(
                    f"this model runs FPDT over {self._sp_size} sequence-parallel processes: each holds a slice of "
                    "the sequence, so full logits cannot be returned. Evaluate with hf_fpdt.FPDTTrainer and pass "
                    "preprocess_logits_for_metrics (a token-wise reduction such as lambda logits, labels: "
                    "logits.argmax(-1)), which it runs tile by tile and gathers in sequence order"
                )
            with torch.no_grad():
                self._value = self._head(self._hidden).float()
            self._hidden = None
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, DeferredLogits) else x

        args, kwargs = tree_map(real, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        state = "formed" if self._value is not None else "not formed yet"
        return f"DeferredLogits(shape={tuple(self.shape)}, {state}, sp_size={self._sp_size})"


class _CausalLM:
    """What the causal-LM patch needs of the model, resolved once by :func:`patch_causal_lm`: the runtime, the
    family, the SP generation (under SP) and, for a MoE family, HF's load-balancing loss of the model's own
    module (``load_balancing_loss_func``, which every HF MoE model defines beside its classes)."""

    def __init__(self, runtime: FPDTRuntime, family: Family | None, model: nn.Module) -> None:
        self.runtime, self.family = runtime, family
        self.sp_generation = SPGeneration(runtime, family) if runtime.sp_size > 1 else None
        self.moe = family is not None and family.mlp_kind == "moe"
        self.balance = getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None) if self.moe else None


def _causal_lm_forward(
    lm: _CausalLM,
    original: Callable,
    self: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,  # ``past_key_values`` before transformers 5.24, taken from kwargs under any name (.cache_names)
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
) -> CausalLMOutputWithPast:
    """The patched forward: HF's own where no loss is wanted (:func:`_without_loss`), else the base model, the
    tiled head's loss (:func:`_tiled_loss`), the per-token results of ``logits_fn`` or logits formed when used
    (:class:`DeferredLogits`), and a MoE family's auxiliary loss (:func:`_with_aux_loss`)."""
    runtime = lm.runtime
    cache = pop_cache(kwargs, cache)
    shift_labels = kwargs.pop("shift_labels", None)
    logits_fn = kwargs.pop("logits_fn", None)  # per-tile reduction of the logits (evaluation), see below
    hf_forward = functools.partial(
        _hf_forward,
        original,
        cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )
    if logits_fn is None and lm.sp_generation is None and traced_inference(runtime):  # compiled, no gradients
        extra = {} if shift_labels is None else {"shift_labels": shift_labels}
        return hf_forward(use_cache=use_cache, labels=labels, **extra)
    if labels is None and shift_labels is None and logits_fn is None:  # no loss wanted: HF's forward, logits returned
        call = (input_ids, attention_mask, position_ids, cache, inputs_embeds, logits_to_keep)
        return _without_loss(lm, self, hf_forward, use_cache, call, kwargs)
    router_logits = kwargs.pop("output_router_logits", None)
    if lm.moe:
        router_logits = self.config.output_router_logits if router_logits is None else router_logits
        kwargs["output_router_logits"] = router_logits
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    shift_labels = _targets(runtime, labels, shift_labels, ignore_index)
    outputs = self.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=False if use_cache is None else use_cache,  # a training step needs no cache
        **{cache_keyword(self.base_model.forward): cache},
        **kwargs,
    )
    hidden = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, keep, :]
    head = parts.lm_head(lm.family, self)  # the output layer with the family's logit extras
    vocab = self.config.get_text_config().vocab_size
    tiles = loss_tiles(runtime, vocab, hidden.shape[-1], hidden.shape[0] * hidden.shape[1])
    # logits_fn: Trainer's preprocess_logits_for_metrics, run tile by tile; its per-token results are the
    # output's ``logits`` (e.g. argmax ids [B, S]). Full-vocabulary logits are never returned.
    predictions = None
    if logits_fn is not None:
        targets = None if shift_labels is None else shift_labels[:, keep]
        predictions = tiled_head_map(hidden, head, logits_fn, tiles, targets)
    if shift_labels is None:
        return with_cache(CausalLMOutputWithPast, output_cache(outputs), logits=predictions)
    loss = _tiled_loss(runtime, self, hidden, head, shift_labels, tiles, vocab, ignore_index, num_items)
    if predictions is None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # evaluation through a plain Trainer reads the logits beside the loss: formed when first used
        predictions = DeferredLogits(hidden.detach(), head, vocab, runtime.sp_size)
    common = {
        "loss": loss,
        # full logits never materialised ([S, vocab] is the largest tensor of a long-context step) unless
        # an evaluation uses them; with logits_fn, its per-token results
        "logits": predictions,
        "hidden_states": outputs.hidden_states,
        "attentions": outputs.attentions,
    }
    if not lm.moe:
        return with_cache(CausalLMOutputWithPast, output_cache(outputs), **common)
    return _with_aux_loss(lm, self, outputs, router_logits, attention_mask, common)


def _hf_forward(original: Callable, cache, use_cache: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
    """HF's own forward of the causal LM, with the call's arguments (the cache under the name it takes)."""
    return original(use_cache=use_cache, **{cache_keyword(original): cache}, **kwargs)


def _without_loss(
    lm: _CausalLM, self: nn.Module, hf_forward: Callable, use_cache: bool | None, call: tuple, kwargs: dict
) -> CausalLMOutputWithPast:
    """A call that wants no loss (generation, logits): under SP, ``generate``'s prefill runs sequence-parallel
    (:mod:`.sp_generation`); otherwise HF's forward, without a cache where a cache would be wrong."""
    input_ids, attention_mask, position_ids, cache, inputs_embeds, logits_to_keep = call
    runtime, sp_generation = lm.runtime, lm.sp_generation
    if sp_generation is not None and sp_generation.handles(self, input_ids, inputs_embeds, cache):
        return sp_generation.forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep, kwargs)
    if use_cache is None and ((self.training and torch.is_grad_enabled()) or (runtime.sp_size > 1 and cache is None)):
        # A training step needs no cache, and a cache would route attention to HF's path. Under SP a call
        # without a cache is an evaluation of the shards: a cache HF made would send each rank's attention to
        # its own keys only (transformers 5.24 keeps it in training mode too when no gradients are needed).
        use_cache = False
    return hf_forward(use_cache=use_cache)


def _targets(
    runtime: FPDTRuntime, labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor | None:
    """The targets of every position (``shift_labels``; on one process shifted from ``labels`` here), checked
    to be integer token ids before the forward (HF: a dtype error in its loss)."""
    for given in (labels, shift_labels):
        if given is not None:
            check_label_dtype(given)
    if shift_labels is None and labels is not None:
        if runtime.sp_size > 1:
            raise ValueError(
                "with sequence parallelism pass shift_labels (labels shifted on the full sequence, then sharded: "
                "hf_fpdt.data.layout); a rank cannot shift its own slice, the next token may live on another rank"
            )
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels


def _tiled_loss(
    runtime: FPDTRuntime,
    self: nn.Module,
    hidden: torch.Tensor,
    head: Callable,
    shift_labels: torch.Tensor,
    tiles: int,
    vocab: int,
    ignore_index: int,
    num_items: torch.Tensor | int | None,
) -> torch.Tensor:
    """The loss of the tiled head: under SP this rank's share (:mod:`hf_fpdt.distributed.sp_loss`), else HF's (over
    ``num_items_in_batch`` when given, the mean over valid targets otherwise)."""
    params = zero3_params([self.get_output_embeddings()])
    # labels outside [0, logits' width) are a ValueError (checked with the tiles' one host sync)
    width = getattr(self.get_output_embeddings(), "out_features", None) or vocab
    with runtime.threads.scope(hidden.device):  # the tiles (their gradients too) on this process's CPUs
        loss_sum, num_valid = tiled_lm_loss(hidden, head, shift_labels, tiles, params, ignore_index, vocab=width)
    if runtime.sp_size > 1:
        # This rank's share: sum over the SP group of the shares is the one-process loss.
        group = runtime.group
        with guarded(group, "all_reduce of the sample's valid targets (the SP loss)"):
            return sp_loss(loss_sum, num_items if num_items is not None else global_num_items(shift_labels, group))
    if num_items is not None:
        return loss_sum / (num_items.to(loss_sum.device) if torch.is_tensor(num_items) else num_items)
    return loss_sum / num_valid  # HF's mean over valid targets


def _with_aux_loss(
    lm: _CausalLM, self: nn.Module, outputs, router_logits: bool | None, attention_mask, common: dict
) -> MoeCausalLMOutputWithPast:
    """A MoE family's output: with router logits, HF's auxiliary load-balancing loss added to the loss, as the
    family's own forward computes it (from the router logits the base model recorded, untouched)."""
    aux = None
    if router_logits:
        if lm.runtime.sp_size > 1:
            raise ValueError(
                "output_router_logits under sequence parallelism: HF's load-balancing loss averages over the "
                "whole sample, which no rank holds (and the SP layout's padding tokens would count in it); set "
                "output_router_logits=False (router_aux_loss_coef off)"
            )
        aux = lm.balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
        common = {**common, "loss": common["loss"] + self.router_aux_loss_coef * aux.to(common["loss"].device)}
    return with_cache(
        MoeCausalLMOutputWithPast, output_cache(outputs), aux_loss=aux, router_logits=outputs.router_logits, **common
    )


def patch_causal_lm(model: nn.Module, runtime: FPDTRuntime, family: Family | None = None) -> None:
    """Make ``model`` (an HF causal LM) compute its loss with the tiled LM head (and ``family``'s logit
    extras, MoE auxiliary loss) when given labels, and, under sequence parallelism, run ``generate``'s
    prefill sequence-parallel (:mod:`.sp_generation`)."""
    lm = _CausalLM(runtime, family, model)
    if lm.moe and lm.balance is None:
        raise ValueError(
            f"{type(model).__name__}: a MoE model whose module ({type(model).__module__}) has no "
            "load_balancing_loss_func, which hf_fpdt computes its router auxiliary loss with; this family is "
            "not supported by hf_fpdt.apply (use attn_implementation='sdpa')"
        )
    _install(model, "causal_lm", _causal_lm_call, lm)
    # generate() reads the forward's signature: without position_ids it would not make them under left
    # padding, and without logits_to_keep a prefill would build [prompt, vocab] logits for one token.
    model.forward.__signature__ = inspect.signature(model.forward.inner)


def _causal_lm_call(lm: _CausalLM, original: Callable, self, *args, **kwargs):
    return _returning_tuple_if_asked(self, lm, original, *args, **kwargs)


@can_return_tuple  # return_dict=False (or the config's): a tuple, as HF's forward
def _returning_tuple_if_asked(self, lm, original, *args, **kwargs):
    return _causal_lm_forward(lm, original, self, *args, **kwargs)
