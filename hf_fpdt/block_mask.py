"""Which blocks of the chunked attention exist, and the mask of those only partly inside the pattern.

The chunk pipeline computes attention block by block: query chunk i against key/value chunk j <= i
(global chunks, ``P * l`` consecutive tokens each, :mod:`hf_fpdt.chunking`). Causal attention needs
every block ``j <= i``, the diagonal one with the causal triangle. A sliding window of ``W`` tokens
(HF's meaning: query t sees key u iff ``t - W < u <= t``) cuts that to a band::

    block (i, j) needed   iff  j <= i and the last key of j is inside the window of the first query
                               of i (ke_j - 1 > qs_i - W; the band is contiguous in j)
    block (i, j) partial  iff  needed and some (t, u) pair inside it is outside the window or
                               above the diagonal; its mask is built for that block alone, [Sq, Sk]

Blocks that are not needed are neither fetched from the host store nor computed, in forward and in
backward: with chunk c, a window W < S costs O(S * W / c^2) blocks instead of O(S^2 / c^2).
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
    """

    lengths: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {self.window}")

    def _range(self, i: int) -> tuple[int, int]:
        start = sum(self.lengths[:i])
        return start, start + self.lengths[i]

    def needed(self, i: int, j: int) -> bool:
        """Whether query chunk i attends to any key of chunk j."""
        if j > i:
            return False
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
        """The block's mask ``[Sq, Sk]`` (True = attend) where it is partial; None where the block is whole
        (``j < i``) or exactly the causal triangle (``j == i``)."""
        (qs, qe), (ks, ke) = self._range(i), self._range(j)
        if self.window is None or ks > qe - 1 - self.window:
            return None
        t = torch.arange(qs, qe, device=device).unsqueeze(1)
        u = torch.arange(ks, ke, device=device).unsqueeze(0)
        return (u <= t) & (u > t - self.window)
