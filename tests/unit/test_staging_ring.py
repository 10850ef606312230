"""The staging ring on CPU, with fake streams (issue 44, item 3): stages are reused once nothing holds them, each
reuse orders the copy stream after a "slot free" event of the stream that consumed the stage (and after other
streams' reads), and the ring's size follows the fetched tensors alive at once, not the number of fetches.
The CUDA half (reserved memory, retries, delayed copies) is ``tests/gpu/test_cuda_prefetch.py``."""

from __future__ import annotations

from collections import deque

import torch

from hf_fpdt.memory.compat_torch import storage_use_count
from hf_fpdt.memory.host_store import PREFETCH_DEPTH, HostStore
from hf_fpdt.memory.staging import WRITES_IN_FLIGHT, HeldSources, StagingRing


class FakeStream:
    """Records what the ring asks of a stream: events it records, events it waits for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.recorded: list = []
        self.waited: list = []

    def record_event(self) -> tuple:
        event = (self.name, len(self.recorded))
        self.recorded.append(event)
        return event

    def wait_event(self, event) -> None:
        self.waited.append(event)


def _ring() -> StagingRing:
    return StagingRing(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))


def test_this_torch_says_when_a_stage_is_free():
    t = torch.empty(64, dtype=torch.uint8)
    before = storage_use_count(t)
    assert before is not None and StagingRing.supported(t)  # else HostStore.fetch falls back to fresh buffers
    view = t[:8]
    assert storage_use_count(t) == before + 1
    del view
    assert storage_use_count(t) == before


def test_many_fetches_reuse_a_few_stages():
    """Prefetch's pattern (a fetch starts while PREFETCH_DEPTH fetched tensors are alive: the one in use and the
    next): 200 fetches, PREFETCH_DEPTH + 1 stages per class."""
    ring, copy, compute = _ring(), FakeStream("copy"), FakeStream("compute")
    alive: deque = deque()
    for i in range(200):
        shape = (4, 3) if i % 2 else (4, 6)  # a k chunk and a q chunk: two size classes (48 and 96 bytes)
        stage = ring.take(torch.Size(shape).numel() * 4, copy)
        t = stage.view(torch.Size(shape), torch.float32)
        t.fill_(i)
        stage.used_on(compute)
        alive.append(t)
        if len(alive) > 2 * PREFETCH_DEPTH:  # per class: the one in use and the next, when the next is fetched
            alive.popleft()
    assert ring.allocations == 2 * (PREFETCH_DEPTH + 1)
    assert ring.stages() == {64: PREFETCH_DEPTH + 1, 128: PREFETCH_DEPTH + 1}
    assert [float(t[0, 0]) for t in alive] == list(range(200 - len(alive), 200))  # nothing alive was overwritten
    # every reuse waited for a "slot free" event the consumer recorded at that point
    assert len(copy.waited) == 200 - ring.allocations
    assert copy.waited == compute.recorded


def _detached(stage):
    return stage.view(torch.Size([16]), torch.float32).detach()  # a detached tensor over the same memory


def _inference_view(stage):
    with torch.inference_mode():
        return stage.view(torch.Size([4, 4]), torch.float32).t()  # a view made where views do not track their base


def test_a_stage_any_holder_keeps_is_not_overwritten():
    ring, copy = _ring(), FakeStream("copy")
    stage = ring.take(64, copy)
    for hold in (_detached, _inference_view):
        keep = hold(stage)
        assert ring.take(64, copy) is not stage  # held: another stage, never the held one
        del keep
        assert ring.take(64, copy) is stage  # nothing holds it any more
    assert ring.allocations == 2


def test_other_streams_reads_are_waited_for_and_dtypes_share_stages():
    ring, copy, compute, d2h = _ring(), FakeStream("copy"), FakeStream("compute"), FakeStream("d2h")
    written = d2h.record_event()
    stage = ring.take(4096, copy)
    acc = stage.view(torch.Size([1024]), torch.float32)  # an fp32 accumulator fetched into the stage ...
    stage.used_on(compute)
    ring.read_by(acc, written)  # ... written back to the host on another stream
    del acc
    again = ring.take(4096, copy)  # a bf16 chunk of the same bytes: the same stage
    assert again is stage and ring.allocations == 1
    assert copy.waited == [("compute", 0), written]
    chunk = again.view(torch.Size([2048]), torch.bfloat16)  # held while in use (HostStore.fetch holds it)
    nearby = ring.take(4000, copy)  # the class of 4096, the one stage held: a second stage
    assert nearby is not stage and ring.stages() == {4096: 2}
    del chunk


def test_a_new_shape_drops_the_stages_it_does_not_take():
    ring, copy = _ring(), FakeStream("copy")
    a, b = ring.take(100, copy), ring.take(1000, copy)
    held = b.view(torch.Size([250]), torch.float32)
    ring.new_shape()
    assert ring.trim() == 100 and ring.stages() == {1024: 1}  # a was not taken since; b is held, kept
    assert ring.trim() == 0  # once per new shape
    del held, a
    assert ring.take(900, copy) is b


def test_the_cpu_path_fetches_the_pooled_buffer_without_a_stage():
    store = HostStore(torch.device("cpu"), enabled=True)
    t = torch.randn(3, 5)
    slot = store.put(t)
    fetched = store.fetch(slot)
    assert fetched.event is None and fetched.stage is None and fetched.tensor.data_ptr() == slot.host.data_ptr()
    torch.testing.assert_close(fetched.wait(), t, rtol=0, atol=0)
    assert store.staging_bytes == 0 and store.ring.allocations == 0


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_put_tensors_are_held_until_their_copies_are_done_within_a_bound():
    """The writes' side (issue 49, finding 2): a put's device tensor is held with its copy's event, dropped once the
    event says done (no host sync) or, beyond ``WRITES_IN_FLIGHT`` times the largest held tensor's bytes, after its
    allocating stream waits for the event; the bytes held never exceed the bound, however many puts."""
    held, compute = HeldSources(), FakeStream("compute")
    events = [FakeEvent() for _ in range(10)]
    for i, event in enumerate(events):
        held.hold(torch.empty(100 if i % 3 else 300, dtype=torch.uint8), event, compute)
        assert held.nbytes <= WRITES_IN_FLIGHT * 300
    assert len(compute.waited) == len(events) - len(held) and compute.waited == events[: len(compute.waited)]
    kept = list(held._held)
    kept[0].event.done = True
    held.reap()
    assert len(held) == len(kept) - 1 and len(compute.waited) == len(events) - len(kept)  # no wait for a done one
    held.drain()
    assert len(held) == 0 and compute.waited[-len(kept) + 1 :] == [h.event for h in kept[1:]]
