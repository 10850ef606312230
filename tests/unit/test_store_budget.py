"""HostStore's resident budget (offload="auto"), transfer stats, and pool reuse under checkpointing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention.autotune import Autotuner
from hf_fpdt.memory.host_store import HostStore, TransferStats


class FixedOffload(Autotuner):
    """An autotuner whose offload decision is a fixed resident budget (as if measured on a GPU)."""

    def __init__(self, resident_bytes: int) -> None:
        super().__init__()
        self.resident_bytes = resident_bytes

    def offload(self, device):
        return True, self.resident_bytes


def _grads(runtime: FPDTRuntime, inputs, dout):
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    out = fpdt_attention(q, k, v, runtime)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def test_budget_keeps_the_first_tensors_resident_and_offloads_the_rest():
    store = HostStore(torch.device("cpu"), enabled=True, resident_bytes=2 * 64 * 4)
    a, b, c = (torch.randn(64) for _ in range(3))
    sa, sb, sc = store.put(a), store.put(b), store.put(c)
    assert sa.device_tensor is a and sb.device_tensor is b  # first come, first served
    assert sc.host is not None and sc.device_tensor is None  # over budget: offloaded
    assert store.resident_used == 2 * 64 * 4 and store.host_bytes == 64 * 4
    store.release(sa)
    store.release(sa)  # idempotent: the budget is not returned twice
    assert store.resident_used == 64 * 4
    d = torch.randn(64)
    assert store.put(d).device_tensor is d  # the freed budget is used again
    acc = store.get(sb)
    assert store.put(acc.add_(1.0), sb).device_tensor is acc  # an accumulator slot stays resident


def test_budget_never_keeps_a_view_of_a_larger_tensor():
    store = HostStore(torch.device("cpu"), enabled=True, resident_bytes=1 << 20)
    base = torch.randn(8, 16)
    slot = store.put(base[2:4])
    assert slot.device_tensor.untyped_storage().nbytes() == 2 * 16 * 4  # a compact copy, charged exactly
    torch.testing.assert_close(slot.device_tensor, base[2:4], rtol=0, atol=0)


def test_resident_budget_path_equals_offloaded_and_device_paths_exactly():
    b, s, h, hkv, d, chunk = 2, 300, 4, 2, 16, 64
    inputs = (torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d))
    dout = torch.randn(b, s, h, d)
    offloaded = _grads(FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True)), inputs, dout)
    on_device = _grads(FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=False)), inputs, dout)
    # a budget of about two key chunks: some tensors stay, most go to the host
    budget = 2 * b * chunk * hkv * d * 4 + 100
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload="auto"), autotuner=FixedOffload(budget))
    mixed = _grads(runtime, inputs, dout)
    for x, y, z in zip(mixed, offloaded, on_device):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        torch.testing.assert_close(x, z, rtol=0, atol=0)
    store = runtime.store(torch.device("cpu"))
    assert store.enabled and store.budget.limit == budget and store.budget is runtime.residency
    assert store.host_bytes > 0  # the rest was offloaded
    assert store.resident_used == 0  # every resident chunk gave its budget back after backward
    assert store.pooled_bytes() == store.host_bytes


def test_resident_budget_is_used_during_the_step():
    runtime = FPDTRuntime(FPDTConfig(chunk_size=32, offload="auto"), autotuner=FixedOffload(1 << 20))
    q, k, v = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(3))
    out = fpdt_attention(q, k, v, runtime)
    store = runtime.store(q.device)
    assert store.resident_used > 0 and store.host_bytes == 0  # all fits: nothing offloaded
    out.sum().backward()
    assert store.resident_used == 0


def test_pool_is_reused_under_non_reentrant_checkpointing():
    # The recomputed forward stores its chunks again; they must go back to the pool, not be dropped.
    runtime = FPDTRuntime(FPDTConfig(chunk_size=32, offload=True))
    q, k, v = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(3))

    def layer(q, k, v):
        return fpdt_attention(q, k, v, runtime) * 2.0

    sizes = []
    for _ in range(3):
        checkpoint(layer, q, k, v, use_reentrant=False).sum().backward()
        store = runtime.store(q.device)
        assert store.pooled_bytes() == store.host_bytes
        sizes.append(store.host_bytes)
    assert sizes[0] > 0 and sizes[0] == sizes[1] == sizes[2]


def test_transfer_stats_stay_empty_without_cuda():
    runtime = FPDTRuntime(FPDTConfig(chunk_size=32, offload=True))
    runtime.transfer_stats.enabled = True
    q, k, v = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(3))
    fpdt_attention(q, k, v, runtime).sum().backward()
    stats = runtime.transfer_stats.collect()
    assert runtime.store(q.device).stats is stats
    assert (stats.exposed_s, stats.copy_s, stats.waits, stats.copies) == (0.0, 0.0, 0, 0)
    stats.reset()
    assert stats == TransferStats(enabled=True)
