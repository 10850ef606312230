"""Checkpoint segments of k layers (``FPDTConfig.checkpoint_segments``): one checkpoint (one kept layer
input) per segment, attention computed again inside a segment's recomputation, and HF sdpa's loss and
every gradient (fp32), for even and uneven segments."""

from __future__ import annotations

import pytest
import torch
from test_host_memory import LAYERS, RTOL, SEQ, _config, _counted_step, _reference, _rel
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.memory.planner import plan


@pytest.fixture(scope="module")
def state() -> dict:
    return tiny_model(_config(), "sdpa", dtype=None).state_dict()


def test_checkpoint_segments_default_env_and_errors(monkeypatch):
    assert hf_fpdt.FPDTConfig().checkpoint_segments == "auto"
    monkeypatch.setenv("FPDT_CHECKPOINT_SEGMENTS", "3")
    assert hf_fpdt.FPDTConfig().checkpoint_segments == 3
    assert hf_fpdt.FPDTConfig(checkpoint_segments=2).checkpoint_segments == 2  # explicit wins
    monkeypatch.setenv("FPDT_CHECKPOINT_SEGMENTS", "two")
    with pytest.raises(ValueError, match="FPDT_CHECKPOINT_SEGMENTS"):
        hf_fpdt.FPDTConfig()
    monkeypatch.delenv("FPDT_CHECKPOINT_SEGMENTS")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="checkpoint_segments"):
            hf_fpdt.FPDTConfig(checkpoint_segments=bad)


@pytest.mark.parametrize("k", [2, 3])
def test_segments_equal_sdpa_with_one_input_per_segment(state, monkeypatch, k):
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref = _reference(state, ids)
    model = tiny_model(_config(), "sdpa", seed=None)
    model.load_state_dict(state)
    cfg = hf_fpdt.FPDTConfig(chunk_size=32, host_memory="unlimited", checkpoint_segments=k)
    hf_fpdt.apply(model, cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    offloader = model.fpdt.layer_offloader
    packed = []
    pack = offloader.pack
    monkeypatch.setattr(offloader, "pack", lambda t: packed.append(t.numel()) or pack(t))
    loss, calls = _counted_step(model, monkeypatch, input_ids=ids, labels=ids)
    segments = -(-LAYERS // k)
    assert len([n for n in packed if n > 0]) == segments  # one layer input kept per segment
    per_layer = calls["first"] // LAYERS
    assert per_layer > 0 and calls["recompute"] == calls["first"]  # no replay inside a segment
    assert calls["kept_bytes"] == 0 and calls["kept_after"] == 0
    assert _rel(loss, ref["loss"]) < RTOL
    for name, g in ref["grads"].items():
        assert _rel(dict(model.named_parameters())[name].grad, g) < RTOL, name
    model.eval()
    with torch.no_grad():  # no checkpointing: every layer runs once, as HF
        ref_model = tiny_model(_config(), "sdpa", seed=None)
        ref_model.load_state_dict(state)
        want = ref_model.eval()(input_ids=ids).logits
        assert _rel(model(input_ids=ids).logits, want) < RTOL
    p = plan(_config(), SEQ, batch=2, dtype="fp32", device="cpu", host_memory="unlimited", segments=k)
    assert p.segments == k and p.replay_layers == 0  # the planner plans what the runtime does


def _sp_worker(rank: int, world_size: int, state: dict, ids: torch.Tensor, ks: list) -> dict:
    import torch.distributed as dist
    from distributed import group_loss_and_grads

    from hf_fpdt.data.layout import shard_batch

    shard = shard_batch(ids, ids.clone(), rank=rank, sp_size=world_size, chunk_size=32 * world_size)
    out = {}
    for k in ks:
        model = tiny_model(_config(), "sdpa", seed=None)
        model.load_state_dict(state)
        cfg = hf_fpdt.FPDTConfig(chunk_size=32 * world_size, host_memory="unlimited", checkpoint_segments=k)
        hf_fpdt.apply(model, cfg, group=dist.group.WORLD)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out[k] = group_loss_and_grads(model, model.train()(**shard.model_kwargs()).loss)
    return out


@pytest.mark.multiprocess
def test_sp2_segments_equal_sdpa(state):
    from distributed import run_distributed

    ids = torch.randint(0, 512, (1, 260), generator=torch.Generator().manual_seed(3))
    per_rank = run_distributed(_sp_worker, 2, state, ids, [2, 3])
    ref = _reference(state, ids)
    for rank, res in enumerate(per_rank):
        assert set(res) == {2, 3}, rank
        for k, got in res.items():
            assert _rel(got["loss"], ref["loss"]) < RTOL, (rank, k)
            for name, g in ref["grads"].items():
                assert _rel(got["grads"][name], g) < RTOL, (rank, k, name)
