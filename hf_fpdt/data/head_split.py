"""How the attention heads of one call split over the ranks of a sequence-parallel group (Ulysses).

Query heads split as evenly as they go, the first ranks taking one more where ``P`` does not divide ``H``
(28 heads over 8 ranks: 4, 4, 4, 4, 3, 3, 3, 3), each rank a contiguous range of them (the all-to-all's order).
Key/value heads follow their query heads: query head ``h`` uses key/value head ``h * Hkv // H`` (HF's ``repeat_kv``
order, ``h // (H / Hkv)``), so rank r receives exactly the key/value heads its query heads use
(:meth:`HeadSplit.kv_range`): one where its heads lie in one GQA group, two or more where they cross a group's
edge, the same head on several ranks where a group spans ranks (replication). No group is cut in a way that changes
the result: every query head meets its own key/value head.

On the rank, the block kernels take the usual GQA layout (query head ``i`` of ``c`` meets key/value head
``i // (c / m)`` of ``m``). Where the rank's heads fit it (each of the ``m`` runs of ``c / m`` query heads within one
key/value head) the received heads are used as they are; where they do not (28 / 4 heads at SP 8: rank 1 holds
query heads 4..7, three of key/value head 0 and one of head 1) they are repeated into the smallest layout that
does (:meth:`HeadSplit.kv_layout`; at most one per query head). In backward the layout's gradients are summed back
onto the received heads, and the source rank sums the gradients of a key/value head that several ranks held.

Where the split is even (``P`` divides ``H``, and ``Hkv`` divides ``P`` or ``P`` divides ``Hkv``: the rule before
uneven splits) the all-to-all's equal-piece fast path runs (:func:`hf_fpdt.distributed.all_to_all.kv_replicas`);
:attr:`HeadSplit.even` says which. A split is a value of ``(H, Hkv, P)`` made per call: nothing process-wide, so
two models with different head counts in one process each get their own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


def query_head_counts(heads: int, sp_size: int) -> tuple[int, ...]:
    """Query heads of each rank: ``heads`` over ``sp_size`` as evenly as they go, the first ranks one more."""
    base, extra = divmod(heads, sp_size)
    return tuple(base + (r < extra) for r in range(sp_size))


def query_head_range(heads: int, sp_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the query heads rank ``rank`` holds after the head scatter."""
    base, extra = divmod(heads, sp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def kv_head_of(head: int, heads: int, kv_heads: int) -> int:
    """The key/value head query head ``head`` uses (HF's ``repeat_kv`` order)."""
    return head * kv_heads // heads


@dataclass(frozen=True)
class HeadSplit:
    """The heads of a call with ``heads`` query and ``kv_heads`` key/value heads over ``sp_size`` ranks."""

    heads: int
    kv_heads: int
    sp_size: int

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(heads: int, kv_heads: int, sp_size: int) -> HeadSplit:
        """The split (cached per ``(heads, kv_heads, sp_size)``; a value, shared by calls of the same shape)."""
        if not 1 <= sp_size <= heads:
            raise ValueError(f"{heads} query heads cannot be split over {sp_size} ranks (1 to {heads} can)")
        if kv_heads < 1:
            raise ValueError(f"{kv_heads} key/value heads: a model has at least one")
        return HeadSplit(heads, kv_heads, sp_size)

    @property
    def even(self) -> bool:
        """The equal-piece split: ``P`` divides the query heads, and the key/value heads divide it or it them."""
        h, kv, p = self.heads, self.kv_heads, self.sp_size
        return h % p == 0 and (kv % p == 0 or p % kv == 0)

    @property
    def replicas(self) -> int:
        """The even split's replication of each key/value head (1: none)."""
        return self.sp_size // self.kv_heads if self.sp_size > self.kv_heads else 1

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        """Query heads per rank."""
        return query_head_counts(self.heads, self.sp_size)

    def q_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s query heads ``(start, stop)``."""
        return query_head_range(self.heads, self.sp_size, rank)

    def kv_range(self, rank: int) -> tuple[int, int]:
        """The key/value heads ``(start, stop)`` rank ``rank``'s query heads use: what it receives."""
        a, b = self.q_range(rank)
        return kv_head_of(a, self.heads, self.kv_heads), kv_head_of(b - 1, self.heads, self.kv_heads) + 1

    @functools.cached_property
    def kv_sent(self) -> tuple[int, ...]:
        """Key/value heads each rank receives (:meth:`kv_range`'s length)."""
        return tuple(b - a for a, b in map(self.kv_range, range(self.sp_size)))

    @functools.cache  # noqa: B019 (a frozen value; the cache lives as long as the split, itself cached)
    def kv_layout(self, rank: int) -> tuple[int, ...]:
        """The key/value heads of rank ``rank``'s kernels, in order (global indices): the fewest ``m`` heads such
        that query head ``i`` of its ``c`` meets head ``i // (c / m)``. The received heads themselves where that
        holds for them; else some repeated (at most ``c``, one per query head)."""
        a, b = self.q_range(rank)
        c = b - a
        uses = [kv_head_of(h, self.heads, self.kv_heads) for h in range(a, b)]
        for m in range(1, c + 1):
            if c % m:
                continue
            d = c // m
            if all(uses[i] == uses[i - i % d] for i in range(c)):
                return tuple(uses[j * d] for j in range(m))
        raise AssertionError("unreachable: m = c always fits")  # pragma: no cover

    @functools.cached_property
    def kv_counts(self) -> tuple[int, ...]:
        """Key/value heads each rank's kernels hold (:meth:`kv_layout`'s length)."""
        return tuple(len(self.kv_layout(r)) for r in range(self.sp_size))

    def repeats(self, rank: int) -> bool:
        """Whether rank ``rank`` repeats some received key/value head into its layout."""
        a, b = self.kv_range(rank)
        return self.kv_layout(rank) != tuple(range(a, b))

    @property
    def max_heads(self) -> int:
        """The largest rank's query heads."""
        return max(self.counts)

    @property
    def max_kv_heads(self) -> int:
        """The largest rank's key/value heads as its kernels hold them (after any repetition)."""
        return max(self.kv_counts)

    def exchange_elements(self, rank: int, head_dim: int, kv_head_dim: int | None = None) -> tuple[int, int]:
        """``(sent, received)`` elements of rank ``rank``'s forward q/k/v all-to-all, per local token of a chunk
        (times ``B * l`` for a chunk of ``l`` local tokens; the pieces it keeps for itself included)."""
        dk = head_dim if kv_head_dim is None else kv_head_dim
        p = self.sp_size
        sent = sum(self.counts[t] * head_dim + 2 * self.kv_sent[t] * dk for t in range(p))
        received = p * (self.counts[rank] * head_dim + 2 * self.kv_sent[rank] * dk)
        return sent, received

    def describe(self) -> str:
        """The split for people: ``"28 heads / 4 KV over 8 ranks: 4,4,4,4,3,3,3,3 query heads, KV 1,2,1,1,..."``."""
        q = ",".join(map(str, self.counts))
        kv = ",".join(map(str, self.kv_sent))
        shape = "even" if self.even else "uneven"
        return (
            f"{self.heads} heads / {self.kv_heads} KV heads over {self.sp_size} ranks ({shape}): query heads {q}; "
            f"KV heads received {kv}"
        )
