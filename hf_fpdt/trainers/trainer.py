"""``FPDTTrainer``: HF ``Trainer`` with FPDT sequence parallelism (an :class:`FPDTPlugin` inside).

Differences from ``Trainer``, each the least that SP needs, through Trainer's hooks
(``create_accelerator_and_postprocess``, ``prediction_step``, ``get_total_train_batch_size``, callbacks; one
private, ``_track_num_input_tokens``, listed in :mod:`.compat_transformers`). They are shared with the TRL
trainers: :class:`~hf_fpdt.trainers.adapter.FPDTHooks` overrides the hooks, each handing Trainer's method to the
trainer's :class:`~hf_fpdt.trainers.adapter.FPDTAdapter` (``trainer.fpdt_adapter``), which does the work:

* construction: the plugin builds the SP/DP groups from the training arguments' world and applies
  FPDT to the model (plain or PEFT-wrapped) before ``Trainer`` wraps it (DDP, DeepSpeed, FSDP);
* data loaders: Trainer's own (batch size, workers, sampling, ``remove_unused_columns``), which the trainer's
  accelerator (:class:`~hf_fpdt.trainers.dp_seam.FPDTAccelerator`) shards over the DP world and collates into this
  rank's FPDT shard (:func:`~hf_fpdt.trainers.loaders.prepare_loader`) instead of sharding over every process;
* nothing else in training. ``Trainer`` already counts ``num_items_in_batch`` over every process
  (``average_tokens_across_devices``, required here), which under SP is the whole samples' valid
  targets because every rank counts only its own tokens; it multiplies each rank's loss by the
  number of processes before DDP's world average, which is the SP gradient rule; and its logged loss
  (the world mean of those scaled losses) is the true loss of the global batch;
* evaluation: each step's loss is the loss of the global batch (all ranks' token losses over all valid
  targets, what one process computes on that batch), and results are gathered over the DP ranks only, one
  copy per SP group, the last batch cut to the samples it holds: loss, metrics and prediction rows equal
  one process with the global batch for any eval set size and batch size (with ``dp > 1``, a last batch
  that Accelerate filled up with repeated samples counts them in its loss). Predictions for
  ``compute_metrics`` come from ``preprocess_logits_for_metrics`` (required with ``compute_metrics``, e.g.
  ``lambda logits, labels: logits.argmax(-1)``), which runs inside the model's tiled LM head on one tile
  of tokens at a time (``logits [1, n, V]`` and those tokens' *targets*), so logits never exist for the
  whole sequence; its per-token results are gathered over the SP group in sequence order.
  ``compute_metrics`` then gets what HF's ``Trainer`` gives it: predictions ``[B, S, ...]`` at every
  position and the unshifted labels ``[B, S]`` (position 0: -100), so the same function works with and
  without FPDT (the evaluation loaders' batches carry the samples' length, ``fpdt_seq_len``, so the
  layout's padding is dropped again);
* the plugin's host buffers are released when training ends; the world the Trainer runs on (which
  ``TrainingArguments`` or this trainer initialised) and the SP/DP groups are destroyed at interpreter exit
  unless the program did it first;
* failures: the world's collectives wait at most ``sp_timeout`` (:class:`FPDTPlugin`), and one that fails
  because a peer is late or dead (Trainer's token count, DDP's forward and gradient reduction, logging)
  raises :class:`~hf_fpdt.distributed.peers.SPPeerFailure` naming that peer, the collective and the timeout
  (``get_batch_samples`` and ``training_step`` mark where each rank is; ``train`` translates the error).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments

from .accelerate_plugin import FPDTPlugin
from .adapter import FPDTAdapter, FPDTHooks
from .arguments import plugin_for
from .loaders import SEQ_LEN_KEY

__all__ = ["SEQ_LEN_KEY", "FPDTTrainer", "plugin_for"]


class FPDTTrainer(FPDTHooks, Trainer):
    """A ``Trainer`` whose model runs FPDT over SP groups of ``fpdt.sp_size`` processes.

    Args:
        model: the model (plain HF or PEFT); FPDT is applied to it here. ``model_init`` is not supported.
        args: the ``TrainingArguments``.
        fpdt: the plugin (default: ``FPDTPlugin()``, i.e. ``FPDT_*`` environment variables).
        *trainer_args, **kwargs: passed to ``Trainer``. ``preprocess_logits_for_metrics`` runs tile by
            tile inside the model (see the module docstring) and is required with ``compute_metrics``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        fpdt: FPDTPlugin | None = None,
        **kwargs: Any,
    ) -> None:
        adapter = self.fpdt_adapter = FPDTAdapter(self, model)
        args = adapter.resolve(args, fpdt, TrainingArguments)
        kwargs = adapter.start(model, args, kwargs)
        super().__init__(model, args, *trainer_args, **kwargs)
        adapter.started()
