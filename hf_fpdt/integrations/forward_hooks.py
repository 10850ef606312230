"""The forward hooks :func:`hf_fpdt.integrations.apply.apply` installs on the model, run once per forward call
(outside every chunk loop): under sequence parallelism (SP) the ranks' agreement on the step
(:class:`~hf_fpdt.distributed.agreement.StepAgreement`), the layout check of the position ids (which also finds packed
documents and the padding mask of the group) and the failure note a raising rank leaves for its peers; under
DeepSpeed ZeRO-3 its partition group's agreement on the step; on one process, the packed documents' ids.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..attention.runtime import FPDTRuntime
from ..data.chunk_size import chunk_hints
from ..data.layout import gather_sequence
from ..distributed.agreement import StepAgreement, mask_kind, settings_values
from ..distributed.digests import weights_fingerprint
from ..distributed.peers import guarded
from .cache_names import cache_from
from .compiled import traced_without_grad
from .deepspeed import ZERO3_ADVICE, partition_group
from .mask_spec import DOCUMENT_IDS, KEY_MASK, POSITIONS, hf_holds_cache, packed_documents

WEIGHTS_FIELD = "the model's weights (load one checkpoint on every rank, or seed every rank alike)"


def check_sp_inputs(runtime: FPDTRuntime, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook under SP: explicit position ids, laid out as the attention will chunk them.

    The attention cuts each rank's tokens with the runtime's chunk size; data sharded with another
    chunk size would be attended in the wrong order without any error. So the group's positions are
    gathered into the global order of :func:`hf_fpdt.data.chunks.local_token_index` once per forward (one
    small all-gather and one host sync, outside every chunk loop): along each row a position must grow
    by 1 or restart at 0. Restarts are packed documents; their ids (in the global order the attention's
    blocks use) travel to the attention layers as the ``fpdt_document_ids`` keyword. A 2D padding mask
    (sharded with the tokens) is gathered the same way and travels as the ``fpdt_key_mask`` keyword (HF's
    rule: then the positions are no packing; nor are they where HF's forward holds a KV cache, see
    :func:`hf_fpdt.integrations.mask_spec.packed_documents`).
    """
    if cache_from(kwargs) is not None:
        # generation: sharded by .sp_generation itself, or computed whole on every rank (attention.cached_attention)
        return
    pos = kwargs.get("position_ids")
    if pos is None:
        raise ValueError(
            "with sequence parallelism every forward call needs position_ids (the global positions of this "
            "rank's tokens, from hf_fpdt.data.layout); HF would otherwise number each rank's slice from 0"
        )
    p, local_len = runtime.sp_size, pos.shape[-1]
    dtype = next((w.dtype for w in module.parameters() if w.is_floating_point()), torch.float32)
    hints = chunk_hints(module.config, dtype) if hasattr(module, "config") else {}
    chunk = runtime.global_chunk_size(pos.device, seq_len=p * local_len, **hints)  # "auto": resolved here
    ring = runtime.model_ring_degree(module.config) if hasattr(module, "config") else 1
    with guarded(runtime.group, "all_gather of the position_ids (apply's layout check)"):
        glob = gather_sequence(pos.reshape(-1, local_len), runtime.group, p * local_len, chunk, ring=ring)  # [B, P*L]
    steps = glob[:, 1:] - glob[:, :-1]
    if not bool(((steps == 1) | (glob[:, 1:] == 0)).all()):
        raise ValueError(
            f"position_ids do not follow FPDT's layout for chunk_size={chunk}, sp_size={p}, ring_degree={ring}: shard "
            "each batch with hf_fpdt.data.layout.shard_batch (or FPDTPlugin) using the model's chunk_size and ring "
            "degree (packed documents: positions restarting at 0 where each document begins)"
        )
    extra = {}
    mask = kwargs.get("attention_mask")
    if mask is not None:  # any padding: the group's mask in the global order the attention's blocks use
        if mask.dim() != 2:
            raise ValueError(
                "with sequence parallelism the attention_mask must be 2D (batch, length), sharded with the tokens "
                f"(SPCollator / FPDTPlugin); got {mask.dim()} dimensions"
            )
        with guarded(runtime.group, "all_gather of the attention_mask (apply's input check)"):
            keys = gather_sequence(
                mask.to(torch.bool).reshape(-1, local_len), runtime.group, p * local_len, chunk, ring=ring
            )
        extra[KEY_MASK] = None if bool(keys.all()) else keys
    else:  # HF's rule: packed documents only without a padding mask, and without a KV cache
        text = text_positions(glob.view(*pos.shape[:-1], -1) if pos.dim() == 3 else glob)
        docs = packed_documents(text, hf_holds_cache(module, kwargs))
        if docs is not None:  # with the positions, which attention chunks of packed rows follow (Llama 4)
            extra[DOCUMENT_IDS], extra[POSITIONS] = docs, text
    return (args, {**kwargs, **extra}) if extra else None


def text_positions(pos: torch.Tensor | None) -> torch.Tensor | None:
    """The positions HF reads packed documents from: ``[B, S]`` as given; multimodal RoPE's ``[4, B, S]`` (Qwen2.5-VL,
    Qwen3-VL): row 0, the text positions those models put first and pass to their masks; ``[3, B, S]``: None (those
    models build no packed mask from 3D positions)."""
    if pos is None or pos.dim() != 3:
        return pos
    return pos[0] if pos.shape[0] == 4 else None


def find_documents(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook on one process: packed documents' ids, found once per forward (one host sync)
    instead of once per attention layer, reach the attention layers as the ``fpdt_document_ids`` keyword.
    Not in a compiled call without gradients: its attention is traced and takes packing from HF's mask."""
    if traced_without_grad():
        return None
    if DOCUMENT_IDS in kwargs or "cu_seq_lens_q" in kwargs or cache_from(kwargs) is not None:
        return None  # already found, the flattening collator's boundaries (read per layer), or decoding
    pos = text_positions(kwargs.get("position_ids"))
    if kwargs.get("attention_mask") is not None:  # HF's rule: packed documents only without a padding mask
        pos = None  # (and without a KV cache: packed_documents)
    return args, {**kwargs, DOCUMENT_IDS: packed_documents(pos, hf_holds_cache(module, kwargs))}


def sp_values(runtime: FPDTRuntime, module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.device, dict]:
    """What the SP ranks must agree on for this forward call (see :mod:`hf_fpdt.distributed.agreement`)."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    pos = kwargs.get("position_ids")
    ref = tokens if tokens is not None else pos
    batch, length = (tuple(ref.shape[:2]) if ref.dim() > 1 else (1, ref.shape[0])) if ref is not None else (0, 0)
    device = ref.device if ref is not None else next(module.parameters()).device
    return device, {
        "batch size": batch,
        "local sequence length": length,
        "chunk size": runtime.global_chunk_size(device),
        "position_ids given": pos is not None,
        **settings_values(runtime.config, module),
        "attention mask": mask_kind(kwargs.get("attention_mask"), documents="cu_seq_lens_q" in kwargs),
    }


def sp_agree(runtime: FPDTRuntime, agreement: StepAgreement, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook under SP, before every other (so the ranks compare the inputs as the caller gave them, and a
    mask one rank's input check would fit or refuse is named on every rank): the ranks agree on the step (one
    collective; at the first forward also on the model's weights,
    :func:`~hf_fpdt.distributed.digests.weights_fingerprint`: after DDP's broadcast, before any rank computes with
    them)."""
    if cache_from(kwargs) is not None:
        return  # generation: the causal LM's patch shards the prompt itself (.sp_generation)
    device, values = sp_values(runtime, module, args, kwargs)
    mask = kwargs.get("attention_mask")  # its shape too: the error names it, and the mask's gather depends on it
    context: dict[str, object] = {"attention mask shape": list(mask.shape) if torch.is_tensor(mask) else None}
    if agreement.step == 0:  # the first forward: the ranks also hold the same weights (digested where they live)
        context[WEIGHTS_FIELD] = weights_fingerprint(module)
    agreement.check(device, context, **values)


def sp_after_forward(agreement: StepAgreement, module: nn.Module, args, output) -> None:
    """Forward hook (``always_call``): when the forward raised, leave a note for the peers left waiting."""
    if output is None:  # torch passes None when the forward raised; the exception is being handled
        error = sys.exc_info()[1]
        if error is not None:
            agreement.note_failure(error)


@dataclass
class Zero3StepCheck:
    """Forward pre-hook: under DeepSpeed ZeRO-3, the ranks of its partition group agree on the step's shape
    (one small all-gather per forward; see :mod:`hf_fpdt.integrations.deepspeed`). Without ZeRO-3 it only
    looks for a partitioned parameter (no collective); ZeRO-3 may take the model over after ``apply``."""

    runtime: FPDTRuntime
    agreement: StepAgreement | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if cache_from(kwargs) is not None:
            return None  # generation: see sp_agree
        if self.agreement is None:
            group = partition_group(module)
            if group is None or dist.get_world_size(group) < 2:
                return None
            self.agreement = StepAgreement(group, scope="DeepSpeed ZeRO-3 partition group", advice=ZERO3_ADVICE)
        device, values = sp_values(self.runtime, module, args, kwargs)
        self.agreement.check(device, **values)
        return None
