"""FPDT_SYNC_COPIES: the race-check switch is read through FPDTConfig, reaches every store, and changes no bit."""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.memory.checkpointing import LayerInputOffloader
from hf_fpdt.memory.host_store import HostStore


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("on", True), ("0", False), ("False", False)])
def test_env_is_read(monkeypatch, raw, expected):
    assert FPDTConfig().sync_copies is False
    monkeypatch.setenv("FPDT_SYNC_COPIES", raw)
    assert FPDTConfig().sync_copies is expected
    assert FPDTConfig(sync_copies=not expected).sync_copies is (not expected)  # explicit wins


@pytest.mark.parametrize("raw", ["auto", "2", "sometimes"])
def test_bad_env_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("FPDT_SYNC_COPIES", raw)
    with pytest.raises(ValueError, match="FPDT_SYNC_COPIES"):
        FPDTConfig()
    with pytest.raises(ValueError, match="sync_copies"):
        FPDTConfig(sync_copies="yes")


def test_store_synchronises_after_each_copy():
    store = HostStore("cpu", enabled=True, sync_copies=True)
    t = torch.randn(4, 8)
    slot = store.put(t)  # one copy to the host
    assert store.synced == 1
    assert torch.equal(store.get(slot), t)  # CPU fetch is zero-copy: nothing to synchronise
    assert store.synced == 1
    quiet = HostStore("cpu", enabled=True)
    quiet.put(t)
    assert quiet.synced == 0


def _attention(sync: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    monkeypatch.setenv("FPDT_SYNC_COPIES", "1" if sync else "0")
    runtime = FPDTRuntime(FPDTConfig(chunk_size=48, offload=True))
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 203, h, 16, requires_grad=True) for h in (4, 2, 2))
    out = fpdt_attention(q, k, v, runtime)
    out.backward(torch.randn_like(out))
    return [out.detach(), q.grad, k.grad, v.grad], runtime.store(q.device).synced


def test_attention_is_bit_identical_with_and_without(monkeypatch):
    plain, n_plain = _attention(False, monkeypatch)
    synced, n_synced = _attention(True, monkeypatch)
    assert n_plain == 0 and n_synced > 0  # the switch reached the runtime's store through the environment
    for a, b in zip(plain, synced):
        assert torch.equal(a, b)


def test_apply_hands_the_switch_to_the_layer_input_offloader():
    ref = tiny_model("tiny-llama", "sdpa", dtype=None)
    ids = torch.randint(0, 512, (2, 37))
    results = []
    for sync in (False, True):
        model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=16, offload=True, sync_copies=sync))
        model.fpdt.layer_offloader.enabled = True  # copy to a host store even on CPU (stores are made lazily)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        offloader = model.fpdt.layer_offloader
        assert offloader.sync_copies is sync
        synced = offloader.store(ids.device).synced + model.fpdt.runtime.store(ids.device).synced
        assert (synced > 0) is sync
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_offloader_use_rebuilds_stores_when_the_switch_changes():
    off = LayerInputOffloader(enabled=True)
    assert off.store(torch.device("cpu")).sync_copies is False
    off.use(off.budget, sync_copies=True)
    assert off.store(torch.device("cpu")).sync_copies is True
