"""The arithmetic of uneven head splits (:mod:`hf_fpdt.data.head_split`), without processes: query heads per
rank, the key/value heads each rank receives and holds, the all-to-all's sizes, the even fast path's cases, and
the refusal of what cannot run (:func:`hf_fpdt.config.check_sp_heads`)."""

from __future__ import annotations

import pytest

from hf_fpdt.config import check_sp_heads
from hf_fpdt.data.head_split import HeadSplit, kv_head_of, query_head_counts, query_head_range
from hf_fpdt.distributed.all_to_all import kv_replicas

# (heads, KV heads) of real models: Qwen2.5-7B, Qwen2.5-1.5B, Qwen2.5-0.5B, Phi-4, SmolLM2-135M / 360M, Llama-3.1-8B
MODELS = [(28, 4), (12, 2), (14, 2), (40, 10), (9, 3), (15, 5), (32, 8)]


def test_qwen2_5_7b_at_sp8():
    s = HeadSplit.of(28, 4, 8)
    assert not s.even
    assert s.counts == (4, 4, 4, 4, 3, 3, 3, 3)
    assert [s.q_range(r) for r in range(8)] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25),
                                                (25, 28)]  # fmt: skip
    # query head h uses KV head h // 7: rank 1 (heads 4..7) needs KV heads 0 and 1, rank 0 only 0
    assert [s.kv_range(r) for r in range(8)] == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4), (3, 4)]
    assert s.kv_sent == (1, 2, 1, 2, 1, 2, 1, 1)
    # the kernels' GQA layout: rank 1's 4 query heads meet KV heads 0, 0, 0, 1 (one each: 3 + 1 cannot group);
    # rank 3's (12..15: 1, 1, 2, 2) group in pairs; rank 5's (19..21: 2, 2, 3) one each
    assert [s.kv_layout(r) for r in range(8)] == [(0,), (0, 0, 0, 1), (1,), (1, 2), (2,), (2, 2, 3), (3,), (3,)]
    assert s.kv_counts == (1, 4, 1, 2, 1, 3, 1, 1) and (s.max_heads, s.max_kv_heads) == (4, 4)
    assert [s.repeats(r) for r in range(8)] == [False, True, False, False, False, True, False, False]
    # the forward q/k/v exchange, per local token (head dim 128): each rank sends all 28 query heads' share and the
    # 11 KV heads the ranks receive (K and V), and receives its own heads from each of the 8 ranks
    sent, received = s.exchange_elements(1, 128)
    assert sum(s.kv_sent) == 11 and sent == (28 + 2 * 11) * 128 and received == 8 * (4 + 2 * 2) * 128
    assert s.describe().startswith("28 heads / 4 KV heads over 8 ranks (uneven): query heads 4,4,4,4,3,3,3,3")


def test_phi_4_at_sp8():
    s = HeadSplit.of(40, 10, 8)
    assert s.counts == (5,) * 8 and not s.even  # 8 divides 40 but neither divides the other with 10 KV heads
    assert s.kv_sent == (2,) * 8  # each rank's 5 heads straddle two groups of 4
    assert s.kv_range(0) == (0, 2) and s.kv_range(7) == (8, 10)
    assert all(len(s.kv_layout(r)) == 5 for r in range(8))


@pytest.mark.parametrize("heads, kv", MODELS)
def test_every_size_up_to_the_heads_splits_and_keeps_every_gqa_group(heads, kv):
    for p in range(1, heads + 1):
        check_sp_heads(heads, kv, p)
        s = HeadSplit.of(heads, kv, p)
        assert sum(s.counts) == heads and max(s.counts) - min(s.counts) <= 1
        assert list(s.counts) == sorted(s.counts, reverse=True)  # the first ranks take the extra heads
        assert s.counts == query_head_counts(heads, p)
        covered = []
        for r in range(p):
            a, b = s.q_range(r)
            assert (a, b) == query_head_range(heads, p, r) and b - a == s.counts[r]
            covered += range(a, b)
            ka, kb = s.kv_range(r)
            uses = [kv_head_of(h, heads, kv) for h in range(a, b)]
            assert (ka, kb) == (min(uses), max(uses) + 1)  # exactly the KV heads its query heads use
            layout, c = s.kv_layout(r), b - a
            assert c % len(layout) == 0 and set(layout) == set(range(ka, kb))
            group = c // len(layout)
            assert [layout[i // group] for i in range(c)] == uses  # the kernel's GQA mapping meets the right head
        assert covered == list(range(heads))
        if s.even:  # the fast path's shapes: H / P query heads, Hkv / P (or one replicated) KV heads
            assert s.counts == (heads // p,) * p
            assert s.kv_counts == (max(1, kv // p),) * p and s.replicas == kv_replicas(kv, p)
            assert not any(s.repeats(r) for r in range(p))


def test_even_is_the_old_rule():
    for heads, kv in MODELS:
        for p in range(1, heads + 1):
            assert HeadSplit.of(heads, kv, p).even == (heads % p == 0 and (kv % p == 0 or p % kv == 0))


def test_splits_are_values_per_shape():
    """No process-wide state: each (heads, KV heads, SP) has its own split, whichever was made first."""
    a, b = HeadSplit.of(28, 4, 8), HeadSplit.of(40, 10, 8)
    assert a.counts != b.counts and HeadSplit.of(28, 4, 8) == a and HeadSplit.of(28, 4, 8).counts == a.counts
    assert HeadSplit(28, 4, 8).kv_layout(1) == a.kv_layout(1)  # made directly: the same answers


def test_what_cannot_run_is_refused_naming_the_sizes_that_can():
    with pytest.raises(
        ValueError,
        match=r"sp_size=64: the model's 32 attention heads \(8 key/value heads\) cannot "
        r"be split over 64 ranks: .* at least one query head; use at most 32 .*1, 2, 4, 8, 16, 32$",
    ):
        check_sp_heads(32, 8, 64)
    with pytest.raises(ValueError, match=r"sp_size=0: .*use 1 to 4$"):
        check_sp_heads(4, 2, 0)
    with pytest.raises(ValueError, match="cannot be split over 9 ranks"):
        HeadSplit.of(8, 4, 9)
