"""hf_fpdt.data.layout: sharding a batch over SP ranks and gathering it back (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from hf_fpdt.data.chunks import local_chunk_sizes
from hf_fpdt.data.layout import IGNORE_INDEX, pad_sequence, shard_batch, shift_labels, unshard

CASES = [(1030, 128, 2), (1030, 128, 4), (7, 4, 4), (5, 8, 4), (1, 2, 2), (64, 16, 1), (1031, 100, 3)]


def _batch(seq_len: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(1, 500, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 3] = IGNORE_INDEX  # a prompt without targets
    return ids, labels


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, -100], [5, -100, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, 3, -100, -100], [-100, 7, 8, -100]]
    assert shift_labels(torch.tensor([9]), ignore_index=-1).tolist() == [-1]


def test_pad_sequence():
    x = torch.ones(2, 3, dtype=torch.long)
    assert pad_sequence(x, 3, 0) is x
    assert pad_sequence(x, 5, 7).tolist() == [[1, 1, 1, 7, 7]] * 2
    with pytest.raises(ValueError, match="cannot pad"):
        pad_sequence(x, 2, 0)


@pytest.mark.parametrize("seq_len,chunk,sp", CASES)
def test_shards_partition_the_padded_batch(seq_len, chunk, sp):
    ids, labels = _batch(seq_len)
    shards = [shard_batch(ids, labels, rank=r, sp_size=sp, chunk_size=chunk, pad_id=0) for r in range(sp)]
    local = shards[0].input_ids.shape[1]
    padded = sp * local
    assert padded >= seq_len and padded - seq_len < sp
    assert sorted(torch.cat([s.index for s in shards]).tolist()) == list(range(padded))
    full_targets = pad_sequence(shift_labels(labels), padded, IGNORE_INDEX)
    full_ids = pad_sequence(ids, padded, 0)
    for s in shards:
        assert s.input_ids.shape == s.position_ids.shape == s.shift_labels.shape == (3, local)
        assert torch.equal(s.input_ids, full_ids[:, s.index])
        assert torch.equal(s.shift_labels, full_targets[:, s.index])
        assert torch.equal(s.position_ids, s.index.expand(3, local))  # global positions, padding continues
        assert bool((s.position_ids[:, 1:] > s.position_ids[:, :-1]).all())  # what the attention requires
        pad = s.index >= seq_len
        assert bool((s.input_ids[:, pad] == 0).all()) and bool((s.shift_labels[:, pad] == IGNORE_INDEX).all())
        assert s.num_items_in_batch.item() == int((shift_labels(labels) != IGNORE_INDEX).sum())
    # The sample's last real token has no target, even when its successor would be a padding token.
    assert bool((full_targets[:, seq_len - 1] == IGNORE_INDEX).all())


@pytest.mark.parametrize("seq_len,chunk,sp", CASES)
def test_chunk_all_to_all_forms_contiguous_global_chunks(seq_len, chunk, sp):
    # What the attention relies on: local chunk i of ranks 0..P-1, concatenated, is global chunk i.
    ids, _ = _batch(seq_len, batch=1)
    shards = [shard_batch(ids, None, rank=r, sp_size=sp, chunk_size=chunk) for r in range(sp)]
    sizes = local_chunk_sizes(shards[0].index.numel(), chunk, sp)
    start, offset = 0, 0
    for size in sizes:
        chunk_idx = torch.cat([s.index[offset : offset + size] for s in shards])
        assert chunk_idx.tolist() == list(range(start, start + sp * size))
        start += sp * size
        offset += size


@pytest.mark.parametrize("seq_len,chunk,sp", CASES)
def test_unshard_inverts_shard(seq_len, chunk, sp):
    ids, labels = _batch(seq_len)
    shards = [shard_batch(ids, labels, rank=r, sp_size=sp, chunk_size=chunk) for r in range(sp)]
    assert torch.equal(unshard([s.input_ids for s in shards], seq_len, chunk), ids)
    assert torch.equal(unshard([s.shift_labels for s in shards], seq_len, chunk), shift_labels(labels))
    feats = [s.input_ids.unsqueeze(-1).expand(-1, -1, 5).float() for s in shards]  # e.g. hidden states [B, L, 5]
    assert torch.equal(unshard(feats, seq_len, chunk), ids.unsqueeze(-1).expand(-1, -1, 5).float())
    transposed = [f.transpose(0, 1) for f in feats]  # sequence along dim 0
    assert torch.equal(unshard(transposed, seq_len, chunk, dim=0), ids.T.unsqueeze(-1).expand(-1, -1, 5).float())


def test_given_position_ids_and_no_labels():
    ids = torch.arange(10).view(1, 10)
    pos = torch.arange(100, 110)
    shard = shard_batch(ids, None, rank=1, sp_size=4, chunk_size=4, position_ids=pos, pad_id=-1)
    assert shard.shift_labels is None and shard.num_items_in_batch is None
    assert shard.index.tolist() == [1, 5, 9]
    assert shard.position_ids.tolist() == [[101, 105, 109]]
    assert shard.input_ids.tolist() == [[1, 5, 9]]
    assert set(shard.model_kwargs()) == {"input_ids", "position_ids"}
    last = shard_batch(ids, None, rank=3, sp_size=4, chunk_size=4, position_ids=pos, pad_id=-1)
    assert last.input_ids.tolist() == [[3, 7, -1]] and last.position_ids.tolist() == [[103, 107, 111]]


def test_model_kwargs_with_labels():
    ids, labels = _batch(9, batch=2)
    shard = shard_batch(ids, labels, rank=0, sp_size=2, chunk_size=4)
    kw = shard.model_kwargs()
    assert kw["labels"] is kw["shift_labels"] is shard.shift_labels
    assert kw["num_items_in_batch"] is shard.num_items_in_batch


def test_bad_inputs():
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="batch, seq_len"):
        shard_batch(ids[0], None, rank=0, sp_size=2, chunk_size=4)
    with pytest.raises(ValueError, match="shape of input_ids"):
        shard_batch(ids, ids[:, :4], rank=0, sp_size=2, chunk_size=4)
    with pytest.raises(ValueError, match="integer chunk size"):
        shard_batch(ids, None, rank=0, sp_size=2, chunk_size="auto")
    with pytest.raises(ValueError, match="outside the sequence-parallel group"):
        shard_batch(ids, None, rank=2, sp_size=2, chunk_size=4)


def test_chunk_spans_tile_the_local_sequence_in_order():
    from hf_fpdt.data.chunks import chunk_spans, local_chunk_sizes

    sizes = local_chunk_sizes(1030, 128, 2)
    spans = chunk_spans(sizes)
    assert [s.stop - s.start for s in spans] == sizes
    assert spans[0].start == 0 and spans[-1].stop == 1030
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
