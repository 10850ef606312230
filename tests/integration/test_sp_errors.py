"""Clear errors under sequence parallelism: heads vs SP size, missing position ids, SP size vs world size."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.config import check_sp_heads as check_heads
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.distributed.groups import build_groups


def test_check_heads_states_the_rule():
    check_heads(4, 2, 4)  # KV heads replicated: fine
    check_heads(8, 4, 2)
    check_heads(3, 3, 2)  # uneven splits run (hf_fpdt.data.head_split): 2 and 1 heads
    check_heads(6, 3, 4)
    check_heads(28, 4, 8)
    with pytest.raises(ValueError, match=r"sp_size=4: the model's 3 attention heads \(3 key/value heads\) cannot be"):
        check_heads(3, 3, 4)  # a rank without a query head: refused, naming the sizes that run
    with pytest.raises(ValueError, match=r"at least one query head; use at most 28 .*even splits are 1, 2, 4, 28$"):
        check_heads(28, 4, 32)
    with pytest.raises(ValueError, match=r"sp_size=0: .*use 1 to 8"):
        check_heads(8, 4, 0)


def _caught(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # returned to the parent, which checks type and message
        return type(exc).__name__, str(exc)
    return None


def _errors(rank: int, world_size: int) -> dict:
    groups = build_groups(2)
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=groups.sp_rank, sp_size=2, chunk_size=16)
    config = hf_fpdt.FPDTConfig(chunk_size=16)
    ulysses = hf_fpdt.FPDTConfig(chunk_size=16, ring_degree=1)  # Ulysses alone ("auto": a ring of 2 beyond 1 head)

    def odd_heads():  # one attention head cannot be split over 2 ranks
        model = hf_fpdt.apply(
            tiny_model("tiny-llama", None, dtype=None, seed=None, num_attention_heads=1, num_key_value_heads=1),
            ulysses,
            group=groups.sp,
        )
        model(**shard.model_kwargs())

    def heads_at_apply():  # raised by apply itself, before any forward
        hf_fpdt.apply(
            tiny_model("tiny-llama", None, dtype=None, seed=None, num_attention_heads=1, num_key_value_heads=1),
            ulysses,
            group=groups.sp,
        )

    def other_chunk_size():  # data sharded for chunk 16, model chunking with 8: refused, not silently wrong
        model = hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=8), group=groups.sp)  # seeded: same weights
        model(**shard.model_kwargs())

    def no_positions():
        model = hf_fpdt.apply(tiny_model(), config, group=groups.sp)  # seeded: every rank the same weights
        model(input_ids=shard.input_ids, labels=shard.shift_labels, shift_labels=shard.shift_labels)

    return {
        "heads": _caught(odd_heads),
        "positions": _caught(no_positions),
        "heads_at_apply": _caught(heads_at_apply),
        "chunk_mismatch": _caught(other_chunk_size),
        "world": _caught(lambda: build_groups(3)),  # 3 does not divide the world size 2
    }


@pytest.fixture(scope="module")
def errors() -> dict:
    first, second = run_distributed(_errors, 2)
    assert first == second  # every rank raises the same error
    return first


@pytest.mark.multiprocess
def test_more_ranks_than_heads_is_refused(errors):
    kind, msg = errors["heads"]
    assert kind == "ValueError" and "ring_degree=1" in msg and "leaves 2 ranks to split the model's 1 attention" in msg
    assert "at sp_size=2 with 1 attention heads use 'auto' or one of 2" in msg


@pytest.mark.multiprocess
def test_missing_position_ids(errors):
    kind, msg = errors["positions"]
    assert kind == "ValueError" and "position_ids" in msg


@pytest.mark.multiprocess
def test_sp_size_not_dividing_world(errors):
    kind, msg = errors["world"]
    assert kind == "ValueError" and "sp_size=3 does not divide the world size 2" in msg


@pytest.mark.multiprocess
def test_heads_checked_when_applying(errors):
    kind, msg = errors["heads_at_apply"]
    assert kind == "ValueError" and "ring_degree=1" in msg and "1 attention heads" in msg


@pytest.mark.multiprocess
def test_layout_of_another_chunk_size_is_refused(errors):
    kind, msg = errors["chunk_mismatch"]
    assert kind == "ValueError" and "do not follow FPDT's layout for chunk_size=8, sp_size=2" in msg
