"""HostStore: the pool is allocated once and reused; put/fetch/release round-trips; offload=False."""

from __future__ import annotations

import torch

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.memory.host_store import Fetched, HostStore


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


class SnapshotStore(HostStore):
    """A CPU stand-in for the CUDA store's asynchrony: a fetch copies the host buffer when it is *issued*
    (as the host-to-device copy does), not when it is used, so a fetch issued before the update it needs
    reads stale data. Counts the fetches issued and not yet waited for (the prefetch depth)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, enabled=True)
        self.in_flight = self.peak = 0

    def fetch(self, slot):
        if slot.host is None:
            return super().fetch(slot)
        store = self
        store.in_flight += 1
        store.peak = max(store.peak, store.in_flight)

        class Snapshot(Fetched):
            def wait(self):
                if self.event is None:
                    store.in_flight -= 1
                    self.event = "waited"
                return self.tensor

        return Snapshot(slot.host.clone())


def test_prefetch_runs_two_chunks_deep_and_never_reads_a_stale_accumulator():
    from standins import reference_attention

    b, s, h, hkv, d, chunk = 1, 7 * 16, 4, 2, 8, 16  # 7 chunks: 28 blocks per direction
    q, k, v = (torch.randn(b, s, n, d, dtype=torch.float64, requires_grad=True) for n in (h, hkv, hkv))
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    store = runtime._stores["cpu"] = SnapshotStore(torch.device("cpu"))
    out = fpdt_attention(q, k, v, runtime)
    forward_peak, store.peak = store.peak, 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # Counted when a fetch is issued, so the set about to be waited for is in: forward, k_j, v_j of the
    # block about to run and of two more chunks (the old double buffer: 2); backward, three query sets
    # of q, o, lse, dq (the old one: two at most, at a row's end, with a k, v pair; dO is a view of the
    # caller's gradient at one rank, never stored or fetched: issue 44, item 5).
    assert forward_peak == 3 * 2
    assert store.peak >= 3 * 4
    assert store.in_flight == 0  # everything fetched was used
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, d**-0.5)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, ref_grads):  # a stale dq accumulator would lose a block's contribution
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
