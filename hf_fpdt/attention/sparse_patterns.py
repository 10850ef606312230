"""Block-sparse attention patterns (FPDT paper §5.6): masks a user writes once, and ready-made ones.

A pattern says which keys a query may see; a model's sliding window and packed documents still apply on
top of it. It is written as FlexAttention writes masks, a ``mask_mod``, causality included (``kv_idx <=
q_idx``)::

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor     # True = attend; global token indices

called with broadcast integer tensors, every batch row and head of the call at once (``b [B, 1, 1, 1]``,
``h [1, H, 1, 1]``, ``q_idx [Sq, 1]``, ``kv_idx [1, Sk]``; the result must broadcast to ``[B, H, Sq, Sk]``, and
be the same for every row and head: a pattern is shared by them, as the paper's). Optionally also at block
level, over token ranges (so that a long sequence is classified without evaluating the mask)::

    block_kind(q_start, q_end, kv_start, kv_end) -> "none" | "full" | "partial"

The chunk pipeline asks for each block (query chunk i, key chunk j) of the causal triangle: ``"none"``
blocks are skipped (no kernel, no fetch from the host store, no transfer, in forward and backward,
under offload and sequence parallelism), ``"full"`` blocks run the fast kernel, ``"partial"`` blocks the
masked path with the mask of that block alone (``[Sq, Sk]``, never ``S x S``). Without ``block_kind`` every
block of the ``[S, S]`` square is evaluated, tile by tile (O(S^2) work once per call: give a ``block_kind``
for long sequences; every ready-made pattern has one).

Every token must attend to itself (``mask_mod(b, h, t, t)`` true): a query with no key has no softmax.

``block_kind`` classifies the causal pairs of the block (``kv <= q``); ``"partial"`` is always a safe answer.
Patterns only remove keys from causal attention: a mask that lets a query see a later key (a prefix-LM's
bidirectional prefix) is refused, since the pipeline computes causal blocks only (query chunk i against
key chunks j <= i; FPDT's nested backward relies on it). What is evaluated and checked, once per call, and
what the backward reuses: :mod:`hf_fpdt.attention.block_mask`. :func:`evaluate` names the pattern where a
``mask_mod`` returns something else than a bool tensor of that shape, depends on ``b`` or ``h``, or gives two
evaluations of the same tile different values.

Ready-made patterns (each ``pure``, with its exact ``block_kind``): :func:`local_global` (a window plus global
tokens), :func:`strided`, :func:`chunked` (Llama 4's ``attention_chunk_size``) and :func:`block_random`
(blocks kept at a density, seeded: the same on every rank).

``FPDTConfig(attention_pattern=...)`` takes a pattern, a bare ``mask_mod``, or per layer a dict
``{layer_idx: pattern or None}`` (layers not named stay dense); see :func:`pattern_for_layer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BlockKind = Callable[[int, int, int, int], str]
KINDS = ("none", "full", "partial")
_TILE = 2048  # rows/columns of mask evaluated at once, at most
_TILE_VALUES = 1 << 26  # (b, h, q, kv) values of one evaluation at most (the tile shrinks with batch x heads)
_EXPECTED = (
    "mask_mod(b, h, q_idx, kv_idx) must return a bool tensor that broadcasts to [batch, heads, q_idx, kv_idx] "
    "(FlexAttention's mask_mod; e.g. (kv_idx <= q_idx) & ...)"
)


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
        pure: a promise that ``mask_mod`` is a pure function of ``(q_idx, kv_idx)``, causal and the same for
            every row and head (the ready-made patterns are): its cut blocks are evaluated where they are used,
            in forward and again in backward, instead of being kept between them, and (with a ``block_kind``)
            only the diagonal is checked. ``False`` (default): one evaluation per call, checked, whose cut
            blocks the backward reuses (:class:`hf_fpdt.attention.block_mask.BlockMask`).
    """

    mask_mod: MaskMod
    block_kind: BlockKind | None = None
    name: str = "custom"
    pure: bool = False

    def keep(
        self, qs: int, qe: int, ks: int, ke: int, device: torch.device, batch: int = 1, heads: int = 1
    ) -> torch.Tensor:
        """``[qe - qs, ke - ks]`` bool mask of the pattern alone (True = attend): one evaluation per tile, over
        ``batch`` rows and ``heads`` heads at once, checked to be the same for each (:func:`evaluate`)."""
        out = torch.empty(qe - qs, ke - ks, dtype=torch.bool, device=device)
        for a, b, tile in tiles(self, qs, qe, ks, ke, batch, heads, device):
            out[a - qs : a - qs + tile.shape[0], b - ks : b - ks + tile.shape[1]] = tile
        return out

    def kind(self, qs: int, qe: int, ks: int, ke: int) -> str:
        """What the pattern keeps of the keys ``[ks, ke)`` for the queries ``[qs, qe)``, before causality."""
        if self.block_kind is not None:
            return declared_kind(self, qs, qe, ks, ke)
        seen_true = seen_false = False
        for _, _, tile in tiles(self, qs, qe, ks, ke):
            seen_true = seen_true or bool(tile.any())
            seen_false = seen_false or not bool(tile.all())
            if seen_true and seen_false:
                return "partial"
        return "full" if seen_true else "none"


def declared_kind(pattern: SparsePattern, qs: int, qe: int, ks: int, ke: int) -> str:
    """``pattern.block_kind`` of a block, checked to be one of :data:`KINDS`."""
    kind = pattern.block_kind(qs, qe, ks, ke)
    if kind not in KINDS:
        raise ValueError(f"attention pattern {pattern.name!r}: block_kind returned {kind!r}; use one of {KINDS}")
    return kind


def diagonal(pattern: SparsePattern, length: int) -> torch.Tensor:
    """``[length]`` bool: whether ``mask_mod`` keeps each token's own key (one call, ``b = h = 0``)."""
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    t = torch.arange(length)
    return _call(pattern, (zero, zero, t, t), (1, 1, 1, length)).reshape(-1).expand(length)


def tile_side(batch: int, heads: int) -> int:
    """Rows (and columns) of one ``mask_mod`` evaluation over ``batch`` rows and ``heads`` heads."""
    return min(_TILE, max(16, math.isqrt(_TILE_VALUES // max(1, batch * heads))))


def tiles(
    pattern: SparsePattern,
    qs: int,
    qe: int,
    ks: int,
    ke: int,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | None = None,
):
    """``(q_start, kv_start, [Tq, Tk] bool)`` for each tile of the queries ``[qs, qe)`` and keys ``[ks, ke)``:
    ``mask_mod`` evaluated once per tile (:func:`evaluate`)."""
    side = tile_side(batch, heads)
    for a in range(qs, qe, side):
        for b in range(ks, ke, side):
            yield a, b, evaluate(pattern, a, min(qe, a + side), b, min(ke, b + side), batch, heads, device)


def evaluate(
    pattern: SparsePattern,
    qs: int,
    qe: int,
    ks: int,
    ke: int,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``[qe - qs, ke - ks]`` bool: what ``mask_mod`` keeps of the queries ``[qs, qe)`` and keys ``[ks, ke)``, for
    every batch row ``b < batch`` and head ``h < heads`` at once, in one call: ``mask_mod(b [batch, 1, 1, 1],
    h [1, heads, 1, 1], q_idx [Sq, 1], kv_idx [1, Sk])``.

    Raises ``ValueError`` naming the pattern where the call raises, where it returns anything but a bool tensor
    that broadcasts to ``[batch, heads, Sq, Sk]``, and where its values differ between rows or heads (then the
    tile is evaluated once more, to tell a mask that depends on ``b`` or ``h`` from one that is not a pure
    function: random, or changing between calls).
    """
    device = torch.device("cpu") if device is None else device
    full = (batch, heads, qe - qs, ke - ks)
    args = (
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        torch.arange(heads, device=device).view(1, -1, 1, 1),
        torch.arange(qs, qe, device=device).unsqueeze(1),
        torch.arange(ks, ke, device=device).unsqueeze(0),
    )
    out = _call(pattern, args, full)
    out = out.view((1,) * (4 - out.dim()) + tuple(out.shape))  # [1 | batch, 1 | heads, 1 | Sq, 1 | Sk]
    if out.shape[0] > 1 or out.shape[1] > 1:
        differs = out != out[:1, :1]
        if bool(differs.any()):
            _refuse_dependent(pattern, args, full, out, differs, (qs, ks))
        out = out[:1, :1]
    return out[0, 0].expand(qe - qs, ke - ks)


def _call(pattern: SparsePattern, args: tuple, full: tuple) -> torch.Tensor:
    """``mask_mod(*args)``, checked to be a bool tensor that broadcasts to ``full``."""
    shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in zip(("b", "h", "q_idx", "kv_idx"), args))
    try:
        out = pattern.mask_mod(*args)
    except Exception as e:
        raise ValueError(
            f"attention pattern {pattern.name!r}: mask_mod raised {type(e).__name__}: {e} when called with "
            f"broadcast index tensors ({shapes}); {_EXPECTED}, written with tensor operations (no Python `if` "
            "on an index, no .item())"
        ) from e
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"attention pattern {pattern.name!r}: mask_mod returned {type(out).__name__} {out!r:.60}, not a "
            f"tensor; {_EXPECTED}"
        )
    if out.dtype != torch.bool:
        raise ValueError(
            f"attention pattern {pattern.name!r}: mask_mod returned a {out.dtype} tensor; {_EXPECTED} (compare the "
            "indices, e.g. q_idx - kv_idx < 128, rather than return a number)"
        )
    if out.dim() > 4 or any(n not in (1, f) for n, f in zip(reversed(out.shape), reversed(full))):
        raise ValueError(
            f"attention pattern {pattern.name!r}: mask_mod returned a tensor of shape {list(out.shape)} for "
            f"{shapes}; {_EXPECTED}, here {list(full)}"
        )
    return out


def _refuse_dependent(pattern, args, full, out, differs, origin) -> None:
    """The error for a tile whose values differ between rows or heads: impure, or dependent on b / h."""
    again = _call(pattern, args, full)
    again = again.view((1,) * (4 - again.dim()) + tuple(again.shape))
    if again.shape != out.shape or not torch.equal(again, out):
        at = ""
        if again.shape == out.shape:
            b, h, t, u = (again != out).nonzero()[0].tolist()
            at = f" (e.g. b={b}, h={h}, q_idx={origin[0] + t}, kv_idx={origin[1] + u})"
        raise ValueError(
            f"attention pattern {pattern.name!r}: mask_mod returns different values for the same (b, h, q_idx, "
            f"kv_idx) on two evaluations{at}: mask_mod must be a pure function of its arguments (no random "
            "numbers, no state that changes between calls); for random sparsity use "
            "hf_fpdt.patterns.block_random (seeded)"
        )
    b, h, t, u = differs.nonzero()[0].tolist()
    what = "head index" if h > 0 else "batch row"
    raise ValueError(
        f"attention pattern {pattern.name!r} depends on the {what}: mask_mod(b={b}, h={h}, q_idx={origin[0] + t}, "
        f"kv_idx={origin[1] + u}) is {bool(out[b, h, t, u])}, for b=0, h=0 it is {bool(out[0, 0, t, u])}; a "
        "block-sparse pattern may not depend on the batch row or head index (hf_fpdt shares it across rows and "
        "heads, as the FPDT paper does): write mask_mod without b and h, or use sdpa for per-row or per-head masks"
    )


def as_pattern(value: SparsePattern | MaskMod) -> SparsePattern:
    """A :class:`SparsePattern` from a pattern or a bare ``mask_mod`` (checked at each call over the whole
    sequence, every row and head: :class:`hf_fpdt.attention.block_mask.BlockMask`)."""
    pattern = value if isinstance(value, SparsePattern) else SparsePattern(value) if callable(value) else None
    if pattern is None:
        raise ValueError(
            f"attention_pattern={value!r}: use a hf_fpdt.attention.sparse_patterns.SparsePattern, a mask_mod "
            "(b, h, q_idx, kv_idx) -> bool, or a dict {layer_idx: pattern or None}"
        )
    return pattern


def both(first: SparsePattern | None, second: SparsePattern | None) -> SparsePattern | None:
    """The pattern that keeps what both keep (either alone where the other is None). The AND of two patterns is
    evaluated over every block (no ``block_kind``), once per call, as a ``mask_mod`` given without one."""
    if first is None or second is None:
        return first if second is None else second

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return first.mask_mod(b, h, q_idx, kv_idx) & second.mask_mod(b, h, q_idx, kv_idx)

    return SparsePattern(mask_mod, name=f"{first.name} & {second.name}", pure=first.pure and second.pure)


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

    return SparsePattern(mask_mod, block_kind, f"local_global(window={window}, global={global_tokens})", pure=True)


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

    return SparsePattern(mask_mod, block_kind, f"strided(stride={stride}, window={window})", pure=True)


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

    return SparsePattern(mask_mod, block_kind, f"chunked({chunk})", pure=True)


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

    name = f"block_random(density={density}, block={block}, seed={seed})"
    return SparsePattern(mask_mod, block_kind, name, pure=True)
