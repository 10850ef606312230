"""Two-level placement: one device budget (``FPDTConfig.device_memory``) for layer inputs and replay chunks.

The device tier cannot be measured on CPU, but its logic runs there: stores that really copy (the chunk
store with ``offload=True``, the layer-input offloader with ``enabled=True``) and a small device budget.
Lasting tensors stay "resident" while the budget holds them and the oldest spill to the host first, so
the last layers' inputs stay; every budget must still give HF sdpa's loss and gradients (fp32). Also:
``checkpoint_segments="auto"`` applies the smallest k that fits at runtime, and the plan's log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.config import format_bytes as _fmt
from hf_fpdt.memory.host_store import DeviceBudget, HostStore
from hf_fpdt.memory.planner import plan
from hf_fpdt.models.presets import preset_config

LAYERS, SEQ, BATCH, CHUNK = 4, 150, 2, 32
RTOL = 1e-5


def _config(layers: int = LAYERS):
    return preset_config("tiny-llama", num_hidden_layers=layers)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_lasting_puts_spill_the_oldest_and_transient_puts_never_do():
    budget = DeviceBudget(3 * 64 * 4)
    inputs, chunks = HostStore("cpu", budget=budget), HostStore("cpu", budget=budget)  # one budget, two stores
    a, b, c, d = (torch.full((64,), float(i)) for i in range(4))
    sa, sb = inputs.put(a, lasting=True), chunks.put(b, lasting=True)
    st = chunks.put(c)  # transient: resident while there is room
    assert st.device_tensor is c and budget.used == 3 * 64 * 4
    sd = inputs.put(d, lasting=True)  # full: the oldest lasting tensor goes to the host, the transient stays
    assert sa.device_tensor is None and torch.equal(sa.host, a) and sd.device_tensor is d
    assert budget.spilled == 64 * 4 and inputs.host_used == 64 * 4 and inputs.resident_used == 64 * 4
    assert chunks.put(torch.zeros(64)).device_tensor is None  # transient over the budget: host, nothing spilled
    assert sb.device_tensor is b and budget.spilled == 64 * 4
    assert torch.equal(inputs.get(sa), a)  # a spilled tensor comes back from its host copy
    for store, slot in ((inputs, sa), (chunks, sb), (chunks, st), (inputs, sd)):
        store.release(slot)
    assert budget.used == 0 and inputs.host_used == 0


def _reference(state: dict, ids: torch.Tensor, layers: int = LAYERS) -> dict:
    model = tiny_model(_config(layers), "sdpa", seed=None)
    model.load_state_dict(state)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _fpdt_model(state: dict, layers: int = LAYERS, **config):
    model = tiny_model(_config(layers), "sdpa", seed=None)
    model.load_state_dict(state)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, **config))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.fpdt.layer_offloader.enabled = True  # copy layer inputs on CPU too, as on a GPU
    model.fpdt.layer_offloader.release()
    return model.train()


def _assert_equal_to(ref: dict, model, loss: torch.Tensor) -> None:
    assert _rel(loss, ref["loss"]) < RTOL
    for name, g in ref["grads"].items():
        assert _rel(dict(model.named_parameters())[name].grad, g) < RTOL, name


@pytest.fixture(scope="module")
def state() -> dict:
    return tiny_model(_config(), "sdpa", dtype=None).state_dict()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ref(state, ids) -> dict:
    return _reference(state, ids)


INPUT = plan(_config(), SEQ, batch=BATCH, dtype="fp32", device="cpu", host_memory=0).layer_input


@pytest.mark.parametrize(
    "device_memory,placement",
    [(0, ["host"] * 4), (INPUT * 5 // 2, ["host", "host", "device", "device"]), ("unlimited", ["device"] * 4)],
)
def test_layer_inputs_keep_the_last_layers_on_the_device(state, ids, ref, device_memory, placement):
    # host_memory=0: no replay chunks, so the layer inputs are the only lasting tensors in the budget
    model = _fpdt_model(state, offload=True, host_memory=0, device_memory=device_memory)
    loss = model(input_ids=ids, labels=ids).loss
    runtime = model.fpdt.runtime
    assert runtime.residency.limit == (None if device_memory == "unlimited" else device_memory)  # planned
    assert model.fpdt.layer_offloader.placement() == placement  # oldest first: layers 0..3
    loss.backward()
    assert runtime.residency.used == 0  # every resident tensor gave its budget back
    _assert_equal_to(ref, model, loss.detach())


def test_replay_chunks_share_the_budget_and_stay_exact(state, ids, ref):
    full = plan(_config(), SEQ, batch=BATCH, dtype="fp32", device="cpu", host_memory="unlimited")
    budget = full.replay_per_layer + INPUT  # about one layer's inputs and chunks: the last layer's
    model = _fpdt_model(state, offload=True, host_memory="unlimited", device_memory=budget)
    loss = model(input_ids=ids, labels=ids).loss
    runtime = model.fpdt.runtime
    store = runtime.store(ids.device)
    assert runtime.checkpointing.kept_bytes == LAYERS * full.replay_per_layer  # every layer keeps its chunks
    # the device ends the forward with the last layer's input and chunks; the older ones spilled to the host
    assert model.fpdt.layer_offloader.placement() == ["host"] * 3 + ["device"]
    assert store.resident_used == full.replay_per_layer and runtime.residency.used == budget
    assert store.host_used == (LAYERS - 1) * full.replay_per_layer and runtime.residency.spilled > 0
    # the planner predicts the same placement for a device with that budget
    what_if = plan(_config(), SEQ, batch=BATCH, dtype="fp32", device="cuda", host_memory="unlimited",
                   resident_memory=budget, search_longest=False)  # fmt: skip
    assert (what_if.resident_inputs, what_if.resident_replay, what_if.resident) == (1, 1, budget)
    loss.backward()
    assert runtime.residency.used == 0 and store.host_used == 0
    _assert_equal_to(ref, model, loss.detach())


def test_auto_segments_apply_the_smallest_k_that_fits_and_log_the_placement(caplog):
    layers = 16
    state = tiny_model(_config(layers), "sdpa", dtype=None).state_dict()
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    settings = dict(batch=BATCH, dtype="fp32", device="cpu", search_longest=False)
    one = plan(_config(layers), SEQ, host_memory=0, **settings)  # per-layer checkpointing at the floor
    two = plan(_config(layers), SEQ, host_memory="unlimited", segments=2, **settings)
    assert two.host_kept < one.host_kept  # 8 + 2 inputs instead of 16: worth a second layer's chunks
    budget = (one.host_kept + two.host_kept) // 2
    assert plan(_config(layers), SEQ, host_memory=budget, **settings).segments_needed == 2
    model = _fpdt_model(state, layers, host_memory=budget)  # checkpoint_segments="auto", the default
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        loss = model(input_ids=ids, labels=ids).loss
    assert model.fpdt.runtime.checkpointing.segments == 2
    assert len(model.fpdt.layer_offloader.placement()) == layers // 2  # one input kept per segment
    loss.backward()
    _assert_equal_to(_reference(state, ids, layers), model, loss.detach())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_fpdt plan"))
    assert "checkpoint segments of k=2" in line and "0/16 layers keep" in line
    assert "recomputed in backward in 16 layers" in line
    planned = plan(_config(layers), SEQ, host_memory=budget, segments=2, **settings)
    assert f"on the host {_fmt(planned.host_kept)} of host_memory {_fmt(budget)}" in line
    short = ids[:, :40]  # a shorter sequence fits with one input per layer: per-layer checkpointing again
    model(input_ids=short, labels=short).loss.backward()
    assert model.fpdt.runtime.checkpointing.segments == 1


def _sp_auto_worker(rank: int, world_size: int, state: dict, ids: torch.Tensor, layers: int, budgets: list) -> dict:
    import torch.distributed as dist
    from distributed import group_loss_and_grads

    from hf_fpdt.data.layout import shard_batch

    shard = shard_batch(ids, ids.clone(), rank=rank, sp_size=world_size, chunk_size=CHUNK * world_size)
    model = tiny_model(_config(layers), "sdpa", seed=None)
    model.load_state_dict(state)
    cfg = hf_fpdt.FPDTConfig(chunk_size=CHUNK * world_size, host_memory=budgets[rank])  # segments "auto"
    hf_fpdt.apply(model, cfg, group=dist.group.WORLD)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.fpdt.layer_offloader.enabled = True  # count the kept layer inputs on CPU too
    model.fpdt.layer_offloader.release()
    loss = model.train()(**shard.model_kwargs()).loss
    kept = len(model.fpdt.layer_offloader.placement())
    return {**group_loss_and_grads(model, loss), "k": model.fpdt.runtime.checkpointing.segments, "kept": kept}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sp2_auto_segments_agree_on_k_and_equal_sdpa():
    """Under SP 2 both ranks apply the same k: the plan's host budget is the ranks' smallest (one MIN
    all-reduce), so a rank with an unlimited host still takes k=2 with its peer, whose budget needs it.
    Ranks that picked different k would run different collectives in backward (replay against recompute)."""
    from distributed import run_distributed

    layers, seq = 16, 256
    state = tiny_model(_config(layers), "sdpa", dtype=None).state_dict()
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(4))
    settings = dict(batch=1, sp_size=2, dtype="fp32", device="cpu", search_longest=False)
    one = plan(_config(layers), seq, host_memory=0, **settings)
    two = plan(_config(layers), seq, host_memory="unlimited", segments=2, **settings)
    budget = (one.host_kept + two.host_kept) // 2  # per rank: k=1 does not fit, k=2 does
    assert plan(_config(layers), seq, host_memory=budget, segments="auto", **settings).segments == 2
    assert plan(_config(layers), seq, host_memory="unlimited", segments="auto", **settings).segments == 1
    per_rank = run_distributed(_sp_auto_worker, 2, state, ids, layers, ["unlimited", budget], timeout=60)
    ref = _reference(state, ids, layers)
    assert [r["k"] for r in per_rank] == [2, 2]  # rank 0 alone would have kept every layer's input (k=1)
    assert [r["kept"] for r in per_rank] == [layers // 2] * 2  # one input per segment on both ranks
    for rank, got in enumerate(per_rank):
        assert _rel(got["loss"], ref["loss"]) < RTOL, rank
        for name, g in ref["grads"].items():
            assert _rel(got["grads"][name], g) < RTOL, (rank, name)
