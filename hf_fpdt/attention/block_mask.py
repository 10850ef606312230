"""Which blocks of the chunked attention exist, and the mask of those only partly inside the pattern.

The chunk pipeline computes attention block by block: query chunk i against key/value chunk j <= i
(global chunks, ``P * l`` consecutive tokens each, :mod:`hf_fpdt.data.chunks`). Causal attention needs
every block ``j <= i``, the diagonal one with the causal triangle. A sliding window of ``W`` tokens
(HF's meaning: query t sees key u iff ``t - W < u <= t``) cuts that to a band::

    block (i, j) needed   iff  j <= i and the last key of j is inside the window of the first query
                               of i (ke_j - 1 > qs_i - W; the band is contiguous in j)
    block (i, j) partial  iff  needed and some (t, u) pair inside it is outside the window or
                               above the diagonal; its mask [Sq, Sk] is built for that block alone, a
                               slice of query rows at a time (module doc)

Packed documents (several documents in one row, ``position_ids`` restarting at 0 where each begins,
as HF's ``DataCollatorWithFlattening`` and TRL's padding-free mode make them) work the same way: a
token attends only to earlier tokens of its own document (HF's packed-sequence mask), so with document
ids ``doc[b, t]`` (non-decreasing along a row)::

    block (i, j) needed   iff  some row has doc[b, ke_j - 1] >= doc[b, qs_i]  (a shared document)
    block (i, j) partial  iff  some row has doc[b, ks_j] != doc[b, qe_i - 1]; mask [B, Sq, Sk]

A block-sparse pattern (:mod:`hf_fpdt.attention.sparse_patterns`, ``FPDTConfig.attention_pattern``) adds its own
verdict per block: ``"none"`` blocks are not needed, ``"partial"`` ones get the pattern's mask for that
block (AND the causal, window and document masks), ``"full"`` ones nothing more. The key chunks of a query
chunk are then not always one band: :meth:`BlockMask.keys` and :meth:`BlockMask.queries` list them.

The pattern is read whole, once per call: its ``mask_mod`` is evaluated once per block (tile by tile, every
batch row and head of the call at once) when the :class:`BlockMask` is built, and that one evaluation decides
everything: each block's verdict, the mask of each cut block (kept, 8 to a byte on the host, for the forward,
a checkpoint's recomputation and the backward of the call, so a ``mask_mod`` that changes between calls is
consistent within one; not kept for a ``pure`` pattern), and the refusals, each naming the first offending
indices::

    later key       some (q, kv) with kv > q kept in an evaluated block (those above the diagonal included)
    own key         some mask_mod(b, h, t, t) False
    rows / heads    values that differ between the call's batch rows or heads (b < B, h < H)
    impure          values that differ on a second evaluation of the same tile (only looked at where the
                    rows or heads differ, to name the cause)

Without a ``block_kind`` that is every block of the ``[S, S]`` square (O(S^2 / t^2) calls of tiles of t x t
pairs, t = 2048 or fewer for many rows x heads). A ``block_kind`` stands in for the evaluation of the blocks it
calls ``"none"`` or ``"full"`` below the diagonal, and of the blocks above it (that is what it is for: no
O(S^2) pass); the diagonal blocks and the ``"partial"`` ones are evaluated as above, so a later key is refused
where it falls in a diagonal block, and a diagonal block that ``block_kind`` calls ``"full"`` or ``"none"``
but the mask cuts is refused. A ``pure`` pattern with a ``block_kind`` (the ready-made ones) is trusted: one
look at its diagonal (every token keeps its own key), and its cut blocks are evaluated where they are used.

A key padding mask ``key_mask [B, S]`` (HF's 2D ``attention_mask``: left padding, holes, right padding, fully
padded rows) and a 4D mask ``dense [B | 1, 1, S, S]`` (bool keep, or HF's additive float form: 0 kept, the
dtype's minimum or ``-inf`` masked) are read one block at a time, never expanded::

    block (i, j) needed   iff  some row keeps some key of chunk j (the 4D mask: some pair of the block)
    block (i, j) partial  iff  needed and some key of chunk j is padding in some row (the 4D mask: some
                               pair at or below the diagonal is masked); mask [B, Sq, Sk]

So a diagonal block may be skipped (a chunk of padding keys) and a query row may see no key at all (a
left-padded row's padding): its output is 0, as ``sdpa`` gives for a bool mask (for a float mask with a
row all at the dtype's minimum ``sdpa`` averages every value instead; fpdt gives 0 there too). A 4D mask
that lets a query see a later key (anywhere, inside the diagonal blocks too) is refused, naming the first
such pair: the pipeline computes causal blocks only. :meth:`BlockMask.block`
hands the chunk loop a block's ``(causal, mask)``, the mask a :class:`~hf_fpdt.attention.block_keep.BlockKeep`:
the block's structure, from which the kernels build the masks of their query-row slices one at a time (no block's
whole ``[Sq, Sk]`` mask is formed on the kernels' path; :meth:`BlockMask.keep` is the whole one, for tests).

Blocks that are not needed are neither fetched from the host store nor computed, in forward and in
backward: with chunk c, a window W < S costs O(S * W / c^2) blocks instead of O(S^2 / c^2), and
documents of length d cost O(S * d / c^2).

What masks a call travels as one :class:`MaskSpec` (window, softcap, documents, sparse pattern, key mask,
4D mask), built once per call from what HF passes (:mod:`hf_fpdt.integrations.mask_spec`) and carried by
the chunk source; :meth:`MaskSpec.blocks` makes the call's :class:`BlockMask`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .block_keep import BlockKeep, unpack_rows
from .sparse_patterns import SparsePattern, declared_kind, diagonal

DENSE_SCAN_BYTES = 1 << 24  # bytes of one query-row slice's bool temporaries while a 4D mask is scanned
PURITY_SPAN = 128  # queries x keys ([0, 128) squared) a mask_mod is evaluated over twice by check_deterministic


def check_deterministic(pattern: SparsePattern) -> None:
    """Refuse, by name, a ``mask_mod`` that gives other values on a second evaluation of the same positions
    (random per call, or state that changes between calls): its mask would differ from one forward to the next
    (FlexAttention's ``create_block_mask`` evaluates a ``mask_mod`` once per block mask for the same reason).

    Cheap, once per pattern and model (:meth:`hf_fpdt.attention.runtime.FPDTRuntime.attention_pattern`): two
    evaluations over queries and keys ``[0, PURITY_SPAN)`` at ``b = h = 0``. A mask drawn at random per call
    differs there with near certainty; within one call the mask is evaluated once and reused (module doc)."""
    first = pattern.keep(0, PURITY_SPAN, 0, PURITY_SPAN, torch.device("cpu"))
    second = pattern.keep(0, PURITY_SPAN, 0, PURITY_SPAN, torch.device("cpu"))
    if torch.equal(first, second):
        return
    q, kv = (int(x) for x in (first != second).nonzero()[0])
    name = getattr(pattern.mask_mod, "__qualname__", type(pattern.mask_mod).__qualname__)
    raise ValueError(
        f"attention pattern {pattern.name!r}: mask_mod {name} returns different values for the same (b, h, q_idx, "
        f"kv_idx) on two evaluations (b=0, h=0, q_idx={q}, kv_idx={kv}: {bool(first[q, kv])}, then "
        f"{bool(second[q, kv])}): mask_mod must be a pure function of its arguments (no random numbers, no state "
        "that changes between calls), or each forward would attend with another mask; for random sparsity use "
        "hf_fpdt.patterns.block_random (seeded)"
    )


@dataclass(frozen=True)
class BlockMask:
    """The block pattern of one attention call over global chunks of ``lengths`` tokens.

    Args:
        lengths: tokens of each global chunk (``P * l_i``), in sequence order.
        window: HF's ``sliding_window`` (``None``: plain causal).
        docs: ``[B, S]`` document id of every token (:func:`document_ids`; ``None``: one document per row).
        sparse: a block-sparse pattern (:class:`~hf_fpdt.attention.sparse_patterns.SparsePattern`; ``None``: dense).
        key_mask: ``[B, S]`` bool, False on padding keys (``None``: every key counts).
        dense: a 4D mask ``[B | 1, 1, S, S]`` over the global tokens (bool keep, or additive float with 0 kept and
            the dtype's minimum / ``-inf`` masked), causal; ``None``: none.
        batch, heads: the call's batch rows and (query) heads: the range of ``b`` and ``h`` the sparse pattern's
            ``mask_mod`` is evaluated over.
        scan_bytes: the bound on one query-row slice's temporaries where the 4D mask is scanned (:meth:`_scan_dense`).
    """

    lengths: tuple[int, ...]
    window: int | None = None
    docs: torch.Tensor | None = None
    sparse: SparsePattern | None = None
    key_mask: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    batch: int = 1
    heads: int = 1
    scan_bytes: int = DENSE_SCAN_BYTES
    _starts: tuple = ()  # first token of each chunk
    _edges: tuple = ()  # per chunk: (doc ids of its first token, of its last token) per row, on the host
    _kinds: dict = None  # (i, j) -> the sparse pattern's verdict on the block, j <= i
    _masks: dict = None  # (i, j) -> the sparse pattern's mask of a cut block, bit-packed (_pack), from the evaluation
    _key_flags: tuple = ()  # per key chunk: (some row keeps a key of it, every row keeps all of it)
    _dense_flags: dict = None  # (i, j) -> (the 4D mask keeps some pair of the block, all pairs on/below the diagonal)
    _host_docs: torch.Tensor | None = None  # docs on the host, copied once per call: BlockKeep.documents reads them

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {self.window}")
        starts = [0]
        for n in self.lengths[:-1]:
            starts.append(starts[-1] + n)
        object.__setattr__(self, "_starts", tuple(starts))
        if self.docs is not None:
            if self.docs.shape[-1] != sum(self.lengths):
                raise ValueError(f"document ids for {self.docs.shape[-1]} tokens, chunks of {sum(self.lengths)}")
            ends = [a + n - 1 for a, n in zip(starts, self.lengths)]
            # one host sync per call, outside every chunk loop: the ids to the host (a view where they are there),
            # every chunk's first and last document read there (BlockKeep.documents reads them too)
            host = self.docs.cpu()
            ids = host[:, starts + ends].t().tolist()
            n = len(starts)
            object.__setattr__(self, "_edges", tuple(zip(ids[:n], ids[n:])))
            object.__setattr__(self, "_host_docs", host)
        if self.sparse is not None:
            self._scan_sparse()
        if self.key_mask is not None:
            self._scan_keys()
        if self.dense is not None:
            self._scan_dense()

    def _scan_keys(self) -> None:
        """Per key chunk, whether some / every row keeps its keys (one host sync per call)."""
        if self.key_mask.dim() != 2 or self.key_mask.shape[-1] != sum(self.lengths):
            raise ValueError(f"key padding mask {tuple(self.key_mask.shape)} must be [batch, {sum(self.lengths)}]")
        flags = []
        for a, n in zip(self._starts, self.lengths):
            chunk = self.key_mask[:, a : a + n]
            flags += [chunk.any(), chunk.all()]
        f = torch.stack(flags).tolist()
        object.__setattr__(self, "_key_flags", tuple(zip(f[0::2], f[1::2])))

    def _dense_slices(self):
        """The 4D mask's query rows a slice at a time, in order: ``(r, m, keep, ahead)`` for rows ``[r, r + n)``: ``m``
        the mask's rows ``[B, n, S]`` (a view), ``keep`` those rows as bool (``m`` itself, or ``m == 0`` of a float
        mask) and ``ahead`` ``[n, S]`` (the key is later than the query). ``n`` keeps a slice's bool temporaries (five
        of ``[B, n, S]`` at most, the float check's included) within ``scan_bytes``: O(S) per slice (at least one
        row), never a block's ``[Sq, Sk]`` (at a 16K chunk 256 MiB of bools per block, several times that in
        temporaries)."""
        d, total = self.dense, sum(self.lengths)
        rows = max(1, self.scan_bytes // (5 * d.shape[0] * total))
        cols = torch.arange(total, device=d.device)
        for r in range(0, total, rows):
            m = d[:, 0, r : r + rows]
            keep = m if m.dtype == torch.bool else m == 0
            yield r, m, keep, cols[None, :] > torch.arange(r, r + m.shape[1], device=d.device)[:, None]

    def _scan_dense(self) -> None:
        """Per block, whether the 4D mask keeps some pair / every causal pair; refuses non-causal masks and
        additive biases. One pass over the user's mask a slice of query rows at a time (:meth:`_dense_slices`: O(S)
        bools per slice, under ``scan_bytes``), every row, batch row and key of it read; per query chunk the keys some
        of its rows keep and the keys all of its rows keep where causal (``[S]`` each), from which each block's verdict
        follows; one host sync."""
        d, total = self.dense, sum(self.lengths)
        if d.dim() != 4 or tuple(d.shape[-2:]) != (total, total):
            raise ValueError(f"a 4D attention mask must be [batch, 1, {total}, {total}]; got {tuple(d.shape)}")
        if d.shape[1] != 1:
            raise ValueError(
                f"fpdt attention takes a 4D mask with one head dimension ([batch, 1, q, k]); got {d.shape[1]} "
                "(a mask per head): use sdpa for per-head masks"
            )
        n, flags = len(self.lengths), []
        bias = later = torch.zeros((), dtype=torch.bool, device=d.device)
        # per key, for the current query chunk: some row keeps it / every row keeps it or has it ahead
        some = every = None
        chunk = 0
        for r, m, keep, ahead in self._dense_slices():
            if m.dtype != torch.bool:
                bias = bias | ((m != 0) & (m > torch.finfo(m.dtype).min)).any()
            later = later | (keep & ahead).any()
            t, stop = r, r + m.shape[1]
            while t < stop:  # the slice's rows query chunk by query chunk (a slice may straddle chunks)
                qe = self._range(chunk)[1]
                end = min(qe, stop)
                if some is None:
                    some = torch.zeros(total, dtype=torch.bool, device=d.device)
                    every = torch.ones(total, dtype=torch.bool, device=d.device)
                some |= keep[:, t - r : end - r].any(1).any(0)
                every &= (keep[:, t - r : end - r] | ahead[t - r : end - r]).all(1).all(0)
                if end == qe:  # the chunk's last row: the verdicts of its blocks j <= chunk
                    for j in range(chunk + 1):
                        ks, ke = self._range(j)
                        flags += [some[ks:ke].any(), every[ks:ke].all()]
                    some = every = None
                    chunk += 1
                t = end
        f = torch.stack([*flags, bias, later]).tolist()
        if f[-2]:
            raise ValueError(
                "fpdt attention takes 4D masks that keep or drop keys (bool, or float with 0 kept and the dtype's "
                "minimum or -inf masked); this float mask holds other values (an additive bias): use sdpa"
            )
        if f[-1]:
            b, q, kv = self._first_later_dense()
            raise ValueError(
                f"this 4D attention mask lets a query attend to a later key (not causal: row {b}, query {q} keeps "
                f"key {kv}); fpdt computes causal attention only: AND the mask with the causal mask, or use sdpa "
                "for bidirectional / prefix masks"
            )
        it = iter(zip(f[0:-2:2], f[1:-2:2]))
        object.__setattr__(self, "_dense_flags", {(i, j): next(it) for i in range(n) for j in range(i + 1)})

    def _first_later_dense(self) -> tuple[int, int, int]:
        """``(row, q, kv)`` of the first later key the 4D mask keeps (query-major; for the error only)."""
        for r, _, keep, ahead in self._dense_slices():
            at = (keep & ahead).nonzero()  # [b, t, u], b-major
            if at.shape[0]:
                b, t, u = min(at.tolist(), key=lambda x: (x[1], x[2], x[0]))
                return b, r + t, u
        raise AssertionError("no later key")

    @property
    def may_empty_rows(self) -> bool:
        """Whether a query row may see no key in a block it meets, or in any block (a padding mask)."""
        return self.key_mask is not None or self.dense is not None

    def _scan_sparse(self) -> None:
        """The sparse pattern's verdict on every block ``j <= i`` and the mask of each cut block, from one
        evaluation of ``mask_mod`` per block (module doc: what is evaluated, what is refused)."""
        pattern, n = self.sparse, len(self.lengths)
        trusted = pattern.pure and pattern.block_kind is not None
        if trusted:  # the ready-made patterns: block_kind decides, one look at the diagonal
            own = diagonal(pattern, sum(self.lengths))
            if not bool(own.all()):
                self._refuse_self(int((~own).nonzero()[0]))
        kinds, masks = {}, PackedMasks()
        for i in range(n):
            later = []  # per block of the row: the first (q, kv) with kv > q that the mask keeps
            for j in range(i + 1 if pattern.block_kind is not None else n):
                (qs, qe), (ks, ke) = self._range(i), self._range(j)
                declared = declared_kind(pattern, qs, qe, ks, ke) if pattern.block_kind is not None else None
                if j == i and declared == "none":
                    raise ValueError(
                        f"attention pattern {pattern.name!r}: block_kind says the diagonal block of chunk {i} "
                        "keeps nothing, but every token attends to itself"
                    )
                if declared is not None and (trusted or (j < i and declared != "partial")):
                    kinds[i, j] = declared
                    continue
                keep = pattern.keep(qs, qe, ks, ke, torch.device("cpu"), self.batch, self.heads)
                if j > i:
                    later += _first_true(keep, qs, ks)
                    continue
                whole = keep
                if j == i:
                    later += _first_true(keep.triu(1), qs, ks)
                    own = keep.diagonal()
                    if not bool(own.all()):
                        self._refuse_self(qs + int((~own).nonzero()[0]))
                    whole = keep | torch.ones_like(keep).triu(1)  # the causal pairs
                kind = "full" if bool(whole.all()) else "none" if not bool(keep.any()) else "partial"
                if j == i and declared == "full" and kind != declared:
                    t, u = (int(x) for x in (~whole).nonzero()[0])
                    raise ValueError(
                        f"attention pattern {pattern.name!r}: block_kind({qs}, {qe}, {ks}, {ke}) says 'full' but "
                        f"mask_mod cuts that diagonal block (it drops query {qs + t}'s key {ks + u}): block_kind must "
                        "agree with mask_mod ('partial' is always safe)"
                    )
                kinds[i, j] = kind
                if kind == "partial" and not pattern.pure:
                    masks.put((i, j), keep)
            if later:
                q, kv = min(later)
                raise ValueError(
                    f"attention pattern {pattern.name!r} lets query {q} attend to the later key {kv} "
                    f"(mask_mod(b, h, {q}, {kv}) is True; not causal, e.g. a prefix-LM's bidirectional prefix); "
                    "fpdt computes causal attention only (query chunk i against key chunks j <= i): AND the mask "
                    "with q_idx >= kv_idx, or use sdpa / flex_attention for prefix-LM and bidirectional masks"
                )
        object.__setattr__(self, "_kinds", kinds)
        object.__setattr__(self, "_masks", masks)

    def _refuse_self(self, t: int) -> None:
        raise ValueError(
            f"attention pattern {self.sparse.name!r} does not let every token attend to itself (mask_mod(b, h, t, t) "
            f"is False at t={t}); a query with no key has no softmax: keep the diagonal"
        )

    def _range(self, i: int) -> tuple[int, int]:
        return self._starts[i], self._starts[i] + self.lengths[i]

    def needed(self, i: int, j: int) -> bool:
        """Whether query chunk i attends to any key of chunk j."""
        if j > i:
            return False
        if self.docs is not None and not any(k >= q for k, q in zip(self._edges[j][1], self._edges[i][0])):
            return False  # no row has a document in both chunks
        if self._kinds is not None and self._kinds[i, j] == "none":
            return False
        if self._key_flags and not self._key_flags[j][0]:
            return False  # every key of chunk j is padding
        if self._dense_flags is not None and not self._dense_flags[i, j][0]:
            return False  # the 4D mask keeps no pair of the block
        if self.window is None:
            return True
        return self._range(j)[1] - 1 > self._range(i)[0] - self.window  # last key vs first query

    def keys(self, i: int) -> list[int]:
        """The key chunks query chunk i attends to, in order, ending at i (a band unless a sparse pattern
        skips chunks inside it; without i itself where a padding mask drops the diagonal block)."""
        return [j for j in range(i + 1) if self.needed(i, j)]

    def queries(self, j: int) -> list[int]:
        """The query chunks that attend to key chunk j, in order, starting at j (unless a padding mask drops
        the diagonal block)."""
        return [i for i in range(j, len(self.lengths)) if self.needed(i, j)]

    def keep(self, i: int, j: int, device: torch.device) -> torch.Tensor | None:
        """The block's whole mask ``[Sq, Sk]`` (``[B, Sq, Sk]`` with documents or a padding mask; True = attend) where
        it is partial; None where the block is whole (``j < i``) or exactly the causal triangle (``j == i``).

        O(Sq * Sk): for tests and callers that need the whole mask; the kernels take :meth:`block`'s
        :class:`~hf_fpdt.attention.block_keep.BlockKeep` and build it a slice of query rows at a time."""
        cut = self.cut(i, j, device)
        return None if cut is None else cut.whole(device)

    def block(self, i: int, j: int, device: torch.device) -> tuple[bool, BlockKeep | None]:
        """What the kernel needs for query chunk i against key chunk j: ``(causal, mask)``; the mask, where not None,
        replaces the causal flag: a :class:`~hf_fpdt.attention.block_keep.BlockKeep` the kernels build a slice of
        query rows at a time (:meth:`cut`; :meth:`keep` is the whole of it)."""
        return i == j, self.cut(i, j, device)

    def cut(self, i: int, j: int, device: torch.device) -> BlockKeep | None:
        """The mask of block (i, j) as a :class:`~hf_fpdt.attention.block_keep.BlockKeep` where the block is partial
        (None where it is whole or exactly the causal triangle). Nothing of ``[Sq, Sk]`` is built here: the document
        ids and key mask of the block's tokens go to ``device`` (O(chunk)), a sparse evaluation's packed bits too
        (pinned, ``non_blocking``: :class:`PackedMasks`), a 4D mask stays the caller's tensor (a view of its rows)."""
        (qs, qe), (ks, ke) = self._range(i), self._range(j)
        one_doc = self.docs is None or all(k == q for k, q in zip(self._edges[j][0], self._edges[i][1]))
        window = None if self.window is None or ks > qe - 1 - self.window else self.window
        sparse_cut = self._kinds is not None and self._kinds[i, j] == "partial"
        key_cut = bool(self._key_flags) and not self._key_flags[j][1]
        dense_cut = self._dense_flags is not None and not self._dense_flags[i, j][1]
        if one_doc and window is None and not (sparse_cut or key_cut or dense_cut):
            return None
        parts = {}
        if not one_doc:
            host = self._host_docs
            parts.update(docs_q=self.docs[:, qs:qe].to(device), docs_k=self.docs[:, ks:ke].to(device))
            parts.update(host_docs=(host[:, qs:qe], host[:, ks:ke]))
        if sparse_cut and (i, j) in self._masks:
            parts.update(packed=self._masks.on_device((i, j), device), bits=self._masks.bits(device))
        elif sparse_cut:
            parts.update(sparse=self.sparse)
        if key_cut:
            parts.update(keys=self.key_mask[:, ks:ke].to(device))
        if dense_cut:
            parts.update(dense=self.dense[:, 0, qs:qe, ks:ke])
        return BlockKeep(qs, ks, qe - qs, ke - ks, causal=i == j, window=window, **parts)


def _first_true(keep: torch.Tensor, qs: int, ks: int) -> list[tuple[int, int]]:
    """``[(q, kv)]``: the first kept pair of a block in row-major order (global indices), or ``[]``."""
    at = keep.nonzero()
    return [(qs + int(at[0, 0]), ks + int(at[0, 1]))] if at.shape[0] else []


class PackedMasks:
    """The cut blocks' masks of one call's evaluation (:meth:`BlockMask._scan_sparse`), 8 to a byte on the host.

    A block's mask is unpacked where it is used (forward, a checkpoint's recomputation, backward); for a CUDA
    device the packed masks are first pinned, all of them in one buffer, once per call and device, so that each
    block's copy is asynchronous (``non_blocking``: the host does not wait for the stream), and the bit table
    (``_BIT``) is made once per device here, not sent to the device with every block. Only the packed bits of the
    blocks in use are on the device (all of a call's would be O(S^2 / 8)).
    """

    def __init__(self) -> None:
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self._bits: dict[str, torch.Tensor] = {}  # device -> the bit table [8] uint8 there
        self._pinned = False

    def put(self, key: tuple[int, int], keep: torch.Tensor) -> None:
        """Keep the bool mask ``keep`` of block ``key`` (packed)."""
        self._host[key] = self._pack(keep)
        self._pinned = False

    def __contains__(self, key: object) -> bool:
        return key in self._host

    def __iter__(self):
        return iter(self._host)

    def __len__(self) -> int:
        return len(self._host)

    def bits(self, device: torch.device) -> torch.Tensor:
        """``[1, 2, 4, ...]``'s shifts ``arange(8)`` as uint8 on ``device``, made once per device."""
        key = str(torch.device(device))
        if key not in self._bits:
            self._bits[key] = torch.arange(8, dtype=torch.uint8, device=device)
        return self._bits[key]

    def _pack(self, keep: torch.Tensor) -> torch.Tensor:
        flat = keep.reshape(-1).cpu()
        flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)])
        return (flat.view(-1, 8).to(torch.uint8) << self.bits(torch.device("cpu"))).sum(-1, dtype=torch.uint8)

    def _pin(self) -> None:
        """Move the packed masks into one pinned host buffer (their entries become views of it)."""
        keys = list(self._host)
        if keys:
            flat = torch.cat([self._host[k] for k in keys]).pin_memory()
            at = 0
            for k in keys:
                n = self._host[k].numel()
                self._host[k] = flat[at : at + n]
                at += n
        self._pinned = True

    def on_device(self, key: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The packed bits of block ``key`` on ``device`` (``ceil(Sq * Sk / 8)`` uint8): one copy per block use, from
        pinned host memory and ``non_blocking`` on CUDA (the host does not wait for the stream)."""
        device = torch.device(device)
        if device.type == "cuda" and not self._pinned:
            self._pin()
        return self._host[key].to(device, non_blocking=True)

    def unpack(self, key: tuple[int, int], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The whole bool mask of block ``key`` (``shape``) on ``device``."""
        rows = unpack_rows(self.on_device(key, device), self.bits(device), shape[-1], 0, math.prod(shape[:-1]))
        return rows.view(shape)


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """Everything but causality that masks one attention call, in global token order (``S`` tokens).

    Args:
        window: HF's ``sliding_window`` in tokens (query t sees key u iff ``t - W < u <= t``); ``None``: plain
            causal (also for a window at least as long as the sequence).
        softcap: the attention logit softcap ``cap * tanh(s / cap)`` (Gemma 2); ``None``: none.
        docs: ``[B, S]`` document ids of packed rows (:func:`document_ids`); ``None``: one document per row.
        sparse: a block-sparse pattern (:class:`~hf_fpdt.attention.sparse_patterns.SparsePattern`); ``None``: dense.
        key_mask: ``[B, S]`` bool, False on padding keys; ``None``: every key counts.
        dense_mask: a causal 4D mask ``[B | 1, 1, S, S]`` (bool keep, or additive float with 0 kept and the
            dtype's minimum / ``-inf`` masked); ``None``: none.
        chunks: ``[B, S]`` attention-chunk ids (Llama 4's chunked attention, ``attention_chunk_size``: a token
            attends to earlier tokens of its own chunk only), non-decreasing along a row; ``None``: none. Chunks
            are blocks as documents are (:func:`segments`: blocks outside a token's chunk are neither fetched
            nor computed).

    Frozen and compared by identity (it holds tensors). The default spec is plain causal attention.
    """

    window: int | None = None
    softcap: float | None = None
    docs: torch.Tensor | None = None
    sparse: SparsePattern | None = None
    key_mask: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    chunks: torch.Tensor | None = None

    @property
    def padded(self) -> bool:
        """Whether a padding mask (a key mask or a 4D mask) comes with the call."""
        return self.key_mask is not None or self.dense_mask is not None

    @property
    def causal_only(self) -> bool:
        """Whether nothing but causality masks the call (no window, softcap, documents, pattern or mask)."""
        return (
            not self.padded
            and self.window is None
            and self.softcap is None
            and self.docs is None
            and self.chunks is None
            and self.sparse is None
        )

    def blocks(self, lengths: tuple[int, ...], batch: int = 1, heads: int = 1) -> BlockMask:
        """The call's block pattern over global chunks of ``lengths`` tokens, for ``batch`` rows and ``heads``
        query heads (the softcap is no block pattern: it is part of each block's math; documents and attention
        chunks are one segmentation, :func:`segments`)."""
        docs = segments(self.docs, self.chunks)
        return BlockMask(lengths, self.window, docs, self.sparse, self.key_mask, self.dense_mask, batch, heads)


def segments(docs: torch.Tensor | None, chunks: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, S]`` ids of the segments a token attends within: packed documents, attention chunks, or both (a
    new segment wherever either starts anew), non-decreasing along a row; None for neither."""
    if chunks is None or docs is None:
        return docs if chunks is None else chunks
    if docs.shape[-1] != chunks.shape[-1]:
        raise ValueError(f"document ids {tuple(docs.shape)} and attention-chunk ids {tuple(chunks.shape)} differ")
    docs, chunks = torch.broadcast_tensors(docs, chunks.to(docs.device))  # cu_seq_lens' ids are [1, S]
    new = (torch.diff(docs, dim=-1) != 0) | (torch.diff(chunks, dim=-1) != 0)
    return torch.cat([torch.zeros_like(docs[:, :1]), new.long().cumsum(-1)], dim=-1)


@torch.compiler.disable
def document_ids(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, S]`` document ids from packed ``position_ids`` (a new document wherever the position does not
    grow by exactly 1, HF's ``find_packed_sequence_indices`` rule), or None where every row is one
    document (one host sync).

    Eager under ``torch.compile`` (as the chunk pipeline it feeds): whether the rows hold several documents
    decides which path the attention takes (the causal blocks alone, or document blocks skipped and masked), so
    the answer is read on the host once per forward; traced, that read would be Dynamo's data-dependent graph
    break with its warning, here it is the break the eager pipeline makes anyway."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    docs = (step != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def document_ids_from_cu_seqlens(cu_seq_lens: torch.Tensor, length: int) -> torch.Tensor | None:
    """``[1, S]`` document ids from the cumulative lengths ``[0, n_0, n_0 + n_1, ...]`` that HF's
    flattening collator passes (``cu_seq_lens_q``), or None for a single document."""
    cu = cu_seq_lens.reshape(-1)
    if cu.numel() <= 2:
        return None
    tokens = torch.arange(length, device=cu.device)
    return torch.searchsorted(cu[1:-1].contiguous(), tokens, right=True).unsqueeze(0)
