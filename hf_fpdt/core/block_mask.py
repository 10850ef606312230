"""Which blocks of the chunked attention exist, and the mask of those only partly inside the pattern.

The chunk pipeline computes attention block by block: query chunk i against key/value chunk j <= i
(global chunks, ``P * l`` consecutive tokens each, :mod:`hf_fpdt.data.chunks`). Causal attention needs
every block ``j <= i``, the diagonal one with the causal triangle. A sliding window of ``W`` tokens
(HF's meaning: query t sees key u iff ``t - W < u <= t``) cuts that to a band::

    block (i, j) needed   iff  j <= i and the last key of j is inside the window of the first query
                               of i (ke_j - 1 > qs_i - W; the band is contiguous in j)
    block (i, j) partial  iff  needed and some (t, u) pair inside it is outside the window or
                               above the diagonal; its mask is built for that block alone, [Sq, Sk]

Packed documents (several documents in one row, ``position_ids`` restarting at 0 where each begins,
as HF's ``DataCollatorWithFlattening`` and TRL's padding-free mode make them) work the same way: a
token attends only to earlier tokens of its own document (HF's packed-sequence mask), so with document
ids ``doc[b, t]`` (non-decreasing along a row)::

    block (i, j) needed   iff  some row has doc[b, ke_j - 1] >= doc[b, qs_i]  (a shared document)
    block (i, j) partial  iff  some row has doc[b, ks_j] != doc[b, qe_i - 1]; mask [B, Sq, Sk]

Blocks that are not needed are neither fetched from the host store nor computed, in forward and in
backward: with chunk c, a window W < S costs O(S * W / c^2) blocks instead of O(S^2 / c^2), and
documents of length d cost O(S * d / c^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMask:
    """The block pattern of one attention call over global chunks of ``lengths`` tokens.

    Args:
        lengths: tokens of each global chunk (``P * l_i``), in sequence order.
        window: HF's ``sliding_window`` (``None``: plain causal).
        docs: ``[B, S]`` document id of every token (:func:`document_ids`; ``None``: one document per row).
    """

    lengths: tuple[int, ...]
    window: int | None = None
    docs: torch.Tensor | None = None
    _starts: tuple = ()  # first token of each chunk
    _edges: tuple = ()  # per chunk: (doc ids of its first token, of its last token) per row, on the host

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
            at = torch.tensor(starts + ends, device=self.docs.device)
            ids = self.docs[:, at].t().tolist()  # one host sync per call, outside every chunk loop
            n = len(starts)
            object.__setattr__(self, "_edges", tuple(zip(ids[:n], ids[n:])))

    def _range(self, i: int) -> tuple[int, int]:
        return self._starts[i], self._starts[i] + self.lengths[i]

    def needed(self, i: int, j: int) -> bool:
        """Whether query chunk i attends to any key of chunk j."""
        if j > i:
            return False
        if self.docs is not None and not any(k >= q for k, q in zip(self._edges[j][1], self._edges[i][0])):
            return False  # no row has a document in both chunks
        if self.window is None:
            return True
        return self._range(j)[1] - 1 > self._range(i)[0] - self.window  # last key vs first query

    def keys(self, i: int) -> range:
        """The key chunks query chunk i attends to (a contiguous band ending at i)."""
        return range(next(j for j in range(i + 1) if self.needed(i, j)), i + 1)

    def queries(self, j: int) -> range:
        """The query chunks that attend to key chunk j (a contiguous band starting at j)."""
        n = len(self.lengths)
        return range(j, next((i for i in range(j, n) if not self.needed(i, j)), n))

    def keep(self, i: int, j: int, device: torch.device) -> torch.Tensor | None:
        """The block's mask ``[Sq, Sk]`` (``[B, Sq, Sk]`` with documents; True = attend) where it is
        partial; None where the block is whole (``j < i``) or exactly the causal triangle (``j == i``)."""
        (qs, qe), (ks, ke) = self._range(i), self._range(j)
        one_doc = self.docs is None or all(k == q for k, q in zip(self._edges[j][0], self._edges[i][1]))
        in_window = self.window is None or ks > qe - 1 - self.window
        if one_doc and in_window:
            return None
        t = torch.arange(qs, qe, device=device).unsqueeze(1)
        u = torch.arange(ks, ke, device=device).unsqueeze(0)
        keep = u <= t
        if self.window is not None:
            keep = keep & (u > t - self.window)
        if not one_doc:
            docs = self.docs.to(device)
            keep = keep & (docs[:, qs:qe, None] == docs[:, None, ks:ke])
        return keep


def document_ids(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, S]`` document ids from packed ``position_ids`` (a new document wherever the position does not
    grow by exactly 1, HF's ``find_packed_sequence_indices`` rule), or None where every row is one
    document (one host sync)."""
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
