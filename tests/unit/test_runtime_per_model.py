"""One runtime per model on the attention-only path (``attn_implementation="fpdt"`` without ``hf_fpdt.apply``).

The model's first fpdt call makes one :class:`~hf_fpdt.attention.runtime.FPDTRuntime` that every layer uses: one
autotuner, ``chunk_size="auto"`` measured once, one device budget for the whole model (the device tier is
emulated on CPU: a tuner whose ``offload`` answers a resident budget, as on a GPU, and stores that really
copy). Results stay sdpa's. ``hf_fpdt.configure`` gives a model its own settings the same way.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from testkit import rel_err, tiny_model

import hf_fpdt
from hf_fpdt.attention.autotune import Autotuner
from hf_fpdt.attention.runtime import FPDTRuntime
from hf_fpdt.integrations.apply import attention_modules
from hf_fpdt.integrations.registration import MODELS, runtime_of

LAYERS, S, CHUNK = 3, 70, 16


def _step(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert rel_err(got[name], ref) < 1e-5, name


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, S), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def counted(monkeypatch) -> dict:
    """Counts the runtimes made and the chunk-size measurements (each returns ``CHUNK`` without timing)."""
    seen: dict = {"runtimes": [], "measured": []}
    post_init = FPDTRuntime.__post_init__

    def made(self) -> None:
        seen["runtimes"].append(self)
        post_init(self)

    def measured(self, device, **hints) -> int:
        seen["measured"].append(self)
        return CHUNK

    monkeypatch.setattr(FPDTRuntime, "__post_init__", made)
    monkeypatch.setattr(Autotuner, "measured_chunk_size", measured)
    return seen


def test_one_runtime_one_tuner_and_auto_chunk_measured_once(monkeypatch, counted):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "auto")
    ids = _ids()
    want = _step(tiny_model("tiny-llama", "sdpa", num_hidden_layers=LAYERS), ids)
    model = tiny_model("tiny-llama", "fpdt", num_hidden_layers=LAYERS)
    got = _step(model, ids)
    _assert_same(got, want)
    layers = attention_modules(model)
    assert len(layers) == LAYERS
    runtimes = {id(runtime_of(m)) for m in layers}
    assert len(counted["runtimes"]) == 1 and runtimes == {id(counted["runtimes"][0])}  # one runtime, every layer's
    runtime = counted["runtimes"][0]
    assert isinstance(runtime.autotuner, Autotuner)  # one tuner: the runtime's
    assert counted["measured"] == [runtime.autotuner]  # chunk_size="auto" measured once, for the model
    assert runtime.global_chunk_size(ids.device) == CHUNK
    _assert_same(_step(model, ids), want)  # a second step: nothing new made or measured
    assert len(counted["runtimes"]) == 1 and len(counted["measured"]) == 1
    assert not [k for m in model.modules() for k in vars(m) if "fpdt" in k]  # nothing written into the model


def test_one_device_budget_for_the_whole_model(monkeypatch):
    """offload="auto" on an emulated device: the tuner's resident budget is the model's, shared by all layers."""
    monkeypatch.setenv("FPDT_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("FPDT_OFFLOAD", "auto")
    asked: list = []
    budget = {"bytes": 1 << 40}

    def offload(self, device):  # a GPU's answer: offload, keeping this many bytes of chunks on the device
        asked.append(self)
        return True, budget["bytes"]

    monkeypatch.setattr(Autotuner, "offload", offload)
    ids = _ids()

    def resident_after_forward(model) -> tuple[FPDTRuntime, int, int]:
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        runtime = runtime_of(attention_modules(model)[0])
        store = runtime.store(ids.device)
        used, host = runtime.residency.used, store.host_bytes
        loss.backward()
        return runtime, used, host

    # everything resident: what the layers' chunks take together
    _, everything, host = resident_after_forward(tiny_model("tiny-llama", "fpdt", num_hidden_layers=LAYERS))
    assert everything > 0 and host == 0
    # a budget of about one layer's chunks: per-layer budgets would keep every layer's, the model's keeps one
    budget["bytes"] = everything // LAYERS + 1
    asked.clear()
    want = _step(tiny_model("tiny-llama", "sdpa", num_hidden_layers=LAYERS), ids)
    model = tiny_model("tiny-llama", "fpdt", num_hidden_layers=LAYERS)
    runtime, used, host = resident_after_forward(model)
    assert len(asked) == 1  # the offload decision is taken once, for the model
    assert {id(runtime_of(m).residency) for m in attention_modules(model)} == {id(runtime.residency)}
    assert runtime.store(ids.device).budget is runtime.residency and runtime.residency.limit == budget["bytes"]
    assert 0 < used <= budget["bytes"] < everything  # one budget for all layers ...
    assert host > 0  # ... so the rest went to the host
    assert runtime.residency.used == 0  # every resident chunk gave its budget back in backward
    _assert_same(_step(model, ids), want)


def test_models_get_their_own_runtime_and_it_goes_with_the_model(counted):
    ids = _ids()
    a = tiny_model("tiny-llama", "fpdt", num_hidden_layers=2)
    a(input_ids=ids)
    b = copy.deepcopy(a)  # a copy of the model copies its config: a runtime of its own
    b(input_ids=ids)
    c = tiny_model("tiny-llama", "fpdt", num_hidden_layers=2)
    c(input_ids=ids)
    runtimes = [runtime_of(attention_modules(m)[0]) for m in (a, b, c)]
    assert len({id(r) for r in runtimes}) == 3 and len(counted["runtimes"]) == 3
    config = weakref.ref(c.config)
    entries = len(MODELS)
    del c, runtimes
    gc.collect()
    assert config() is None and len(MODELS) == entries - 1  # dropped with the model's config


def test_configure_gives_the_whole_model_one_runtime_and_unapply_removes_it(counted):
    ids = _ids()
    want = _step(tiny_model("tiny-llama", "sdpa", num_hidden_layers=LAYERS), ids)
    model = tiny_model("tiny-llama", "fpdt", num_hidden_layers=LAYERS)
    entries = len(MODELS)
    assert hf_fpdt.configure(model, hf_fpdt.FPDTConfig(chunk_size=8, offload=True)) is model
    state = model.fpdt
    assert isinstance(state, hf_fpdt.FPDTState) and not state.applied and state.runtime.config.chunk_size == 8
    _assert_same(_step(model, ids), want)
    assert {id(runtime_of(m)) for m in attention_modules(model)} == {id(state.runtime)}
    assert len(counted["runtimes"]) == 1 and len(MODELS) == entries  # no attention-only runtime made
    assert state.runtime.store(ids.device).host_bytes > 0  # offload=True: its settings were used
    hf_fpdt.unapply(model)
    assert not [k for m in model.modules() for k in vars(m) if "fpdt" in k]
    assert model.config._attn_implementation == "fpdt"  # configure does not switch the implementation
    _assert_same(_step(model, ids), want)  # the attention-only path's own runtime now
    assert len(counted["runtimes"]) == 2 and len(MODELS) == entries + 1


def test_configure_refuses_an_applied_model():
    model = hf_fpdt.apply(tiny_model("tiny-llama", "sdpa"), hf_fpdt.FPDTConfig(chunk_size=8))
    with pytest.raises(ValueError, match="apply it again"):
        hf_fpdt.configure(model, hf_fpdt.FPDTConfig(chunk_size=16))
