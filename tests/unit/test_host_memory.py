"""The host-memory budget: parsing, the per-step keep/recompute decision, exactness, fail-fast.

``host_memory`` bounds what hf_fpdt keeps across layers. Layers within the budget keep their attention
replay chunks (the recomputation replays the output); the others store nothing in the first forward
and compute attention again in the recomputation, whose chunks their backward then uses. Every setting
must give HF sdpa's loss and gradients (fp32), on one process and with SP 2 (gloo).
"""

from __future__ import annotations

import pytest
import torch
from distributed import group_loss_and_grads, run_distributed
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.attention.routes import Router
from hf_fpdt.config import parse_bytes
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.memory.planner import plan
from hf_fpdt.models.presets import preset_config

LAYERS, SEQ, CHUNK = 4, 150, 32
RTOL = 1e-5


@pytest.mark.parametrize(
    "raw,expected",
    [("64GiB", 64 << 30), ("64G", 64 << 30), ("64GB", 64 * 10**9), ("1.5 MiB", 3 << 19), ("500MB", 5 * 10**8)]
    + [(0, 0), ("0", 0), (123, 123), (" Auto ", "auto"), ("UNLIMITED", "unlimited")],
)
def test_parse_bytes(raw, expected):
    assert parse_bytes(raw) == expected


@pytest.mark.parametrize("raw", [-1, "-1", "lots", "5 XB", True])
def test_bad_host_memory_names_the_forms(raw):
    with pytest.raises(ValueError, match="64GiB|negative"):
        hf_fpdt.FPDTConfig(host_memory=raw)


def test_host_memory_default_and_env(monkeypatch):
    assert hf_fpdt.FPDTConfig().host_memory == "auto"
    monkeypatch.setenv("FPDT_HOST_MEMORY", "2GiB")
    assert hf_fpdt.FPDTConfig().host_memory == 2 << 30
    assert hf_fpdt.FPDTConfig(host_memory=0).host_memory == 0  # explicit wins
    monkeypatch.setenv("FPDT_HOST_MEMORY", "plenty")
    with pytest.raises(ValueError, match="FPDT_HOST_MEMORY"):
        hf_fpdt.FPDTConfig()


def _config():
    return preset_config("tiny-llama", num_hidden_layers=LAYERS)


def _budget_keeping(keep: int, seq: int, batch: int, sp: int = 1) -> int:
    """The smallest host budget whose plan keeps the replay chunks of ``keep`` layers (< LAYERS)."""
    full = plan(_config(), seq, batch=batch, sp_size=sp, dtype="fp32", device="cpu", host_memory="unlimited")
    inputs = full.layers * full.layer_input
    backward_extra = full.host_kept - inputs - full.layers * full.replay_per_layer
    return inputs + backward_extra + (keep + 1) * full.replay_per_layer


def _reference(state: dict, ids: torch.Tensor) -> dict:
    model = tiny_model(_config(), "sdpa", seed=None)
    model.load_state_dict(state)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _fpdt_model(state: dict, host_memory, group=None):
    model = tiny_model(_config(), "sdpa", seed=None)
    model.load_state_dict(state)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK, host_memory=host_memory), group=group)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _counted_step(model, monkeypatch, **inputs) -> tuple[torch.Tensor, dict]:
    """One step; returns its loss and the attention kernel calls in the first forward / recomputation."""
    ckpt = model.fpdt.runtime.checkpointing
    calls = {"first": 0, "recompute": 0}
    block_forward = Router.forward  # every attention block goes through the runtime's router

    def counting(router, *args, **kwargs):
        calls["recompute" if ckpt.recomputing else "first"] += 1
        return block_forward(router, *args, **kwargs)

    monkeypatch.setattr(Router, "forward", counting)
    loss = model(**inputs).loss
    calls["kept_bytes"] = ckpt.kept_bytes
    loss.backward()
    monkeypatch.undo()
    calls["kept_after"] = ckpt.kept_bytes
    return loss.detach(), calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def state() -> dict:
    return tiny_model(_config(), "sdpa", dtype=None).state_dict()


@pytest.mark.parametrize("keep", [0, 2, LAYERS])
def test_every_budget_equals_sdpa_and_keeps_what_fits(state, monkeypatch, keep):
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref = _reference(state, ids)
    host_memory = {0: 0, LAYERS: "unlimited"}.get(keep) or _budget_keeping(keep, SEQ, 2)
    model = _fpdt_model(state, host_memory)
    loss, calls = _counted_step(model, monkeypatch, input_ids=ids, labels=ids)
    per_layer = calls["first"] // LAYERS
    assert per_layer > 0
    # layers over the budget compute attention again in the recomputation, the others replay it
    assert calls["recompute"] == (LAYERS - keep) * per_layer
    full = plan(_config(), SEQ, batch=2, dtype="fp32", device="cpu", host_memory="unlimited")
    assert calls["kept_bytes"] == keep * full.replay_per_layer  # the planner's bytes are the attention's
    assert calls["kept_after"] == 0  # every kept layer's chunks are released by its backward
    assert _rel(loss, ref["loss"]) < RTOL
    for name, g in ref["grads"].items():
        assert _rel(dict(model.named_parameters())[name].grad, g) < RTOL, name


def test_over_budget_fails_before_the_first_forward(state, monkeypatch):
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = _fpdt_model(state, 1000)  # not even the layer inputs fit
    calls = []
    monkeypatch.setattr(Router, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError) as err:
        model(input_ids=ids, labels=ids)
    assert not calls  # nothing ran
    monkeypatch.undo()
    msg = str(err.value)
    assert "but host_memory is 1000 B" in msg and "layer inputs 300.0 KiB" in msg  # the numbers
    for way in ("shorter sequence", "sp_size", "host_memory", "FPDT_HOST_MEMORY", "layer inputs"):
        assert way in msg, way
    model.eval()
    with torch.no_grad():  # evaluation keeps nothing across layers: no plan, no error
        assert model(input_ids=ids).logits.shape == (2, SEQ, 512)


# ---------------------------------------------------------------------------- SP 2 (gloo, real processes)

SP_SEQ = 260


def _sp_worker(rank: int, world_size: int, state: dict, ids: torch.Tensor, budgets: list) -> dict:
    import torch.distributed as dist

    shard = shard_batch(ids, ids.clone(), rank=rank, sp_size=world_size, chunk_size=CHUNK * world_size)
    out = {}
    for budget in budgets:
        model = tiny_model(_config(), "sdpa", seed=None)
        model.load_state_dict(state)
        cfg = hf_fpdt.FPDTConfig(chunk_size=CHUNK * world_size, host_memory=budget)
        hf_fpdt.apply(model, cfg, group=dist.group.WORLD)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        try:
            loss = model(**shard.model_kwargs()).loss
        except ValueError as exc:  # the fail-fast case: every rank must raise, none may hang
            out[budget] = str(exc)
            continue
        kept = model.fpdt.runtime.checkpointing.kept_bytes
        out[budget] = {**group_loss_and_grads(model, loss), "kept": kept}
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sp2_budgets_equal_sdpa_and_fail_on_every_rank(state):
    ids = torch.randint(0, 512, (1, SP_SEQ), generator=torch.Generator().manual_seed(3))
    between = _budget_keeping(1, SP_SEQ, 1, sp=2)
    budgets = [0, between, 2000]
    per_rank = run_distributed(_sp_worker, 2, state, ids, budgets)
    ref = _reference(state, ids)
    full = plan(_config(), SP_SEQ, sp_size=2, dtype="fp32", device="cpu", host_memory="unlimited")
    for rank, res in enumerate(per_rank):
        assert "does not fit" in res[2000] and "host_memory is" in res[2000], rank
        for budget, keep in ((0, 0), (between, 1)):
            got = res[budget]
            assert got["kept"] == keep * full.replay_per_layer
            assert _rel(got["loss"], ref["loss"]) < RTOL
            for name, g in ref["grads"].items():
                assert _rel(got["grads"][name], g) < RTOL, (rank, budget, name)
