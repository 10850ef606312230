"""Data layout for sequence parallelism: shard a batch for one rank, and gather results back.

Data-loader side only (no model code). With P ranks in a sequence-parallel (SP) group every rank holds
``L = ceil(S / P)`` tokens of each sample, chosen by :func:`hf_fpdt.data.chunks.local_token_index` (FPDT's
rank-ordinal layout), because the attention expects global chunk i to be contiguous tokens after its
all-to-all. Shapes, for a batch of B samples of S tokens::

    input_ids, labels       [B, S]       the full batch (every rank of the SP group sees the same one)
    padded                  [B, P * L]   pad id / -100 appended at the end
    shard tensors           [B, L]       this rank's tokens in its local order
    index                   [L]          global positions (into the padded sample) of those tokens

Labels are shifted on the *full* sequence before sharding (``shift_labels[t] = labels[t + 1]``, -100
at the end), because the next token of a rank's last local token usually lives on another rank.
Padding goes after the real tokens, so causal attention keeps it away from every real token, and it
gets label -100, so it never counts in the loss. Position ids are the global positions (padding
continues the count), so rotary embeddings match the one-process model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import IGNORE_INDEX
from .chunks import local_token_index, padded_length


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets: ``[..., S] -> [..., S]`` with ``out[..., t] = labels[..., t + 1]``, ``ignore_index`` last."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def pad_sequence(x: torch.Tensor, length: int, value: int, dim: int = 1) -> torch.Tensor:
    """Pad ``x`` with ``value`` at the end of ``dim`` up to ``length`` (no copy when already that long)."""
    extra = length - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad a sequence of {x.shape[dim]} tokens down to {length}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


@dataclass
class SPShard:
    """One rank's share of a batch (all tensors ``[B, L]`` except ``index [L]``).

    Attributes:
        input_ids: this rank's token ids (padding = the pad id).
        position_ids: their global positions; always pass them to the model under SP.
        shift_labels: their next-token targets (-100 on padding and the sample's last token), or None.
        num_items_in_batch: valid targets (``!= ignore_index``) of the whole batch over all SP ranks, a
            0-d int64 tensor (None without labels): the loss denominator every SP rank shares.
        index: global token indices (into the padded sample) of this rank's tokens.
        seq_len: the unpadded sequence length S.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None
    num_items_in_batch: torch.Tensor | None
    index: torch.Tensor
    seq_len: int

    def model_kwargs(self) -> dict:
        """Keyword arguments for an HF causal LM.

        With labels, HF's ``ForCausalLMLoss`` then returns this rank's summed token loss divided by
        ``num_items_in_batch`` (the whole sample's valid count): the SP loss of :mod:`hf_fpdt.distributed.sp_loss`.
        ``labels`` is set only because HF computes a loss when ``labels is not None``; the shifted
        ``shift_labels`` take precedence, so nothing is shifted twice.
        """
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.shift_labels is not None:
            kwargs.update(
                labels=self.shift_labels,
                shift_labels=self.shift_labels,
                num_items_in_batch=self.num_items_in_batch,
            )
        return kwargs


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    rank: int,
    sp_size: int,
    chunk_size: int,
    position_ids: torch.Tensor | None = None,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    ring: int = 1,
) -> SPShard:
    """Cut the full batch ``input_ids [B, S]`` (and unshifted ``labels [B, S]``) into rank ``rank``'s shard.

    Args:
        input_ids: token ids of the whole batch, the same on every rank of the SP group.
        labels: unshifted labels (often ``input_ids`` with -100 on prompt/padding), or None.
        rank: this process's rank in the SP group.
        sp_size: the SP group size P.
        chunk_size: the attention's ``FPDTConfig.chunk_size`` (global tokens per chunk, an int).
        position_ids: ``[B, S]`` or ``[S]`` positions (or multimodal RoPE's ``[3 | 4, B, S]``); default
            ``arange(S)``. Each step along a row is +1, or a restart at 0 where a packed document begins.
        pad_id: token id of the padding appended to reach a multiple of P.
        ignore_index: label of tokens without a target.
        ring: the ring degree R of the SP group (``FPDTConfig.ring_degree`` resolved: :func:`hf_fpdt.config.sp_degrees`;
            1 = Ulysses alone).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"expected input_ids [batch, seq_len]; got shape {tuple(input_ids.shape)}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ValueError(f"chunk_size={chunk_size!r}: the layout needs the resolved integer chunk size")
    batch, seq_len = input_ids.shape
    total = padded_length(seq_len, sp_size)
    index = local_token_index(seq_len, chunk_size, sp_size, rank, ring).to(input_ids.device)
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device)
    # [B, S], or multimodal RoPE's [3 | 4, B, S] (Qwen2.5-VL / Qwen3-VL text positions): cut along the last axis
    position_ids = position_ids.expand(*position_ids.shape[:-2], batch, seq_len)
    if total > seq_len:  # padding continues every row's count
        tail = position_ids[..., -1:] + torch.arange(1, total - seq_len + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=-1)
    targets = count = None
    if labels is not None:
        full = shift_labels(labels, ignore_index)
        count = (full != ignore_index).sum()
        targets = pad_sequence(full, total, ignore_index)[:, index]
    return SPShard(
        input_ids=pad_sequence(input_ids, total, pad_id)[:, index],
        position_ids=position_ids[..., index],
        shift_labels=targets,
        num_items_in_batch=count,
        index=index,
        seq_len=seq_len,
    )


def unshard(pieces: Sequence[torch.Tensor], seq_len: int, chunk_size: int, dim: int = 1, ring: int = 1) -> torch.Tensor:
    """Inverse of the sharding: per-rank tensors (rank order) -> the global ``[..., S, ...]`` tensor.

    ``pieces[r]`` has this rank's L tokens along ``dim`` (e.g. logits ``[B, L, V]``); the result has the
    S real tokens along ``dim`` in global order (padding dropped). ``ring``: the layout's ring degree.
    """
    sp_size = len(pieces)
    index = torch.cat([local_token_index(seq_len, chunk_size, sp_size, r, ring) for r in range(sp_size)])
    stacked = torch.cat(list(pieces), dim=dim)
    out = torch.empty_like(stacked)
    out.index_copy_(dim, index.to(stacked.device), stacked)
    return out.narrow(dim, 0, seq_len)


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup | None, seq_len: int, chunk_size: int, dim: int = 1, ring: int = 1
) -> torch.Tensor:
    """All-gather every SP rank's ``local`` over ``group`` and :func:`unshard` it (not differentiable; bool as bool,
    though gloo gathers none). ``ring``: the layout's ring degree."""
    if local.dtype == torch.bool and group is not None and dist.get_world_size(group) > 1:
        return gather_sequence(local.to(torch.uint8), group, seq_len, chunk_size, dim, ring).bool()
    if group is None or dist.get_world_size(group) == 1:
        return unshard([local], seq_len, chunk_size, dim)
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, seq_len, chunk_size, dim, ring)
