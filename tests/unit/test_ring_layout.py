"""The ring beside Ulysses, without processes: the zig-zag layout, ``sp_degrees`` and ``ring_degree``, the groups and
the planner's count (issue 51, item 2)."""

from __future__ import annotations

import pytest
import torch

from hf_fpdt import FPDTConfig
from hf_fpdt.config import sp_degrees
from hf_fpdt.data.chunks import local_chunk_sizes, local_token_index, padded_length, ring_chunk, ring_chunk_sizes
from hf_fpdt.data.layout import IGNORE_INDEX, shard_batch, unshard
from hf_fpdt.distributed.ring_exchange import ring_ranks
from hf_fpdt.memory.plan_types import model_shape
from hf_fpdt.memory.planner import plan, replay_bytes_per_layer

CASES = [(70, 32, 4, 2), (72, 16, 4, 4), (1030, 128, 8, 2), (1031, 100, 6, 3), (5, 8, 4, 2), (64, 16, 8, 8)]


@pytest.mark.parametrize("seq_len, chunk, sp, ring", CASES)
def test_every_token_is_held_exactly_once_and_unshard_inverts_the_shards(seq_len, chunk, sp, ring):
    index = torch.cat([local_token_index(seq_len, chunk, sp, r, ring) for r in range(sp)])
    assert sorted(index.tolist()) == list(range(padded_length(seq_len, sp)))
    ids = torch.randint(1, 500, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    shards = [shard_batch(ids, ids, rank=r, sp_size=sp, chunk_size=chunk, ring=ring) for r in range(sp)]
    assert torch.equal(unshard([s.input_ids for s in shards], seq_len, chunk, ring=ring), ids)
    labels = unshard([s.shift_labels for s in shards], seq_len, chunk, ring=ring)
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and bool((labels[:, -1] == IGNORE_INDEX).all())


@pytest.mark.parametrize("seq_len, chunk, sp, ring", CASES)
def test_each_ulysses_group_holds_whole_global_chunks_in_zig_zag_order(seq_len, chunk, sp, ring):
    """Round t of Ulysses group g: the global chunk ring_chunk(t, g, R) (U * l_t contiguous tokens, its ranks'
    pieces in rank order: the Ulysses all-to-all forms it as without a ring)."""
    u = sp // ring
    sizes = local_chunk_sizes(padded_length(seq_len, sp) // sp, chunk, sp)
    lengths = ring_chunk_sizes(sizes, u, ring)
    starts = [sum(lengths[:c]) for c in range(len(lengths))]
    for g in range(ring):
        pieces = [local_token_index(seq_len, chunk, sp, g * u + m, ring).split(sizes) for m in range(u)]
        for t in range(len(sizes)):
            c = ring_chunk(t, g, ring)
            got = torch.cat([pieces[m][t] for m in range(u)]).tolist()
            assert got == list(range(starts[c], starts[c] + lengths[c])), (g, t, c)


def test_ring_degree_1_is_the_rank_ordinal_layout():
    for seq_len, chunk, sp, _ in CASES:
        for r in range(sp):
            want, offset = [], 0
            for size in local_chunk_sizes(padded_length(seq_len, sp) // sp, chunk, sp):
                want += range(sp * offset + r * size, sp * offset + (r + 1) * size)
                offset += size
            assert (
                local_token_index(seq_len, chunk, sp, r, 1).tolist()
                == want
                == local_token_index(seq_len, chunk, sp, r).tolist()
            )


@pytest.mark.parametrize("ring", [2, 3, 4, 8])
def test_zig_zag_balances_the_causal_blocks_over_the_ring(ring):
    """Ring member g's causal blocks (key chunks 0..c of each of its chunks c): every member within one round's
    worth (R blocks) of every other, where the plain order (g at place g every round) leaves the last member
    ``rounds * (R - 1)`` blocks ahead of the first."""
    rounds = 9
    work = [sum(ring_chunk(t, g, ring) + 1 for t in range(rounds)) for g in range(ring)]
    plain = [sum(t * ring + g + 1 for t in range(rounds)) for g in range(ring)]
    assert max(work) - min(work) <= ring, work
    assert max(plain) - min(plain) == rounds * (ring - 1)
    assert sorted(ring_chunk(t, g, ring) for t in range(rounds) for g in range(ring)) == list(range(rounds * ring))


def test_sp_degrees_chooses_u_and_r_and_refuses_by_name():
    assert sp_degrees(4, 2, 4) == (4, 1)  # within the heads: Ulysses alone, as before
    assert sp_degrees(4, 2, 8) == (4, 2)
    assert sp_degrees(28, 4, 64) == (16, 4)  # the smallest ring leaving at most 28 ranks per Ulysses group
    assert sp_degrees(9, 3, 12) == (6, 2)  # SmolLM2's 9 heads: uneven within each Ulysses group
    assert sp_degrees(4, 2, 4, 2) == (2, 2) and sp_degrees(4, 2, 4, 4) == (1, 4)
    with pytest.raises(ValueError, match=r"ring_degree=3 .*does not divide sp_size=4; .*use 'auto' or one of 1, 2, 4"):
        sp_degrees(4, 2, 4, 3)
    with pytest.raises(ValueError, match=r"ring_degree=1 .*leaves 8 ranks to split the model's 4 attention heads"):
        sp_degrees(4, 2, 8, 1)
    with pytest.raises(ValueError, match=r"ring_degree='two' .*use 'auto' or a positive integer"):
        sp_degrees(4, 2, 8, "two")


def test_config_ring_degree_and_its_environment_variable(monkeypatch):
    assert FPDTConfig().ring_degree == "auto"
    monkeypatch.setenv("FPDT_RING_DEGREE", "2")
    assert FPDTConfig().ring_degree == 2
    monkeypatch.setenv("FPDT_RING_DEGREE", "x")
    with pytest.raises(ValueError, match="FPDT_RING_DEGREE='x'"):
        FPDTConfig()
    monkeypatch.delenv("FPDT_RING_DEGREE")
    with pytest.raises(ValueError, match=r"ring_degree=3 .*does not divide sp_size=4: use 'auto' or one of 1, 2, 4"):
        FPDTConfig(sp_size=4, ring_degree=3)
    with pytest.raises(ValueError, match=r"ring_degree=0 .*use 'auto' or a positive integer"):
        FPDTConfig(ring_degree=0)


def test_ring_groups_cover_the_sp_group():
    ulysses, rings = ring_ranks(8, 2)
    assert ulysses == [[0, 1, 2, 3], [4, 5, 6, 7]] and rings == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="ring_degree=3"):
        ring_ranks(8, 3)


def test_the_plan_counts_the_rings_key_value_chunks_and_prints_u_and_r():
    shape = model_shape("tiny-llama")  # 4 heads over 2 KV heads
    d, es, local = shape.head_dim, 2, 1024
    # U 2 x R 2: per local token 4 / 2 query heads x U 2, 1 KV head x U 2 of its own chunk and of the other member's
    want = local * ((4 + 2 * 2) * d * 2 * es + 4 * 4)
    assert replay_bytes_per_layer(shape, 1, local, 4, es, ring=2) == want
    # U 1 x R 4: 4 query heads, the 2 KV heads of 4 members' chunks
    assert replay_bytes_per_layer(shape, 1, local, 4, es, ring=4) == local * ((4 + 4 * 2) * d * 2 * es + 4 * 4)
    p = plan("tiny-llama", 8192, sp_size=8, device="cpu", host_memory="unlimited", chunk_size=1024)
    assert p.ring == 2 and "sp 8 (U 4 x R 2)" in p.describe() and "a ring of 2" in p.describe()
    with pytest.raises(ValueError, match="ring_degree=1"):
        plan("tiny-llama", 8192, sp_size=8, ring_degree=1, device="cpu")
    # the working set: the round's gathered k, v (send, R received, R unpacked) and the backward's R fp32 shares
    from hf_fpdt.memory.working_set import working_set_parts

    shape = dict(width=64, elem_bytes=2, kv_ratio=0.5, heads=4, sp_size=2)
    alone, ring = working_set_parts(512, **shape), working_set_parts(512, **shape, ring=2)
    e_k = 64 / 2 * 0.5  # key/value bytes per token and byte of element: width / U x kv_ratio
    assert ring.forward - alone.forward == 512 * (1 + 2 * 2) * 2 * 2 * e_k
    assert ring.backward - alone.backward == 512 * 3 * 2 * 2 * 4 * e_k
