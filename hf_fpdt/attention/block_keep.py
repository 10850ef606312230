"""The mask of one cut block, built a slice of query rows at a time: never the whole ``[Sq, Sk]`` of a block.

A block only partly inside the pattern of a call (:mod:`hf_fpdt.attention.block_mask`: a window shorter than the
chunk, a document boundary, a padding key, a sparse pattern's cut block, a 4D mask) is handed to the kernels as a
:class:`BlockKeep`: the block's structure (its token ranges, window, document ids, key mask, the rows of a 4D mask,
the sparse pattern or its evaluation's packed bits), from which :meth:`BlockKeep.rows` builds the bool mask of
``n`` query rows, ``[n, Sk]`` or ``[B, n, Sk]``. The kernels call it inside their loop over query-row slices
(:mod:`hf_fpdt.attention.math_blocks`; the ``cpu_flash`` kernel's masked path in :mod:`hf_fpdt.attention.kernels`),
so a masked block holds one slice's mask at a time, as it holds one slice's scores: O(chunk) memory, not
O(chunk^2) (at a 16K chunk one block's whole bool mask is 256 MiB, its temporaries several times that).

The pieces of a block reach the device once per block (:meth:`hf_fpdt.attention.block_mask.BlockMask.block`):
document ids and the key mask as their ``[B, Sq]`` / ``[B, Sk]`` slices, a sparse evaluation's packed bits
(``Sq * Sk / 8`` bytes, from pinned host memory, ``non_blocking``); a 4D mask is the caller's tensor, read a row
slice at a time where it lies. Layouts: a mask is ``[Sq, Sk]`` (every batch row alike) or ``[B | 1, Sq, Sk]`` (with
documents, a key mask or a 4D mask), True = attend, as a materialised mask of the same block would be.

A block cut by its window alone (no documents, key mask, 4D mask or sparse pattern) is a band:
:meth:`BlockKeep.window_only` gives it as a :class:`WindowBand`, the rectangle of rows and keys that see anything and,
inside it, the band's offsets aligned to the rectangle's bottom-right corner, as flash-attn's ``window_size`` takes
them (the kernels run such a block on a flash-attn build with a window instead of on ``math``).

A block cut by document boundaries (packed sequences; with or without a window, nothing else) is a set of
independent attentions, one per (batch row, document) present on both sides of it: :meth:`BlockKeep.documents`
gives them as :class:`DocSegments`, each a (query rows, keys) rectangle with flash-attn's ``window_size`` inside it,
which the kernels pack as one varlen batch (``cu_seqlens_q`` / ``cu_seqlens_k``) for a flash-attn build's varlen
entry points instead of running the block on ``math``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sparse_patterns import SparsePattern


@dataclass(frozen=True)
class WindowBand:
    """A window-only block's keep pattern as a band inside one rectangle of the block.

    Query rows ``[r0, r1)`` are exactly the rows that keep some key, keys ``[c0, c1)`` exactly the keys some of them
    keep; outside the rectangle nothing is kept. Inside it (``r' = r - r0``, ``c' = c - c0``, ``n = r1 - r0``,
    ``m = c1 - c0``), flash-attn's bottom-right aligned window: row ``r'`` keeps ``c'`` iff
    ``r' + m - n - left <= c' <= r' + m - n + right``, with ``left >= 0`` always and ``right = -1`` for no upper bound
    (``right >= 0`` otherwise). Every row of the rectangle keeps at least one key (flash-attn reports an empty row's
    log-sum-exp as ``+inf``, which would not merge as nothing). An empty rectangle (``r0 == r1``): nothing is kept.
    """

    r0: int
    r1: int
    c0: int
    c1: int
    left: int
    right: int

    @property
    def window_size(self) -> tuple[int, int]:
        """``(left, right)``: flash-attn's ``window_size`` for the rectangle."""
        return self.left, self.right


@dataclass(frozen=True)
class DocSegment:
    """One (batch row, document) attention of a document-cut block: query rows ``[r0, r1)`` of batch row ``row``
    against its keys ``[c0, c1)``, with flash-attn's bottom-right aligned ``window_size`` ``(left, right)`` inside that
    rectangle (``(-1, -1)``: no window; the call's causal flag applies on top, as :attr:`DocSegments.causal` says).
    Every row of the rectangle keeps at least one key."""

    row: int
    r0: int
    r1: int
    c0: int
    c1: int
    window: tuple[int, int] = (-1, -1)


@dataclass(frozen=True)
class DocSegments:
    """A document-cut block as independent per-document attentions (:meth:`BlockKeep.documents`).

    ``segments`` in order of (batch row, query row); their query rows are disjoint, and so are their keys (a token
    is in one document). ``causal``: flash-attn's causal flag for every segment (the diagonal block without a
    window: each segment's queries and keys are the same tokens, so bottom-right aligned causal is the causal mask);
    with a window the causal bound is inside each segment's ``window`` and ``causal`` is False. Query rows in no
    segment keep no key of the block (``out = 0``, ``lse = -inf``); keys in none are kept by no row."""

    causal: bool
    segments: tuple[DocSegment, ...]


@dataclass(frozen=True, eq=False)
class BlockKeep:
    """The keep pattern of query tokens ``[qs, qs + sq)`` against key tokens ``[ks, ks + sk)`` (global indices).

    Args:
        qs, ks, sq, sk: the block's first query and key tokens and their counts.
        causal: keep key u only where ``u <= t`` (the diagonal block; every key of an earlier chunk precedes
            every query of a later one).
        window: HF's ``sliding_window``: keep u only where ``u > t - window`` (``None``: no window).
        docs_q, docs_k: ``[B, sq]`` / ``[B, sk]`` segment ids of the queries and keys: keep only pairs of one segment
            (``None``: one segment).
        keys: ``[B, sk]`` bool, False on padding keys (``None``: every key counts).
        dense: ``[B | 1, sq, sk]``: the block's rows of a 4D mask (bool keep, or additive float with 0 kept), a view
            of the caller's tensor (``None``: none).
        sparse: a pure sparse pattern evaluated per slice (``None``: none, or ``packed``).
        packed: the sparse pattern's evaluation of this block, ``[sq, sk]`` row-major, 8 to a byte (uint8), on the
            kernels' device, with ``bits`` the shift table ``arange(8)`` there.
        host_docs: ``(docs_q, docs_k)`` on the host (views of the call's one host copy,
            :class:`~hf_fpdt.attention.block_mask.BlockMask`), which :meth:`documents` reads without a device sync
            (``None``: it reads ``docs_q`` / ``docs_k``).
    """

    qs: int
    ks: int
    sq: int
    sk: int
    causal: bool = False
    window: int | None = None
    docs_q: torch.Tensor | None = None
    docs_k: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    sparse: SparsePattern | None = None
    packed: torch.Tensor | None = None
    bits: torch.Tensor | None = None
    host_docs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole mask: ``(sq, sk)``, or ``(B | 1, sq, sk)`` with a batch dimension."""
        rows = [t.shape[0] for t in (self.docs_q, self.keys, self.dense) if t is not None]
        return (max(rows), self.sq, self.sk) if rows else (self.sq, self.sk)

    def dim(self) -> int:
        """2 (``[Sq, Sk]``) or 3 (``[B | 1, Sq, Sk]``), as the materialised mask's ``dim()``."""
        return len(self.shape)

    def rows(self, r: int, n: int, device: torch.device) -> torch.Tensor:
        """The bool mask of the block's query rows ``[r, r + n)``: ``[n, sk]`` or ``[B | 1, n, sk]`` (True = attend).
        Every temporary is of that size (the row and column indices are ``[n, 1]`` and ``[1, sk]``)."""
        keep = None
        if self.causal or self.window is not None:
            t = torch.arange(self.qs + r, self.qs + r + n, device=device)[:, None]
            u = torch.arange(self.ks, self.ks + self.sk, device=device)[None, :]
            if self.causal:
                keep = u <= t
            if self.window is not None:
                inside = u > t - self.window
                keep = inside if keep is None else keep.logical_and_(inside)
        if self.packed is not None:
            keep = _and(keep, unpack_rows(self.packed, self.bits, self.sk, r, n))
        elif self.sparse is not None:
            qs = self.qs + r
            keep = _and(keep, self.sparse.keep(qs, qs + n, self.ks, self.ks + self.sk, device))
        if self.docs_q is not None:
            same = self.docs_q[:, r : r + n, None].to(device) == self.docs_k[:, None, :].to(device)
            keep = same if keep is None else same.logical_and_(keep)
        if self.keys is not None:
            keep = _and(keep, self.keys[:, None, :].to(device))
        if self.dense is not None:
            m = self.dense[:, r : r + n].to(device)
            keep = _and(keep, m if m.dtype == torch.bool else m == 0)
        if keep is None:
            return torch.ones(n, self.sk, dtype=torch.bool, device=device)
        if keep.shape[-2] != n:  # the key mask alone: the same for every row, made [B, n, sk]
            keep = keep.expand(*keep.shape[:-2], n, self.sk).clone()
        return keep

    def window_only(self) -> WindowBand | None:
        """The block as a :class:`WindowBand` where its window is the only cut (with or without the causal bound);
        ``None`` where documents, a key mask, a 4D mask or a sparse pattern cut it too, or it has no window.

        With ``d = qs - ks``, row r keeps key c iff ``r + d - window < c`` (and ``c <= r + d`` if causal) and
        ``0 <= c < sk``: a band of slope one. The rows keeping anything are an interval; the band's last row fixes
        the alignment (its kept keys end at ``c1 - 1``), so ``left = c1 - 1 - lo`` and ``right = hi - (c1 - 1)``
        for that row's bounds ``lo = r + d - window + 1``, ``hi = r + d``: both >= 0 (the row keeps something)."""
        if self.window is None or any(
            t is not None for t in (self.docs_q, self.docs_k, self.keys, self.dense, self.sparse, self.packed)
        ):
            return None
        d, w = self.qs - self.ks, self.window
        r0 = max(0, -d) if self.causal else 0  # causal: row r keeps nothing before key 0 when r + d < 0
        r1 = max(r0, min(self.sq, self.sk - d + w - 1))  # lo(r) = r + d - w + 1 <= sk - 1
        if r1 == r0:
            return WindowBand(0, 0, 0, 0, 0, -1)
        last = r1 - 1
        lo, hi = last + d - w + 1, last + d
        c0 = max(0, r0 + d - w + 1)
        c1 = min(self.sk, hi + 1) if self.causal else self.sk
        return WindowBand(r0, r1, c0, c1, c1 - 1 - lo, hi - (c1 - 1) if self.causal else -1)

    def documents(self) -> DocSegments | None:
        """The block as :class:`DocSegments` where documents cut it (with or without a window; no key mask, 4D mask
        or sparse pattern), else ``None``; also ``None`` where a document is not one run of tokens in the block's
        queries or keys (ids not contiguous: a varlen sequence is one run).

        Vectorised over tokens: the runs of equal ids of ``docs_q`` and ``docs_k`` come from one ``diff`` and
        ``nonzero`` each, on the host copy of the ids the block mask hands over (``host_docs``: no device sync;
        without it one small read of ``docs_q`` / ``docs_k``, O(documents)); the loop runs over the runs. A run of
        queries and a run of keys of one (row, id) make a segment. On the diagonal block (``causal``) the queries and
        keys are the same tokens, so a document's two runs are the same interval ``[a, b)``: equal extents and
        positions, and flash-attn's bottom-right aligned causal mask (row i keeps key j iff ``j <= i + m - n`` with
        ``n = m``) is the causal mask ``u <= t``. Off the diagonal every key precedes every query: no causal bound.
        A window is the :meth:`window_only` band of each segment's own (query run, key run) sub-block; segments
        whose band is empty are left out."""
        if self.docs_q is None or any(t is not None for t in (self.keys, self.dense, self.sparse, self.packed)):
            return None
        if self.causal and (self.qs, self.sq) != (self.ks, self.sk):
            return None  # a causal block is the diagonal one; any other is no pipeline block: no alignment guessed
        ids_q, ids_k = self.host_docs if self.host_docs is not None else (self.docs_q, self.docs_k)
        qruns, kruns = _runs(ids_q), _runs(ids_k)
        if qruns is None or kruns is None:
            return None
        keys = {(row, doc): (c0, c1) for row, c0, c1, doc in kruns}
        segments = []
        for row, r0, r1, doc in qruns:  # one pass over the documents, not the tokens
            if (row, doc) not in keys:
                continue
            c0, c1 = keys[row, doc]
            if self.causal and (c0, c1) != (r0, r1):
                return None  # the same tokens with other ids on the two sides: not one document layout
            if self.window is None:
                segments.append(DocSegment(row, r0, r1, c0, c1))
                continue
            band = BlockKeep(self.qs + r0, self.ks + c0, r1 - r0, c1 - c0, self.causal, self.window).window_only()
            if band.r1 > band.r0:
                segments.append(
                    DocSegment(row, r0 + band.r0, r0 + band.r1, c0 + band.c0, c0 + band.c1, band.window_size)
                )
        return DocSegments(self.causal and self.window is None, tuple(segments))

    def whole(self, device: torch.device) -> torch.Tensor:
        """The whole mask, ``[sq, sk]`` or ``[B | 1, sq, sk]`` (O(sq * sk): only where a kernel takes a whole mask)."""
        return self.rows(0, self.sq, device)


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """``[(row, start, end, id)]``: the runs of equal ids of each row of ``ids [B, n]`` in order, from one ``diff``
    and ``nonzero`` and one host read; ``None`` where an id has two runs in a row (not contiguous)."""
    b, n = ids.shape
    new = torch.ones(b, n, dtype=torch.bool, device=ids.device)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    row, start = new.nonzero(as_tuple=True)
    last = torch.ones_like(row, dtype=torch.bool)
    last[:-1] = row[1:] != row[:-1]
    end = torch.where(last, torch.full_like(start, n), start.roll(-1))
    runs = torch.stack([row, start, end, ids[row, start].to(row.dtype)], 1).tolist()
    if len({(r, d) for r, _, _, d in runs}) != len(runs):
        return None
    return [tuple(r) for r in runs]


def _and(keep: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if keep is None else keep & other


def unpack_rows(packed: torch.Tensor, bits: torch.Tensor, sk: int, r: int, n: int) -> torch.Tensor:
    """Rows ``[r, r + n)`` of a row-major ``[Sq, sk]`` bool mask packed 8 to a byte (bit b of byte i is element
    ``8 i + b``; ``bits`` the shifts ``arange(8)`` on ``packed``'s device): ``[n, sk]`` bool, from the bytes of those
    rows alone."""
    first, last = r * sk, (r + n) * sk  # the rows' elements, [first, last)
    chunk = packed[first // 8 : (last + 7) // 8]
    flat = ((chunk.unsqueeze(1) >> bits) & 1).view(-1)
    return flat[first % 8 : first % 8 + n * sk].view(n, sk).bool()


def mask_rows(mask: torch.Tensor | BlockKeep, r: int, n: int, device: torch.device) -> torch.Tensor:
    """Query rows ``[r, r + n)`` of a block's mask, a materialised bool one (``[Sq, Sk]`` / ``[B, Sq, Sk]``, sliced)
    or a :class:`BlockKeep` (built for those rows): ``[n, Sk]`` or ``[B | 1, n, Sk]``."""
    if isinstance(mask, BlockKeep):
        return mask.rows(r, n, device)
    return mask[..., r : r + n, :]
