"""HostStore: the pool is allocated once and reused; put/fetch/release round-trips; offload=False."""

from __future__ import annotations

import torch

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.offload import HostStore


def _step(runtime, q, k, v):
    out = fpdt_attention(q, k, v, runtime)
    out.backward(torch.randn_like(out))


def test_pool_is_reused_across_steps_and_layers():
    runtime = FPDTRuntime(FPDTConfig(chunk_size=64, offload=True))
    q, k, v = (torch.randn(2, 203, h, 16, requires_grad=True) for h in (4, 2, 2))
    _step(runtime, q, k, v)
    store = runtime.store(q.device)
    first = store.host_bytes
    assert first > 0
    assert store.pooled_bytes() == first  # everything went back to the pool
    _step(runtime, q, k, v)  # a second step (another layer or the next step) allocates nothing new
    _step(runtime, q, k, v)
    assert store.host_bytes == first
    assert store.pooled_bytes() == first


def test_put_fetch_release_roundtrip():
    store = HostStore(torch.device("cpu"), enabled=True)
    t = torch.randn(3, 5, 7)
    slot = store.put(t)
    assert store.host_bytes == t.numel() * t.element_size()
    assert slot.host is not None and slot.device_tensor is None
    assert slot.host.data_ptr() != t.data_ptr()  # a copy, not an alias of the caller's tensor
    t_copy = t.clone()
    t.zero_()  # the caller may reuse its memory: the stored chunk must not change
    torch.testing.assert_close(store.get(slot), t_copy, rtol=0, atol=0)
    assert store.pooled_bytes() == 0
    store.release(slot)
    assert slot.host is None
    assert store.pooled_bytes() == store.host_bytes

    u = torch.randn(3, 35)  # same element count and dtype: the pooled buffer is taken again
    slot_u = store.put(u)
    assert store.host_bytes == t.numel() * t.element_size()
    assert store.pooled_bytes() == 0
    torch.testing.assert_close(store.fetch(slot_u).wait(), u, rtol=0, atol=0)
    assert store.get(slot_u).shape == u.shape

    w = torch.randn(3, 35, dtype=torch.float64)  # another dtype: a new buffer
    store.put(w)
    assert store.host_bytes == t.numel() * 4 + w.numel() * 8


def test_put_into_existing_slot_updates_in_place():
    store = HostStore("cpu", enabled=True)
    slot = store.put(torch.zeros(4, 4))
    ptr = slot.host.data_ptr()
    acc = store.get(slot)
    store.put(acc.add_(1.0), slot)  # an accumulator updated through a zero-copy fetch
    store.put(torch.full((4, 4), 5.0), slot)  # or overwritten by a new tensor
    assert slot.host.data_ptr() == ptr
    torch.testing.assert_close(store.get(slot), torch.full((4, 4), 5.0))
    assert store.host_bytes == 16 * 4


def test_disabled_store_keeps_device_tensors():
    store = HostStore(torch.device("cpu"), enabled=False)
    t = torch.randn(4, 6)
    slot = store.put(t)
    assert slot.device_tensor is t and slot.host is None
    assert store.get(slot) is t
    u = torch.randn(4, 6)
    assert store.put(u, slot) is slot and store.get(slot) is u
    store.release(slot)
    store.release(None)
    assert slot.device_tensor is None
    assert store.host_bytes == 0 and store.pooled_bytes() == 0


def test_offload_off_through_runtime_allocates_no_host_memory():
    runtime = FPDTRuntime(FPDTConfig(chunk_size=32, offload=False))
    q, k, v = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(3))
    _step(runtime, q, k, v)
    store = runtime.store(q.device)
    assert not store.enabled and store.host_bytes == 0
    assert runtime.store(torch.device("cpu")) is store  # one store per device, reused


def test_runtime_release_drops_the_pool_and_recreates_it_on_use():
    runtime = FPDTRuntime(FPDTConfig(chunk_size=64, offload=True))
    store = runtime.store(torch.device("cpu"))
    store.release(store.put(torch.ones(8)))
    assert store.pooled_bytes() > 0
    runtime.release()
    fresh = runtime.store(torch.device("cpu"))
    assert fresh is not store and fresh.host_bytes == 0 and fresh.pooled_bytes() == 0
