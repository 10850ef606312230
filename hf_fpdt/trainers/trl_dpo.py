"""``FPDTDPOTrainer`` and ``FPDTKTOTrainer``: TRL's preference trainers with FPDT sequence parallelism.

TRL's ``DPOTrainer`` and ``KTOTrainer`` score whole sequences: a loss term is a function of per-sequence
log-probability sums (a sigmoid of the chosen/rejected margin, IPO's per-token averages, KTO's KL estimate
from mismatched pairs), so no rank can score its slice of a sequence alone. Here every rank of an SP group
gets the *whole* batch (the loaders shard over DP only), and the policy's and the reference's fused LM head
(``trl.trainer.utils.add_fused_lm_head``) run sequence-parallel
(:func:`~hf_fpdt.trainers.trl_fused_head.install_sp_fused_head`): each rank's forward runs FPDT on its
shard, and the per-token fields (log-probabilities, entropies, ...) are gathered back into whole sequences
with a differentiable gather. TRL's loss code then runs unchanged and gives one process's loss on every
rank of the group; each rank's backward reaches its own tokens, scaled for DDP's world average.

At every ``sp_size`` (1 included) the fused-head calls of a model FPDT tiled are answered by hf_fpdt's tiled
head (:func:`~hf_fpdt.memory.tiling.tiled_token_logprobs`: tiles sized to the hidden state, not TRL's 4096
tokens x the whole vocabulary), so the head's memory follows the shard too.

What else differs from TRL, each the least SP needs:

* the reference model: a separate ``ref_model`` gets FPDT over the same SP group (and, as in TRL, one
  loaded from the policy's path when none is given for a full fine-tune); with PEFT and no reference, TRL
  disables the adapter on the same model, which needs nothing more;
* metrics: TRL gathers its per-sample metrics (rewards, margins, accuracies, log-probs, token counts) through the
  trainer's accelerator, which under SP is the DP seam's (:mod:`hf_fpdt.trainers.dp_seam`): over the DP group, one
  copy per SP group, so the logged metrics equal one process (over the world each sample would count ``sp_size``
  times);
* loaders: TRL's own (training, evaluation, ``precompute_ref_log_probs=True``'s), which the seam's ``prepare``
  shards over DP with whole batches;
* refused with a ``ValueError`` in ``__init__`` (on every rank: the settings are the same everywhere): a model
  name (FPDT is applied to the object), ``compute_metrics`` (it reads full logits), ``use_liger_kernel``,
  a reference model whose vocabulary differs from the policy's, vision datasets and prompt-learning PEFT
  (inputs as embeddings), and under SP the MoE router auxiliary loss (its balance term averages over the
  whole sequence's router logits).

TRL's reward model trainer (``RewardTrainer``) scores with a sequence-classification head, not the fused LM
head; it is not supported under SP (train it at ``sp_size`` 1, or with ``hf_fpdt.FPDTTrainer`` on a
causal LM).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from ..distributed.digests import agree_on_weights
from . import compat_trl
from .accelerate_plugin import FPDTPlugin
from .adapter import FPDTAdapter, FPDTHooks
from .compat_transformers import attn_implementation


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _vocab(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def _check_common(name: str, model: nn.Module, ref_model: Any, args: Any, kwargs: dict) -> None:
    """Refusals of the preference trainers (settings every rank shares, so every rank raises); the adapter has refused
    anything but a model object."""
    if kwargs.get("compute_metrics") is not None:
        raise ValueError(
            f"{name} logs TRL's own metrics (rewards, margins, accuracies, log-probs); compute_metrics reads full "
            "[B, S, vocab] logits, which FPDT never forms: drop it"
        )
    if args is not None and getattr(args, "use_liger_kernel", False):
        raise ValueError(
            f"{name} does not take use_liger_kernel=True: Liger's layer kernels replace the modules FPDT drives "
            "(attention, MLP, head); FPDT's tiled MLP and head already keep memory per token"
        )
    if ref_model is not None and _vocab(ref_model) != _vocab(model):
        raise ValueError(
            f"{name}: the reference model's vocabulary ({_vocab(ref_model)}) differs from the policy's "
            f"({_vocab(model)}); both score the same token ids, so they need the same tokenizer"
        )
    peft_config = kwargs.get("peft_config")
    prompt_learning = getattr(peft_config, "is_prompt_learning", False) or (
        _is_peft(model) and getattr(model, "active_peft_config", None) is not None
        and model.active_peft_config.is_prompt_learning
    )  # fmt: skip
    if prompt_learning:
        raise ValueError(
            f"{name} does not support prompt-learning PEFT (prefix/prompt tuning): its virtual tokens enter as "
            "embeddings, which the sequence-parallel head does not shard; use LoRA (or another adapter)"
        )
    dataset = kwargs.get("train_dataset")
    if dataset is not None:
        with contextlib.suppress(StopIteration, TypeError):
            sample = next(iter(dataset))
            if isinstance(sample, dict) and ("image" in sample or "images" in sample):
                raise ValueError(
                    f"{name} does not support vision datasets: images enter as embeddings, which the "
                    "sequence-parallel head does not shard; train text-only data"
                )


def _load_reference(model: nn.Module, args: Any) -> nn.Module:
    """The reference TRL builds for a full fine-tune without ``ref_model``: the policy's checkpoint loaded again
    (built here, before FPDT is applied to the policy, with its original attention)."""
    path = compat_trl.get_config_model_id(model.config)
    if not path:
        raise ValueError(
            "no ref_model and the policy has no checkpoint path to load the reference from (a model built from a "
            "config): pass ref_model=, a PEFT adapter (the reference is the adapter disabled), or "
            "precompute_ref_log_probs=True"
        )
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("dtype", model.dtype)
    kwargs.setdefault("attn_implementation", attn_implementation(model.config))
    return compat_trl.create_model_from_path(path, **kwargs)


class _PreferenceHooks(FPDTHooks):
    """What the preference trainers (DPO, KTO) change besides :class:`FPDTHooks`: the set-up (refusals, the reference
    TRL would load, FPDT and the sequence-parallel fused head on the reference), whole batches per SP group, TRL's
    columns, metrics gathered over DP; put it before TRL's trainer in the bases, with ``_config_class``."""

    _config_class: type = DPOConfig

    def __init__(
        self,
        model: nn.Module,
        ref_model: nn.Module | None = None,
        args: Any = None,
        *trainer_args: Any,
        fpdt: FPDTPlugin | None = None,
        **kwargs: Any,
    ) -> None:
        adapter = self.fpdt_adapter = FPDTAdapter(self, model, whole_batches=True)
        _check_common(type(self).__name__, model, ref_model, args, kwargs)
        args = adapter.resolve(args, fpdt, self._config_class)
        if ref_model is None and not _is_peft(model) and kwargs.get("peft_config") is None:
            if not args.precompute_ref_log_probs:
                ref_model = _load_reference(model, args)  # before FPDT changes the policy's attention
        kwargs = adapter.start(model, args, kwargs)
        if ref_model is not None:
            adapter.plugin.apply(ref_model)
            agree_on_weights(adapter.plugin.world_group, ref_model, "the reference model's weights (ref_model)")
        super().__init__(model, ref_model, args, *trainer_args, **kwargs)
        self._fpdt_install_heads()
        if adapter.plugin.sp_size > 1 and compat_trl.aux_loss_enabled(self):
            raise ValueError(
                f"{type(self).__name__}: the MoE router auxiliary loss under sequence parallelism averages over the "
                "whole sequence's router logits, which no rank holds; set router_aux_loss_coef=0 in the config, or "
                "train at sp_size 1"
            )
        adapter.started()

    def _fpdt_install_heads(self) -> None:
        """The fused head on the object TRL patched (the PEFT base model, or the model) and on the reference."""
        model = self.accelerator.unwrap_model(self.model)
        ref = getattr(self, "ref_model", None)
        # under Accelerate's autocast: TRL prepared the reference (its mixed-precision wrapper) before this install
        self.fpdt_adapter.install_heads(
            model.get_base_model() if _is_peft(model) else model,
            self.accelerator.unwrap_model(ref) if ref is not None else None,
        )

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's reference precompute (run inside its ``__init__``), the sequence-parallel heads installed first; its
        loader (whole batches) and its log-probs' gather go over DP through the seam's accelerator."""
        plugin = self.fpdt_adapter.plugin
        if plugin.world_size > 1 and hasattr(dataset, "cache_files") and not dataset.cache_files:
            raise ValueError(
                f"{type(self).__name__}: precompute_ref_log_probs=True with an in-memory {name} dataset on "
                f"{plugin.world_size} processes: TRL caches the reference log-probs in a file next to the dataset, "
                "which for an in-memory dataset is each process's own temporary folder (the other ranks cannot read "
                "rank 0's file). Save the dataset once and load it from disk on every rank (dataset.save_to_disk(path) "
                "on one process, then datasets.load_from_disk(path)), or set precompute_ref_log_probs=False"
            )
        self._fpdt_install_heads()
        return super()._precompute_ref_logps(dataset, name, batch_size)


class FPDTDPOTrainer(_PreferenceHooks, DPOTrainer):
    """TRL's ``DPOTrainer`` whose policy and reference run FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the policy object (plain HF; PEFT-wrapped, or ``peft_config=`` for TRL to wrap it).
        ref_model: the reference (FPDT is applied to it over the same SP group); None: TRL's default (the adapter
            disabled with PEFT, the policy's checkpoint loaded again for a full fine-tune, nothing with
            ``precompute_ref_log_probs=True``).
        args: a ``DPOConfig``. Every ``loss_type`` (and weighted combinations, ``rpo_alpha``-style ``"sft"``,
            ``ld_alpha``, ``use_weighting``, f-divergences) works: each is a function of the gathered per-token
            fields. ``padding_free`` is turned off by TRL 1.16 itself.
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        *trainer_args, **kwargs: passed to ``DPOTrainer``.
    """

    _config_class = DPOConfig


class FPDTKTOTrainer(_PreferenceHooks, KTOTrainer):
    """TRL's ``KTOTrainer`` whose policy and reference run FPDT over SP groups of ``fpdt.sp_size`` processes.

    The KL term's mismatched (prompt, completion) pairs go through the same sequence-parallel fused head as the
    matched ones. Arguments as :class:`FPDTDPOTrainer` (``args``: a ``KTOConfig``).
    """

    _config_class = KTOConfig
