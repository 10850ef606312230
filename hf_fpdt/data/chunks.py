"""The chunk plan shared by the data layout and the attention: one function, so both always agree.

With P ranks in the sequence-parallel group, each rank holds ``L = ceil(S / P)`` tokens (the sample is
padded at the end to ``P * L``). Each rank cuts its L tokens into local chunks of
``max(1, chunk_size // P)`` tokens, the last one shorter. Local chunk i of every rank has the same
length ``l_i``; their all-to-all forms global chunk i, ``P * l_i`` consecutive tokens of the sample.

FPDT's rank-ordinal layout (paper Fig. 6) follows: global chunk i starts at token ``P * o_i``
(``o_i`` = sum of the earlier ``l``), and rank r's local chunk i is its tokens
``[P*o_i + r*l_i, P*o_i + (r+1)*l_i)``.
"""

from __future__ import annotations

import math

import torch


def local_chunk_sizes(local_len: int, chunk_size: int, sp_size: int = 1) -> list[int]:
    """Lengths of a rank's local chunks (all equal but the last)."""
    if local_len < 1:
        raise ValueError(f"cannot chunk an empty sequence (local length {local_len})")
    per_rank = max(1, chunk_size // sp_size)
    n = math.ceil(local_len / per_rank)
    return [per_rank] * (n - 1) + [local_len - per_rank * (n - 1)]


def chunk_spans(sizes: list[int]) -> list[slice]:
    """The token range of each chunk along the local sequence: ``slice(o_i, o_i + l_i)``."""
    spans, offset = [], 0
    for size in sizes:
        spans.append(slice(offset, offset + size))
        offset += size
    return spans


def padded_length(seq_len: int, sp_size: int) -> int:
    """Length the sample is padded to so that every rank holds the same number of tokens."""
    return sp_size * math.ceil(seq_len / sp_size)


def local_token_index(seq_len: int, chunk_size: int, sp_size: int, rank: int) -> torch.Tensor:
    """Global token indices (into the padded sample) held by ``rank``, in its local order."""
    if not 0 <= rank < sp_size:
        raise ValueError(f"rank {rank} is outside the sequence-parallel group of size {sp_size}")
    local_len = padded_length(seq_len, sp_size) // sp_size
    pieces, offset = [], 0
    for size in local_chunk_sizes(local_len, chunk_size, sp_size):
        start = sp_size * offset + rank * size
        pieces.append(torch.arange(start, start + size))
        offset += size
    return torch.cat(pieces)
