"""The chunk plan shared by the data layout and the attention: one function, so both always agree.

With P ranks in the sequence-parallel group, each rank holds ``L = ceil(S / P)`` tokens (the sample is
padded at the end to ``P * L``). Each rank cuts its L tokens into local chunks of
``max(1, chunk_size // P)`` tokens, the last one shorter. Local chunk i of every rank has the same
length ``l_i``; their all-to-all forms global chunk i, ``P * l_i`` consecutive tokens of the sample.

FPDT's rank-ordinal layout (paper Fig. 6) follows: global chunk i starts at token ``P * o_i``
(``o_i`` = sum of the earlier ``l``), and rank r's local chunk i is its tokens
``[P*o_i + r*l_i, P*o_i + (r+1)*l_i)``.

With a ring (``ring`` = R > 1; the SP group is R Ulysses groups of U = P / R ranks, :mod:`hf_fpdt.attention.ring`),
``P * l_i`` consecutive tokens form *round* i, cut into R global chunks of ``U * l_i`` tokens: round i holds global
chunks ``i*R .. i*R + R - 1``. Ulysses group g (SP ranks ``g*U .. g*U + U - 1``) takes the one at position g of the
round on even rounds and ``R - 1 - g`` on odd ones (zig-zag: over two rounds every group holds as many causal
blocks as any other), and inside it the rank-ordinal layout holds: SP rank ``g*U + u`` gets its tokens
``[u*l_i, (u+1)*l_i)``. R = 1 is the layout above.
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


def ring_position(i: int, group: int, ring: int) -> int:
    """The place in round ``i`` (0 .. ring - 1) of Ulysses group ``group``'s global chunk: zig-zag."""
    return group if i % 2 == 0 else ring - 1 - group


def ring_chunk(i: int, group: int, ring: int) -> int:
    """The global chunk index of Ulysses group ``group``'s local chunk ``i`` (``i`` itself without a ring)."""
    return i * ring + ring_position(i, group, ring)


def ring_chunk_sizes(sizes: list[int], ulysses: int, ring: int) -> list[int]:
    """Tokens of every global chunk, in global order, from the local chunk lengths ``sizes`` (round i: ``ring``
    chunks of ``ulysses * sizes[i]``)."""
    return [ulysses * n for n in sizes for _ in range(ring)]


def check_ring(sp_size: int, ring: int) -> None:
    """Raise ``ValueError`` unless ``ring`` divides ``sp_size``."""
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1 or sp_size % ring:
        raise ValueError(f"ring_degree={ring!r} must be a positive divisor of sp_size={sp_size}")


def local_token_index(seq_len: int, chunk_size: int, sp_size: int, rank: int, ring: int = 1) -> torch.Tensor:
    """Global token indices (into the padded sample) held by ``rank``, in its local order (``ring``: the ring
    degree R, see the module docstring)."""
    if not 0 <= rank < sp_size:
        raise ValueError(f"rank {rank} is outside the sequence-parallel group of size {sp_size}")
    check_ring(sp_size, ring)
    ulysses = sp_size // ring
    group, u = divmod(rank, ulysses)
    local_len = padded_length(seq_len, sp_size) // sp_size
    pieces, offset = [], 0
    for i, size in enumerate(local_chunk_sizes(local_len, chunk_size, sp_size)):
        start = sp_size * offset + ring_position(i, group, ring) * ulysses * size + u * size
        pieces.append(torch.arange(start, start + size))
        offset += size
    return torch.cat(pieces)
