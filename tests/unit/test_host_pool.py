"""The host pool counts pinned memory as the allocator takes it, shares size classes, and is trimmed when the step's
shape changes; the planner counts host buffers with the same rule (issue 44, item 2).

A counting allocator stands in for torch's pinned one (this machine has no CUDA): it rounds as the pinned allocator
does (:func:`hf_fpdt.memory.host_pool.host_block_nbytes`), hands out pageable memory and counts what it handed out
and what came back (its blocks' finalizers).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from testkit import tiny_model

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.memory.host_pool import HostPool, PinnedRounding, TorchHostAllocator, host_block_nbytes, size_class
from hf_fpdt.memory.host_store import HostStore
from hf_fpdt.memory.planner import ModelShape, plan

GIB = 1 << 30


class CountingAllocator:
    """The pinned allocator's rounding, pageable memory, and a ledger of what was handed out and returned."""

    pinned = True

    def __init__(self) -> None:
        self.handed = self.returned = self.cache_frees = 0

    def block_nbytes(self, nbytes: int) -> int:
        return host_block_nbytes(nbytes, pinned=True)

    def allocate(self, nbytes: int) -> torch.Tensor:
        block = torch.empty(self.block_nbytes(nbytes), dtype=torch.uint8)
        self.handed += block.numel()
        weakref.finalize(block, self._back, block.numel())
        return block

    def _back(self, nbytes: int) -> None:
        self.returned += nbytes

    def free_cached(self) -> None:
        self.cache_frees += 1

    @property
    def outstanding(self) -> int:
        """Bytes handed out and not yet returned."""
        gc.collect()
        return self.handed - self.returned


# ---------------------------------------------------------------------------- the rule


def test_pinned_blocks_are_powers_of_two_unless_the_allocator_is_told_otherwise():
    rule = PinnedRounding()
    assert rule.block_nbytes(3 * GIB // 2) == 2 * GIB  # a 1.5 GiB layer input takes 2 GiB
    assert [rule.block_nbytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    assert host_block_nbytes(3 * GIB // 2, pinned=False) == 3 * GIB // 2  # pageable: taken at its size
    # torch's settings: requests above pinned_max_round_threshold_mb (or pinned_max_cached_size_mb) are not rounded
    conf = "expandable_segments:True,pinned_max_round_threshold_mb:1024"
    above = PinnedRounding.from_env({"PYTORCH_ALLOC_CONF": conf})
    assert above == PinnedRounding(round_threshold=GIB)
    assert above.block_nbytes(3 * GIB // 2) == 3 * GIB // 2 and above.block_nbytes(600 << 20) == GIB
    cached = PinnedRounding.from_env({"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_cached_size_mb:512"})
    assert cached.max_cached == 512 << 20 and cached.block_nbytes(600 << 20) == 600 << 20
    first = {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:1", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    assert PinnedRounding.from_env(first).round_threshold == 1 << 20  # PYTORCH_ALLOC_CONF first, as torch reads


def test_torch_host_allocator_takes_the_rule_and_pins_only_for_cuda():
    from hf_fpdt.memory.host_pool import pins

    assert pins("cuda") and not pins("cpu")
    pageable = TorchHostAllocator(pinned=False)
    t = pageable.allocate(1000)
    assert t.dtype == torch.uint8 and t.numel() == 1000 and not t.is_pinned()
    assert TorchHostAllocator(pinned=True, rounding=PinnedRounding()).block_nbytes(1000) == 1024
    assert HostStore(torch.device("cpu")).allocator == TorchHostAllocator(pinned=False)


# ---------------------------------------------------------------------------- the pool


def test_nearby_sizes_share_a_size_class():
    alloc = CountingAllocator()
    pool = HostPool(alloc)
    a = pool.take(1000)
    assert a.nbytes == 1024 and pool.host_bytes == 1024 == alloc.outstanding
    pool.give(a)
    b = pool.take(900)  # another length's last chunk, a float32 buffer of a bf16 one's bytes: the same block
    assert b is a and pool.host_bytes == 1024
    c = pool.take(1025)  # the next class
    assert c.nbytes == 2048 and pool.host_bytes == 3072 == alloc.outstanding
    pool.give(b)
    pool.give(c)
    assert pool.classes() == {1024: 1, 2048: 1} and pool.idle_bytes() == pool.host_bytes
    # pageable buffers are taken at their size; a smaller request of the class reuses a larger idle one
    cpu = HostPool(TorchHostAllocator(pinned=False))
    big = cpu.take(1000)
    cpu.give(big)
    assert cpu.take(900) is big and cpu.host_bytes == 1000
    assert size_class(1000) == size_class(513) == 1024


def test_the_store_frees_what_a_new_shape_does_not_use_at_its_first_idle_point():
    alloc = CountingAllocator()
    store = HostStore(torch.device("cpu"), enabled=True, allocator=alloc)
    slots = [store.put(torch.zeros(n)) for n in (100, 100, 300)]  # 400 B, 400 B, 1200 B: blocks of 512 and 2048
    for s in slots:
        store.release(s)
    assert store.pool.classes() == {512: 2, 2048: 1} and store.host_bytes == 3072 == alloc.outstanding
    store.budget.new_shape()  # the step plan marks a new shape
    kept = store.put(torch.zeros(120))  # 480 B: the 512 class again
    assert store.host_bytes == 3072  # nothing is freed while the step runs ...
    store.release(kept)  # ... the first idle point frees what the new shape did not take
    assert store.pool.classes() == {512: 1} and store.host_bytes == 512 == alloc.outstanding
    assert alloc.cache_frees == 1  # and the allocator is asked to give its cached blocks back
    again = store.put(torch.zeros(100))  # the same shape again: nothing allocated, nothing freed
    store.release(again)
    assert store.host_bytes == 512 and alloc.handed == 3072 and alloc.cache_frees == 1


def _model_and_store(alloc: CountingAllocator):
    model = tiny_model("tiny-llama", "sdpa", num_hidden_layers=2)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=64, offload=True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    store = model.fpdt.runtime.store(torch.device("cpu"))
    store.pool.allocator = alloc  # before the first step: every buffer comes from the counting allocator
    return model.train(), store


def _train_step(model, n: int) -> None:
    ids = torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(n))
    model(input_ids=ids, labels=ids).loss.backward()


def test_pool_after_steps_of_three_lengths():
    """After each step the pool holds what one step of that length alone would leave (the same size classes and
    counts, nothing of earlier lengths), and its count of host bytes is what the allocator handed out."""
    lengths = (330, 500, 200)  # longer, then shorter: last chunks of 10, 52 and 8 tokens
    alone = {}
    for n in lengths:
        alloc = CountingAllocator()
        model, store = _model_and_store(alloc)
        _train_step(model, n)
        alone[n] = (store.pool.classes(), store.host_bytes)
    alloc = CountingAllocator()
    model, store = _model_and_store(alloc)
    held = []
    for n in lengths:
        _train_step(model, n)
        assert store.host_used == 0 and store.pooled_bytes() == store.host_bytes  # every chunk back in the pool
        assert store.host_bytes == alloc.outstanding  # the pool's count is the allocator's
        assert (store.pool.classes(), store.host_bytes) == alone[n], n
        held.append(store.host_bytes)
    assert held[2] < held[1]  # the shorter length's step gave the longer one's blocks back
    assert alloc.cache_frees >= 1


# ---------------------------------------------------------------------------- the planner counts the same


@pytest.mark.parametrize("seq, chunk, heads, kv_heads", [(300, 64, 3, 1), (256, 64, 4, 4), (130, 128, 6, 2)])
def test_the_planner_counts_host_chunks_as_the_pool_holds_them(seq, chunk, heads, kv_heads):
    """One attention call keeping its chunks for backward: the host bytes it holds (as the pinned allocator takes
    them) are the planner's ``replay_host_per_layer`` for a GPU plan of the same shape, and the attention's own
    count (what the replay budget charges) the planner's exact ``replay_per_layer``."""
    batch, head_dim = 2, 8
    alloc = CountingAllocator()
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True))
    store = runtime.store(torch.device("cpu"))
    store.pool.allocator = alloc
    q = torch.randn(batch, seq, heads, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, seq, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    out = fpdt_attention(q, k, v, runtime)
    shape = ModelShape(1, heads * head_dim, heads, kv_heads, head_dim, 16, 32, 0)
    p = plan(shape, seq, batch=batch, dtype="fp32", device="cuda", chunk_size=chunk, host_memory="unlimited",
             resident_memory=0, search_longest=False)  # fmt: skip
    assert store.host_used == p.replay_host_per_layer == alloc.outstanding
    exact = sum(t.numel() * t.element_size() for t in (q, k, v, q)) + batch * heads * seq * 4  # q, k, v, o, lse
    assert p.replay_per_layer == exact
    if seq % chunk or heads != kv_heads:
        assert p.replay_host_per_layer > p.replay_per_layer  # rounding matters for this shape
    out.sum().backward()
    assert store.host_used == 0
    cpu = plan(shape, seq, batch=batch, dtype="fp32", device="cpu", chunk_size=chunk, host_memory="unlimited")
    assert cpu.replay_host_per_layer == cpu.replay_per_layer  # nothing pinned on CPU: exact bytes


def test_the_host_tier_and_its_budget_count_pinned_blocks(monkeypatch):
    """A 1.5 GiB layer input (Llama-3.1-8B at 192K tokens) takes 2 GiB: the host tier counts 2 GiB per input, the
    budget decision follows, and the plan says so; exact bytes stay the runtime's replay unit. Told not to round
    such blocks (``pinned_max_round_threshold_mb``), the allocator takes exact bytes and so does the plan."""
    settings = dict(lora_rank=16, device_memory="141GiB", resident_memory=0, host_capacity=None, host_memory="128GiB")
    p = plan("llama-3.1-8b", 196608, **settings)
    assert p.layer_input == 3 * GIB // 2 and p.layer_input_host == 2 * GIB
    assert p.host["layer inputs"] == 32 * 2 * GIB
    assert p.host_kept == sum(p.host.values()) <= 128 * GIB
    assert p.replay_budget == p.replay_layers * p.replay_per_layer
    assert "layer input 1.50 GiB -> 2.00 GiB" in p.describe()
    over = plan("llama-3.1-8b", 196608, **{**settings, "host_memory": "60GiB"})
    assert not over.fits and "layer inputs 64.00 GiB" in over.error() and "pinned allocator" in over.error()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:1024")
    exact = plan("llama-3.1-8b", 196608, **settings)
    assert exact.layer_input_host == exact.layer_input and exact.host["layer inputs"] == 48 * GIB
    assert exact.replay_layers > p.replay_layers  # the 16 GiB rounding took went to replay chunks
    assert exact.rounding_line() is None and "pinned allocator" not in exact.describe()
