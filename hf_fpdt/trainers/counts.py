"""The tokens an FPDT trainer counts (``num_input_tokens_seen``, ``total_flos``, TRL's ``num_tokens``): each rank's
share of what one process would count, so the logged counts under SP equal one process's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..data.chunks import local_token_index
from .accelerate_plugin import FPDTPlugin
from .loaders import SEQ_LEN_KEY


def counted(inputs: Any, plugin: FPDTPlugin, main_input_name: str = "input_ids", over_dp: bool = False) -> Any:
    """The tokens of ``inputs`` that one process would count, this rank's share of them: the per-token fields
    Trainer/TRL count from (``main_input_name``, ``attention_mask``, ``position_ids``).

    Sharded batches (``SEQ_LEN_KEY`` given): this rank's positions less the layout's padding (at most
    ``sp_size - 1`` tokens at the sample's end, :func:`~hf_fpdt.data.chunks.local_token_index`), so the
    world's sum of the shares is one process's count. Whole batches (every rank of an SP group holds the
    same ones: the fused-head trainers): all of them on SP rank 0, none on the others (a count summed over the
    world), or all of them on every rank with ``over_dp`` (a count the DP seam sums over the DP group). Inputs that
    are no mapping (GRPO's prompts) are returned as they are.
    """
    if not isinstance(inputs, Mapping):  # e.g. GRPO's prompts: nothing Trainer counts
        return inputs
    names = (main_input_name, "attention_mask", "position_ids")
    fields = [k for k in names if torch.is_tensor(inputs.get(k)) and inputs[k].dim() == 2]
    seq_len = inputs.get(SEQ_LEN_KEY)
    if seq_len is None:
        keep = slice(None) if plugin.sp_rank == 0 or over_dp else slice(0, 0)
    else:
        index = local_token_index(
            seq_len, plugin.resolved_chunk_size(), plugin.sp_size, plugin.sp_rank, plugin.resolved_ring_degree()
        )
        keep = (index < seq_len).to(inputs[fields[0]].device) if fields else slice(None)
    return {k: inputs[k][:, keep] for k in fields}
