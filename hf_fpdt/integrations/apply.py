"""``hf_fpdt.apply(model, config, group)``: turn an HF causal LM into an FPDT model; ``hf_fpdt.unapply``
takes it back; ``hf_fpdt.configure`` gives the attention-only path its settings.

What ``apply`` installs (on module *instances*; :mod:`.state` says how each forward is replaced and where
everything is kept: one :class:`~hf_fpdt.integrations.state.FPDTState`, ``model.fpdt``):

* every model: its own copy of its HF config (so ``attn_implementation="fpdt"`` is set on the copy, and
  the config object the caller built the model from, and other models built from it, keep theirs); one
  :class:`~hf_fpdt.attention.runtime.FPDTRuntime` (config, sequence-parallel group, host stores, one device budget)
  that every attention layer uses, and ``attn_implementation="fpdt"``; with a sequence-parallel group of more
  than one rank, once per forward call, the ranks' agreement on the step's shape and settings
  (:mod:`hf_fpdt.distributed.agreement`: one small all-gather; a mismatch is a ``ValueError`` on every rank), a
  failure note for the peers when a rank's forward raises, and a check that every forward call passes
  explicit ``position_ids`` laid out for the chunk size (and the group's padding mask gathered); and (unless
  ``config.offload_layer_inputs`` is off) host offload of the layer inputs that activation
  checkpointing saves (:mod:`hf_fpdt.memory.checkpointing`); under non-reentrant checkpointing, the
  recomputation rebuilds the attention output from the chunks the first forward stored instead of
  computing attention again (:mod:`.layer_wrappers`).
* every family of the registry (:mod:`hf_fpdt.models.registry`, keyed by ``config.model_type``),
  additionally: the attention's q/k/v projection and RoPE run chunk by chunk inside the pipeline
  (``"projection"``), the MLP is tiled over the sequence (``"mlp"``), and with labels the LM head +
  cross-entropy are tiled with the family's logit extras (``"loss"``: ``model(...).loss`` keeps HF's
  meaning, ``logits`` is ``None``).

Any other model gets a warning naming the parts that are not chunked; ``model.fpdt.parts`` lists those
that are. A model hf_fpdt cannot run exactly (attention that bypasses HF's attention interface) is
refused with the reason.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from functools import partial, update_wrapper

import torch.distributed as dist
from torch import nn

from ..attention.autotune import Autotuner
from ..attention.runtime import FPDTRuntime
from ..config import FPDTConfig
from ..distributed.agreement import StepAgreement, agree, pattern_fingerprint
from ..memory.checkpointing import LayerInputOffloader
from ..models.parts import rope_problem
from ..models.registry import Family, family
from .checkpointed_forward import checkpoint_forwards
from .forward_hooks import Zero3StepCheck, check_sp_inputs, find_documents, sp_after_forward, sp_agree
from .inputs import check_inputs
from .layer_wrappers import checkpointing_pre_hook, mark_recompute, offload_layer_inputs, segment_layers
from .patches import patch_attention, patch_causal_lm, patch_mlp, patch_moe
from .registration import NAME
from .sp_generation import SPGeneration, agreed_generate
from .state import FPDTState, attach, detach, find_forward, hidden_forward, restore_forwards, state_of
from .step_plan import plan_step

_log = logging.getLogger("hf_fpdt")

ALL_PARTS = ("attention", "projection", "mlp", "loss", "layer_input_offload")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of an HF model: those with HF's ``is_causal`` flag and a config (no class names)."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]


MODEL_ADVICE = (
    "Every SP rank must apply the same model (the same architecture and config, dtype and trainable parameters, "
    "e.g. the same PEFT adapters) with the same FPDTConfig.attention_pattern: build them alike on every rank"
)


def model_values(model: nn.Module, config: FPDTConfig) -> dict[str, object]:
    """What the ranks of an SP group must hold alike in ``model`` before they exchange anything whose size
    depends on it (all-to-all buffers, the gradient all-reduce) or whose result mixes their models: the
    architecture, the parameters' dtypes, the trainable parameters' names, shapes and dtypes (a ZeRO-3
    partitioned parameter by its full shape), and the attention pattern of every layer
    (:func:`hf_fpdt.distributed.agreement.pattern_fingerprint`)."""
    hf = _hf_model(model)
    text = hf.config.get_text_config() if hf is not None else None

    def setting(name: str) -> object:
        return getattr(text, name, None)

    heads, hidden = setting("num_attention_heads"), setting("hidden_size")
    head_dim = setting("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
    attn = attention_modules(model)
    layers = setting("num_hidden_layers")
    params = list(model.named_parameters())
    return {
        "model type": getattr(getattr(hf, "config", None), "model_type", type(model).__name__),
        "layers": layers,
        "attention modules": len(attn),
        "hidden size": hidden,
        "attention heads": heads,
        "key/value heads": setting("num_key_value_heads") or heads,
        "head dim": head_dim,
        "vocab size": setting("vocab_size"),
        "parameter dtypes": sorted({str(p.dtype) for _, p in params if p.is_floating_point()}),
        "trainable parameters": [
            f"{name} {list(getattr(p, 'ds_shape', p.shape))} {p.dtype}" for name, p in params if p.requires_grad
        ],
        "attention pattern": pattern_fingerprint(
            config.attention_pattern, layers if isinstance(layers, int) else len(attn)
        ),
    }


def _check_heads(attn: list[nn.Module], runtime: FPDTRuntime) -> None:
    """Every attention module's heads split over the Ulysses degree ``config.ring_degree`` leaves (a ring beside
    Ulysses beyond the head count: :func:`hf_fpdt.config.sp_degrees`), and one ring degree for the whole model
    (the data layout's)."""
    rings = set()
    for module in attn:
        cfg = getattr(module, "config", None)
        heads = getattr(cfg, "num_attention_heads", None)
        if heads is not None:
            rings.add(runtime.ring_degree(heads, getattr(cfg, "num_key_value_heads", None) or heads))
    if len(rings) > 1:
        raise ValueError(
            f"ring_degree={runtime.config.ring_degree!r}: the model's attention layers would run on different rings "
            f"({sorted(rings)}), but one data layout serves them all: set FPDTConfig.ring_degree to one of them"
        )


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The outermost HF ``PreTrainedModel`` inside ``model`` (``model`` itself, or under a PEFT wrapper)."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _causal_lms(model: nn.Module) -> list[nn.Module]:
    """HF models with an output layer over a base model (the ``*ForCausalLM`` heads)."""
    from transformers import PreTrainedModel

    return [
        m
        for m in model.modules()
        if isinstance(m, PreTrainedModel) and m.base_model is not m and m.get_output_embeddings() is not None
    ]


def _refusal(model: nn.Module, fam: Family | None) -> str | None:
    """Why ``model`` cannot run exactly under fpdt, or None."""
    hf = _hf_model(model)
    # a registered family's attention goes through HF's interface (its entry and test say so) even where the
    # model class does not declare it (Qwen3-Next, Falcon-H1: hybrids)
    if hf is not None and fam is None and not type(hf)._supports_attention_backend:
        return (
            f"{type(hf).__name__}'s attention does not dispatch through HF's attention interface (it calls "
            "its own sdpa/eager code), so fpdt attention would never run; no chunked path exists for it"
        )
    if fam is None:
        return None
    if fam.refuse:
        return fam.refuse
    for module in attention_modules(model):
        problem = rope_problem(fam, module)
        if problem is not None:
            return problem
    return None


def whole_mixers(model: nn.Module, fam: Family) -> tuple[str, ...]:
    """The token mixers of ``fam``'s decoder layers that hf_fpdt leaves whole (``Family.whole``), one
    ``"layer <i>: <attribute> (<class>)"`` each."""
    return tuple(
        f"layer {i}: {name} ({type(getattr(layer, name)).__name__})"
        for i, layer in enumerate(_checkpointing_layers(model))
        for name in fam.whole
        if getattr(layer, name, None) is not None and not _is_attention(getattr(layer, name))
    )


def _is_attention(module: nn.Module) -> bool:
    """An HF attention module (HF's ``is_causal`` flag and a config), not a linear-attention or state-space mixer
    that a hybrid keeps under the same attribute (Kimi Linear's ``self_attn``)."""
    return hasattr(module, "is_causal") and hasattr(module, "config")


def _refuse_whole_under_sp(model_type: str | None, whole: tuple[str, ...], sp_size: int) -> None:
    if whole and sp_size > 1:
        raise ValueError(
            f"hf_fpdt.apply: {model_type} under sequence parallelism ({sp_size} ranks): its layers "
            f"{'; '.join(whole[:4])}{' ...' if len(whole) > 4 else ''} are linear-attention / state-space mixers, a "
            "recurrence over the whole sequence that hf_fpdt does not split across ranks (each rank holds a slice "
            "of the sequence, so each would restart the recurrence). Train this model with sp_size 1 (apply chunks "
            "its attention layers, MLP and loss there and runs these mixers whole)"
        )


def _patch_family_modules(model: nn.Module, runtime: FPDTRuntime, fam: Family) -> set[str]:
    found: set[str] = set()
    for layer in _checkpointing_layers(model):
        attn, mlp = getattr(layer, fam.attention, None), getattr(layer, fam.mlp, None)
        if attn is not None and _is_attention(attn):
            patch_attention(attn, fam, runtime)
            found.add("projection")
        if mlp is not None:  # per layer: a MoE family's dense layers (first_k_dense_replace, mlp_only_layers)
            if fam.mlp_kind == "moe" and hasattr(mlp, "experts"):
                patch_moe(mlp, runtime, fam)
            else:
                patch_mlp(mlp, runtime)
            found.add("mlp")
    for lm in _causal_lms(model):
        patch_causal_lm(lm, runtime, fam)
        found.add("loss")
    return found


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a deep copy of its config, installed on every submodule that shared the original.

    HF models keep the config object they were built from (and its sub-configs) on many submodules;
    switching the attention implementation writes into it. On a copy, the caller's config object, and
    any model built from it before or after, keep their attention.
    """
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        return
    memo: dict = {}
    copy.deepcopy(config, memo)  # memo: id(original object) -> its copy, sub-configs included
    for module in model.modules():
        own = module.__dict__.get("config")
        if isinstance(own, PretrainedConfig) and id(own) in memo:
            module.config = memo[id(own)]


# the attention of any family: chunked with the mask transformers composes for each layer (integrations.composed_mask)
APPLIED = {"attention": "attention (with each layer's mask as transformers composes it: window, attention chunks)"}
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # a decoder layer's MLP / MoE attribute in HF's models


def _whole_pieces(model: nn.Module, missing: list[str]) -> str:
    """What the parts ``apply`` could not patch are in ``model``, by class, for its warning."""
    attn = sorted({type(m).__name__ for m in attention_modules(model)})
    layers = _checkpointing_layers(model)
    mlps = sorted({type(c).__name__ for layer in layers for name, c in layer.named_children() if name in MLP_NAMES})
    pieces = {
        "projection": f"the q/k/v/o projections, RoPE and any q/k norm inside {', '.join(attn)}",
        "mlp": f"the MLP / MoE blocks ({', '.join(mlps) or 'of the decoder layers'})",
        "loss": "the LM head and loss ([tokens, vocab] logits at once)",
        "layer_input_offload": "the checkpointed layers' inputs (kept on the device)",
    }
    return "; ".join(pieces[p] for p in missing)


def _checkpointing_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class _InstanceAttribute:
    """An attribute ``apply`` set on a module instance (a causal LM's ``generate`` under SP), kept with the hook
    handles of its :class:`~hf_fpdt.integrations.state.FPDTState`: ``unapply`` calls :meth:`remove`, which
    deletes it (the class's method shows again) unless someone replaced it since."""

    def __init__(self, module: nn.Module, name: str, value: object) -> None:
        self.module, self.name, self.value = module, name, value
        setattr(module, name, value)

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is self.value:
            delattr(self.module, self.name)


def _agree_on_generate(model: nn.Module, state: FPDTState) -> None:
    """Under SP: each causal LM's ``generate`` records its arguments for the prefill's agreement
    (:func:`hf_fpdt.integrations.sp_generation.agreed_generate`)."""
    for lm in _causal_lms(model):
        wrapper = find_forward(lm, "causal_lm")
        # the patched forward's arguments: its _CausalLM (patches.py), which holds the SPGeneration under SP
        held = [getattr(a, "sp_generation", a) for a in wrapper.args] if wrapper is not None else []
        sp = next((a for a in held if isinstance(a, SPGeneration)), None)
        if sp is None:
            continue
        generate = update_wrapper(partial(agreed_generate, sp, lm, lm.generate), lm.generate)
        state.hooks.append(_InstanceAttribute(lm, "generate", generate))


def _offload_checkpointed_inputs(model: nn.Module, state: FPDTState) -> bool:
    runtime, layers = state.runtime, _checkpointing_layers(model)
    offloader = LayerInputOffloader()  # one pool for all layers
    offloader.use(runtime.residency, runtime.config.sync_copies)  # one device budget with the attention's chunks
    for layer in layers:
        offload_layer_inputs(layer, offloader)
    state.layer_offloader = offloader
    return bool(layers)


def _pre_hook(model: nn.Module, state: FPDTState, hook: Callable) -> None:
    state.hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True))


def _holders(model: nn.Module) -> list[nn.Module]:
    """The modules that hold the reference to the model's state: the HF model (``model.fpdt``, also through a
    PEFT wrapper), its causal LM heads and its attention modules (the registered attention looks it up)."""
    found = [_hf_model(model) or model, *_causal_lms(model), *attention_modules(model)]
    return list({id(m): m for m in found}.values())


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def apply(
    model: nn.Module,
    config: FPDTConfig | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    autotuner: Autotuner | None = None,
) -> nn.Module:
    """Make ``model`` compute with FPDT; returns the same model object (see the module docstring).

    Works before or after PEFT's ``get_peft_model`` (the patches call the submodules they find at call
    time, and look up trainable parameters per call). Applying an applied model again starts from HF's
    model (:func:`unapply` first). What it installs is kept in one
    :class:`~hf_fpdt.integrations.state.FPDTState`, ``model.fpdt``.

    Args:
        model: an HF causal LM (Llama, GPT-NeoX, or any model using HF's attention interface), possibly
            wrapped (PEFT).
        config: FPDT settings (default: :class:`FPDTConfig` from defaults and ``FPDT_*`` env).
        group: the sequence-parallel process group, passed explicitly (``None`` = one process).
        autotuner: the :class:`~hf_fpdt.attention.autotune.Autotuner` that resolves ``"auto"`` settings (a new one by
            default; ``FPDTPlugin`` hands in the one it resolved the data layout's chunk size with).
    """
    config = config or FPDTConfig()
    if group is not None and dist.get_world_size(group) > 1:
        # The SP ranks agree on the model first (one all-gather of fixed-size digests): a model of another
        # size would meet its peers in buffers of other sizes (a gloo abort), another type or pattern would
        # give a loss matching neither rank's model.
        agree(group, model_values(model, config), what="the model given to hf_fpdt.apply", advice=MODEL_ADVICE)
    hf = _hf_model(model)
    model_type = hf.config.get_text_config().model_type if hf is not None else None
    fam = family(model_type) if model_type is not None else None
    reason = _refusal(model, fam)
    if reason is not None:
        raise ValueError(f"hf_fpdt.apply: {type(model).__name__} ({model_type}) is not supported: {reason}")
    whole = whole_mixers(model, fam) if fam is not None else ()
    _refuse_whole_under_sp(model_type, whole, dist.get_world_size(group) if group is not None else 1)
    runtime = FPDTRuntime(config, group, autotuner=autotuner or Autotuner(backend=config.backend))
    attn = attention_modules(model)
    if not attn:
        raise ValueError(f"{type(model).__name__} has no attention module hf_fpdt can drive")
    before = state_of(model)
    if before is not None:
        unapply(model)  # applied (or configured) before: start from HF's model
    previous = getattr(getattr(hf or model, "config", None), "_attn_implementation", None)
    state = FPDTState(runtime, attn_implementation=previous)
    if before is None or not before.applied:  # an applied model kept the copy apply gave it
        _own_config(model)
    _set_attn_implementation(model, NAME)
    _pre_hook(model, state, check_inputs)  # first: the hooks below read these inputs
    if runtime.sp_size > 1:
        _check_heads(attn, runtime)  # at apply time, not at the first forward
        state.agreement = StepAgreement(runtime.group)
        agree_first = partial(sp_agree, runtime, state.agreement)
        state.hooks.append(model.register_forward_pre_hook(agree_first, with_kwargs=True, prepend=True))
        _pre_hook(model, state, partial(check_sp_inputs, runtime))
        state.hooks.append(model.register_forward_hook(partial(sp_after_forward, state.agreement), always_call=True))
    _pre_hook(model, state, Zero3StepCheck(runtime))
    if runtime.sp_size == 1:  # under SP, check_sp_inputs finds the documents
        _pre_hook(model, state, find_documents)
    parts = {"attention"} | (_patch_family_modules(model, runtime, fam) if fam is not None else set())
    if runtime.sp_size > 1:
        _agree_on_generate(model, state)
    state.layer_classes = checkpoint_forwards(_checkpointing_layers(model))  # transformers <= 5.22; before the wrappers
    if config.offload_layer_inputs and _offload_checkpointed_inputs(model, state):
        parts.add("layer_input_offload")
    layers = _checkpointing_layers(model)
    for layer in layers:
        mark_recompute(layer, runtime)  # non-reentrant recomputation replays the stored attention output
    if layers:  # HF's checkpointing knobs hf_fpdt does not plan for are refused at the training forward
        _pre_hook(model, state, partial(checkpointing_pre_hook, layers))
    fixed = config.checkpoint_segments if config.checkpoint_segments != "auto" else 1  # "auto": chosen per step
    segments = segment_layers(model, runtime, fixed)  # outermost wrapper of the layers
    runtime.checkpointing.segments = fixed
    if fixed > 1:
        _log.info(
            "hf_fpdt: checkpoint segments of k=%d layers (%d segments), applied while training with gradient "
            "checkpointing", config.checkpoint_segments, segments,
        )  # fmt: skip
    _pre_hook(model, state, partial(plan_step, runtime, _checkpointing_layers(model)))  # host budget per shape
    wanted = [p for p in ALL_PARTS if p != "layer_input_offload" or config.offload_layer_inputs]
    missing = [p for p in wanted if p not in parts]
    if missing:
        warnings.warn(
            f"hf_fpdt.apply: {type(model).__name__} ({model_type}) is only partly supported (fully chunked: "
            f"the families of hf_fpdt.models.registry). "
            f"Applied: {', '.join(APPLIED.get(p, p) for p in ALL_PARTS if p in parts)}. Not applied: "
            f"{', '.join(missing)}: {_whole_pieces(model, missing)} run as in HF over the full local sequence, "
            "with the same results; their memory grows with the sequence length",
            stacklevel=2,
        )
    state.parts = tuple(p for p in ALL_PARTS if p in parts)
    state.whole = whole
    if whole:
        _log.info(
            "hf_fpdt: %s: %d token mixers run whole (over the full local sequence, as in HF): %s",
            model_type, len(whole), "; ".join(whole),
        )  # fmt: skip
    attach(state, _holders(model))
    return model


def configure(
    model: nn.Module,
    config: FPDTConfig | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    autotuner: Autotuner | None = None,
) -> nn.Module:
    """Settings of the attention-only path for a whole model: ``model``'s attention layers (loaded with
    ``attn_implementation="fpdt"``, or switched with ``model.set_attn_implementation("fpdt")``; this does not
    switch them) share one runtime made from ``config`` (one autotuner, one device budget, one chunk size),
    kept in ``model.fpdt``. Without it, the model's first fpdt call makes that runtime from the defaults and
    the ``FPDT_*`` environment. With an SP ``group``, every forward's ``position_ids`` are checked against
    FPDT's layout and the group's positions and padding mask gathered once per forward, as :func:`apply` does, so
    packed documents and padding are the whole sequence's (a rank alone sees pieces of it). Nothing else of the
    model changes (for the chunked projection, MLP, loss and the layer wrappers use :func:`apply`);
    :func:`unapply` removes it. Returns the same model object.

    Args: as :func:`apply`'s.
    """
    state = state_of(model)
    if state is not None and state.applied:
        raise ValueError(
            "hf_fpdt.configure: this model is applied (hf_fpdt.apply), whose config its attention uses already: "
            "apply it again with the new config, or hf_fpdt.unapply(model) first"
        )
    config = config or FPDTConfig()
    if group is not None and dist.get_world_size(group) > 1:  # as apply: the SP ranks hold the same model
        agree(group, model_values(model, config), what="the model given to hf_fpdt.configure", advice=MODEL_ADVICE)
    runtime = FPDTRuntime(config, group, autotuner=autotuner or Autotuner(backend=config.backend))
    if state is not None:
        unapply(model)
    state = FPDTState(runtime)
    if runtime.sp_size > 1:  # apply's input check: positions in FPDT's layout, the group's documents and padding
        _pre_hook(model, state, partial(check_sp_inputs, runtime))
    attach(state, _holders(model))
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (or :func:`configure`) on ``model`` (what ``apply`` was given, or the HF model
    inside it): HF's forwards come back on the attention, MLP / MoE, causal LM and decoder layer modules (the
    layer-input offload, recompute and checkpoint-segment wrappers), the forward hooks go, the reference to
    the :class:`~hf_fpdt.integrations.state.FPDTState` goes from every module, and the attention
    implementation is the one ``apply`` found (its own copy of the config stays). The model then computes as
    before ``apply``; its parameters and ``state_dict`` never changed. Returns the same model object.

    Raises ``ValueError`` when ``model`` holds no hf_fpdt state, or when another library wrapped a module's
    forward after ``apply`` (taking fpdt's off would drop theirs: remove theirs first).
    """
    state = state_of(model)
    if state is None:
        raise ValueError(f"hf_fpdt.unapply: {type(model).__name__} holds no hf_fpdt state (not applied)")
    modules = list(model.modules())
    hidden = [type(m).__name__ for m in modules if hidden_forward(m)]
    if hidden:
        raise ValueError(
            f"hf_fpdt.unapply: the forward of {', '.join(sorted(set(hidden)))} was wrapped by another library "
            "after hf_fpdt.apply; remove that wrapper first (taking hf_fpdt's off would drop it too)"
        )
    for handle in state.hooks:
        handle.remove()
    state.hooks.clear()
    for module in modules:
        restore_forwards(module)
    for changed in state.layer_classes:
        changed.remove()
    state.layer_classes.clear()
    detach(modules)
    if state.attn_implementation is not None:
        _set_attn_implementation(model, state.attn_implementation)
    state.runtime.release()  # pooled host buffers; chunks a live graph still holds keep their own
    if state.layer_offloader is not None:
        state.layer_offloader.release()
    return model
