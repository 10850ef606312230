"""Block-sparse attention patterns (FPDT paper §5.6): masks a user writes once, and ready-made ones.

A pattern says which keys a query may see; a model's sliding window and packed documents still apply on
top of it. It is written as FlexAttention writes masks, a ``mask_mod``, causality included (``kv_idx <=
q_idx``)::

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor     # True = attend; global token indices

called with broadcastable integer tensors (``q_idx [Sq, 1]``, ``kv_idx [1, Sk]``, ``b`` and ``h`` zero: a
pattern is the same for every row and head, as the paper's). Optionally also at block level, over token
ranges (so that a long sequence is classified without evaluating the mask)::

    block_kind(q_start, q_end, kv_start, kv_end) -> "none" | "full" | "partial"

The chunk pipeline asks for each block (query chunk i, key chunk j) of the causal triangle: ``"none"``
blocks are skipped (no kernel, no fetch from the host store, no transfer, in forward and backward,
under offload and sequence parallelism), ``"full"`` blocks run the fast kernel, ``"partial"`` blocks the
masked path with the mask of that block alone (``[Sq, Sk]``, never ``S x S``). Without ``block_kind`` the
block is classified by evaluating ``mask_mod`` over it, tile by tile (O(S^2) work once per call: give a
``block_kind`` for long sequences; every ready-made pattern has one).

Every token must attend to itself (``mask_mod(b, h, t, t)`` true): a query with no key has no softmax.

``block_kind`` classifies the causal pairs of the block (``kv <= q``); ``"partial"`` is always a safe answer.
Patterns only remove keys from causal attention: a mask that lets a query see a later key (a prefix-LM's
bidirectional prefix) is refused, since the pipeline computes causal blocks only (query chunk i against
key chunks j <= i; FPDT's nested backward relies on it). Checked per call on each chunk's first tokens,
with every token's own key (which must be kept).

Ready-made patterns (each with its exact ``block_kind``): :func:`local_global` (a window plus global
tokens), :func:`strided`, :func:`chunked` (Llama 4's ``attention_chunk_size``) and :func:`block_random`
(blocks kept at a density, seeded: the same on every rank).

``FPDTConfig(attention_pattern=...)`` takes a pattern, a bare ``mask_mod``, or per layer a dict
``{layer_idx: pattern or None}`` (layers not named stay dense); see :func:`pattern_for_layer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BlockKind = Callable[[int, int, int, int], str]
KINDS = ("none", "full", "partial")
_TILE = 2048  # rows/columns of mask evaluated at once when a block is classified from its mask_mod


@dataclass(frozen=True)
class SparsePattern:
    """An attention pattern: ``mask_mod`` (token level), optional ``block_kind`` (token ranges).

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` tensor, True where the query attends the key.
        block_kind: ``(q_start, q_end, kv_start, kv_end) -> "none" | "full" | "partial"``: what ``mask_mod``
            keeps of the causal pairs (key <= query) of the keys ``[kv_start, kv_end)`` and queries
            ``[q_start, q_end)``;
            ``None``: classified by evaluating ``mask_mod`` over the block.
        name: shown in errors and benchmark tables.
    """

    mask_mod: MaskMod
    block_kind: BlockKind | None = None
    name: str = "custom"

    def keep(self, qs: int, qe: int, ks: int, ke: int, device: torch.device) -> torch.Tensor:
        """``[qe - qs, ke - ks]`` bool mask of the pattern alone (True = attend)."""
        t = torch.arange(qs, qe, device=device).unsqueeze(1)
        u = torch.arange(ks, ke, device=device).unsqueeze(0)
        zero = torch.zeros((), dtype=torch.long, device=device)
        out = torch.as_tensor(self.mask_mod(zero, zero, t, u), device=device)
        if out.dtype != torch.bool:
            raise ValueError(f"attention pattern {self.name!r}: mask_mod must return a bool tensor, got {out.dtype}")
        return out.expand(qe - qs, ke - ks)

    def kind(self, qs: int, qe: int, ks: int, ke: int) -> str:
        """What the pattern keeps of the keys ``[ks, ke)`` for the queries ``[qs, qe)``, before causality."""
        if self.block_kind is not None:
            kind = self.block_kind(qs, qe, ks, ke)
            if kind not in KINDS:
                raise ValueError(f"attention pattern {self.name!r}: block_kind returned {kind!r}; use one of {KINDS}")
            return kind
        seen_true = seen_false = False
        for a in range(qs, qe, _TILE):
            for b in range(ks, ke, _TILE):
                tile = self.keep(a, min(qe, a + _TILE), b, min(ke, b + _TILE), torch.device("cpu"))
                seen_true = seen_true or bool(tile.any())
                seen_false = seen_false or not bool(tile.all())
                if seen_true and seen_false:
                    return "partial"
        return "full" if seen_true else "none"


def as_pattern(value: SparsePattern | MaskMod) -> SparsePattern:
    """A :class:`SparsePattern` from a pattern or a bare ``mask_mod`` (checked: shared by rows and heads)."""
    pattern = value if isinstance(value, SparsePattern) else SparsePattern(value) if callable(value) else None
    if pattern is None:
        raise ValueError(
            f"attention_pattern={value!r}: use a hf_fpdt.core.sparse_patterns.SparsePattern, a mask_mod "
            "(b, h, q_idx, kv_idx) -> bool, or a dict {layer_idx: pattern or None}"
        )
    q = torch.arange(64).unsqueeze(1)
    kv = torch.arange(64).unsqueeze(0)
    base = pattern.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    for b, h in ((1, 0), (0, 1), (3, 5)):
        if not torch.equal(pattern.mask_mod(torch.tensor(b), torch.tensor(h), q, kv), base):
            raise ValueError(
                f"attention pattern {pattern.name!r} depends on the batch row or head index; hf_fpdt's block-sparse "
                "patterns are shared by every row and head (as the FPDT paper's): write mask_mod without b and h"
            )
    return pattern


def pattern_for_layer(setting: object, layer_idx: int | None) -> SparsePattern | None:
    """The pattern of one layer from ``FPDTConfig.attention_pattern`` (``None``: dense causal)."""
    if setting is None:
        return None
    if isinstance(setting, Mapping):
        if layer_idx is None:
            raise ValueError(
                "attention_pattern is given per layer but this attention module has no layer_idx; give one "
                "pattern for every layer instead"
            )
        value = setting.get(layer_idx)
        return None if value is None else as_pattern(value)
    return as_pattern(setting)


# --- ready-made patterns ------------------------------------------------------------------------------


def local_global(window: int, global_tokens: int) -> SparsePattern:
    """Each query sees the last ``window`` keys (itself included) and the first ``global_tokens`` keys
    (Longformer/BigBird's local + global attention for a causal model)."""
    if window < 1 or global_tokens < 0:
        raise ValueError(f"local_global(window={window}, global_tokens={global_tokens}): window >= 1, global >= 0")

    def mask_mod(b, h, q, kv):
        return (kv <= q) & ((q - kv < window) | (kv < global_tokens))

    def block_kind(qs, qe, ks, ke):
        if ke <= global_tokens:
            return "full"
        in_window_all = qe - 1 - ks < window  # the farthest pair is inside the window
        in_window_any = qs - (ke - 1) < window  # the nearest pair is
        if in_window_all:
            return "full"
        if in_window_any or ks < global_tokens:
            return "partial"
        return "none"

    return SparsePattern(mask_mod, block_kind, f"local_global(window={window}, global={global_tokens})")


def strided(stride: int, window: int | None = None) -> SparsePattern:
    """Sparse Transformer's strided pattern: a query sees the keys whose distance is a multiple of
    ``stride``, and the last ``window`` keys (default ``stride``)."""
    window = stride if window is None else window
    if stride < 1 or window < 1:
        raise ValueError(f"strided(stride={stride}, window={window}): both must be at least 1")

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (((q - kv) % stride == 0) | (q - kv < window))

    def block_kind(qs, qe, ks, ke):
        lo, hi = max(0, qs - (ke - 1)), qe - 1 - ks  # every causal query-key distance in between occurs
        if hi < window or stride == 1:
            return "full"
        return "partial" if lo < window or (hi // stride) * stride >= lo else "none"

    return SparsePattern(mask_mod, block_kind, f"strided(stride={stride}, window={window})")


def chunked(chunk: int) -> SparsePattern:
    """Chunked attention (Llama 4's ``attention_chunk_size``): a query sees only the keys of its own
    ``chunk``-token chunk of the sequence."""
    if chunk < 1:
        raise ValueError(f"chunked(chunk={chunk}): chunk >= 1")

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q // chunk == kv // chunk)

    def block_kind(qs, qe, ks, ke):
        q_lo, q_hi, k_lo, k_hi = qs // chunk, (qe - 1) // chunk, ks // chunk, (ke - 1) // chunk
        if q_hi < k_lo or k_hi < q_lo:
            return "none"
        return "full" if q_lo == q_hi == k_lo == k_hi else "partial"

    return SparsePattern(mask_mod, block_kind, f"chunked({chunk})")


_MASK31 = (1 << 31) - 1


def _hash(a: torch.Tensor, b: torch.Tensor, seed: int) -> torch.Tensor:
    """A 31-bit integer hash of (a, b, seed): the same on every machine (int64 arithmetic, no overflow)."""
    x = (a * 1103515245 + b * 12345 + (seed & _MASK31) * 2654435) & _MASK31
    for mul in (1664525, 22695477, 69069):
        x = ((x ^ (x >> 13)) * mul) & _MASK31
    return x ^ (x >> 16)


def block_random(density: float, block: int, seed: int = 0) -> SparsePattern:
    """Random block sparsity: the sequence cut into blocks of ``block`` tokens, each (query block, key
    block) pair below the diagonal kept with probability ``density`` (a seeded hash of the pair: every
    rank and every call agree without communication); diagonal blocks are always kept. Blocks aligned
    with the chunk size make whole chunk blocks skippable."""
    if not 0.0 <= density <= 1.0 or block < 1:
        raise ValueError(f"block_random(density={density}, block={block}): density in [0, 1], block >= 1")
    threshold = int(density * (1 << 24))

    def kept(qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
        return (qb == kb) | ((_hash(qb, kb, seed) & ((1 << 24) - 1)) < threshold)

    def mask_mod(b, h, q, kv):
        return (kv <= q) & kept(q // block, kv // block)

    def block_kind(qs, qe, ks, ke):
        qb = torch.arange(qs // block, (qe - 1) // block + 1).unsqueeze(1)
        kb = torch.arange(ks // block, (ke - 1) // block + 1).unsqueeze(0)
        k = kept(qb, kb)
        return "full" if bool(k.all()) else "partial" if bool(k.any()) else "none"

    return SparsePattern(mask_mod, block_kind, f"block_random(density={density}, block={block}, seed={seed})")
