"""Masks HF composes for families outside the registry, at two sequence-parallel ranks (gloo, real processes, fp32).

Llama 4 text's attention chunks (``attention_chunk_size`` 24; 4 layers, the last a NoPE full-attention layer) and
PhiMoE's sliding window (24) reach fpdt only through HF's composed mask function (``hf_fpdt.integrations.
composed_mask``). Each rank builds that mask from its own shard, whose position ids (FPDT's rank-ordinal layout,
``hf_fpdt.data.layout.shard_batch``) jump between its pieces: HF reads every shard as packed rows and remaps the
chunks to the shard's positions. The attention must compute chunks and windows on the GLOBAL sequence instead: over
the group's positions where the rows are packed (apply's input check), else over the global token order. Checked
here, 83 tokens (padded to 84) with FPDT chunks of 8 (aligned with the attention chunks) and 10 (attention-chunk and
window boundaries cutting blocks), each shard's pieces of 4 or 5 tokens: the loss and every gradient (after
``reduce_gradients``) equal eager on one process (<= 1e-5 relative) for

* Llama 4 text under ``hf_fpdt.apply``, one document per row and packed rows (positions restarting at 30 and 50,
  ``use_cache=False``: HF's documents, and attention chunks following each document's positions);
* the attention-only path (``attn_implementation="fpdt"`` + ``hf_fpdt.configure`` with the group; HF's loss cannot
  be used on a shard, so the rank's share of the sample's cross-entropy as in ``test_mrope_sp.py``): Llama 4 text
  and PhiMoE, one document per row, and Llama 4 text's packed rows (``configure`` with a group installs apply's
  input check, which gathers the group's positions: a rank alone cannot see a document starting on another rank);
* PhiMoE's window under ``apply`` (PhiMoE in eval mode, with gradients: its training-mode router samples).

The parent checks that each mask matters at this size (the loss without it differs), so the checks can fail.
"""

from __future__ import annotations

import pytest
import torch
from families import assert_same
from testkit import rel_err, tiny_model

import hf_fpdt

pytestmark = pytest.mark.multiprocess

SEQ, VOCAB = 83, 256
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
MASKS = {  # model_type -> the config switching its composed mask on (HF's mask function, no registry entry)
    "llama4_text": {
        "num_hidden_layers": 4,  # chunked, chunked, chunked, NoPE full attention
        "attention_chunk_size": 24,
        "intermediate_size_mlp": 128,
        "num_local_experts": 2,
    },
    "phimoe": {"num_hidden_layers": 2, "sliding_window": 24, "num_local_experts": 2},
}
NO_MASK = {"llama4_text": {"attention_chunk_size": 1000}, "phimoe": {"sliding_window": 1000}}
# (model_type, path, packed rows, FPDT chunk size)
CASES = [
    ("llama4_text", "apply", False, 8),
    ("llama4_text", "apply", False, 10),
    ("llama4_text", "apply", True, 8),
    ("llama4_text", "apply", True, 10),
    ("llama4_text", "attention-only", False, 8),
    ("llama4_text", "attention-only", False, 10),
    ("llama4_text", "attention-only", True, 10),
    ("phimoe", "attention-only", False, 10),
    ("phimoe", "apply", False, 10),
]


def _model(model_type: str, attn: str, state: dict | None = None, **changes) -> torch.nn.Module:
    overrides = {**TINY, **MASKS[model_type], **changes}
    model = tiny_model(model_type, attn, state=state, vocab_size=VOCAB, intermediate_size=128, **overrides)
    return model.train() if model_type == "llama4_text" else model.eval()  # PhiMoE's training router samples


def _packed_positions() -> torch.Tensor:
    pos = torch.stack([torch.arange(SEQ), torch.arange(SEQ)])
    pos[0, 30:] -= 30  # row 0: documents of 30 and 53 tokens; row 1: 50 and 33
    pos[1, 50:] -= 50
    return pos


def _grads(model: torch.nn.Module) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _shard_loss(logits: torch.Tensor, shard) -> torch.Tensor:
    """This rank's share of the mean cross-entropy over the whole sample's valid targets."""
    from hf_fpdt.distributed.sp_loss import sp_loss

    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), shard.shift_labels.flatten(), reduction="sum", ignore_index=-100
    )
    return sp_loss(loss_sum, shard.num_items_in_batch)


def _worker(rank: int, world_size: int, states: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    import torch.distributed as dist

    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.sp_loss import global_loss, reduce_gradients

    group = dist.group.WORLD
    results = {}
    for model_type, path, packed, chunk in CASES:
        config = hf_fpdt.FPDTConfig(chunk_size=chunk)
        pos = _packed_positions() if packed else None
        shard = shard_batch(ids, labels, rank=rank, sp_size=world_size, chunk_size=chunk, position_ids=pos)
        if path == "apply":
            with pytest.warns(UserWarning, match="only partly supported"):
                model = hf_fpdt.apply(_model(model_type, "eager", states[model_type]), config, group=group)
            loss = model(**shard.model_kwargs(), use_cache=False).loss
        else:
            model = hf_fpdt.configure(_model(model_type, "fpdt", states[model_type]), config, group)
            out = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
            loss = _shard_loss(out.logits, shard)
        loss.backward()
        reduce_gradients(model.parameters(), group)
        results[model_type, path, packed, chunk] = (global_loss(loss, group).detach(), _grads(model))
    return results


@pytest.mark.slow
def test_composed_masks_at_sp2_equal_one_process():
    from distributed import run_distributed

    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt without targets
    states, want = {}, {}
    for model_type in MASKS:
        ref = _model(model_type, "eager")
        states[model_type] = ref.state_dict()
        for packed in (False, True):
            ref.zero_grad(set_to_none=True)
            pos = {"position_ids": _packed_positions()} if packed else {}
            out = ref(input_ids=ids, labels=labels, use_cache=False, **pos)
            out.loss.backward()
            want[model_type, packed] = (out.loss.detach(), _grads(ref))
            # the mask matters at this size: without it the loss differs (the checks below can fail)
            with torch.no_grad():
                unmasked = _model(model_type, "eager", states[model_type], **NO_MASK[model_type])
                dropped = unmasked(input_ids=ids, labels=labels, use_cache=False, **pos).loss
            assert rel_err(dropped, want[model_type, packed][0]) > 1e-5, (model_type, packed)
    for got in run_distributed(_worker, 2, states, ids, labels):
        for model_type, path, packed, chunk in CASES:
            assert_same(want[model_type, packed], got[model_type, path, packed, chunk])
