"""The virtual CUDA device (``tests/virtual_cuda.py``): its values, its CUDA runtime API, and the checker's verdicts
on code that is right and on code with each kind of defect it exists to find (a missing stream wait, a pinned buffer
reused under an asynchronous copy, a tensor freed with a copy in flight, host syncs in a loop, a CPU tensor beside a
CUDA one).

It runs on torch's CUDA and CPU builds alike: its tensors are CPU tensors to C++ (no CUDA device guard or stream is
ever touched), ``cuda`` only to Python.
"""

from __future__ import annotations

import copy

import pytest
import torch
from virtual_cuda import VirtualCuda, VirtualCudaError, VirtualTensor

HERE = __file__.rsplit("/", 1)[-1]


def _stream_pair() -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    return torch.cuda.current_stream(), torch.cuda.Stream()


# ----------------------------------------------------------------------------------------------------- values
def test_factories_and_moves_make_virtual_tensors_computed_on_the_cpu(virtual_cuda):
    made = [
        torch.empty(3, device="cuda"),
        torch.zeros(3, device="cuda"),
        torch.ones(3, device=torch.device("cuda")),
        torch.full((3,), 2.0, device="cuda:0"),
        torch.randn(3, device="cuda"),
        torch.arange(3, device="cuda"),
        torch.tensor([1.0, 2.0, 3.0], device="cuda"),
        torch.ones(3).to("cuda"),
        torch.ones(3).cuda(),
        torch.ones(3).to(torch.zeros(1, device="cuda").device),
        torch.ones(3).to(torch.zeros(1, device="cuda")),
    ]
    for t in made:
        assert isinstance(t, VirtualTensor) and t.device.type == "cuda" and t.is_cuda and t.get_device() == 0
    assert torch.equal(made[2].cpu(), torch.ones(3)) and torch.equal(made[5].cpu(), torch.arange(3))
    x = torch.arange(6.0, device="cuda")
    y = (x * 2 + 1).to(torch.float16)
    assert y.dtype == torch.float16 and y.is_cuda
    back = y.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    assert torch.equal(back, (torch.arange(6.0) * 2 + 1).half())
    assert torch.equal(x.to("cpu"), torch.arange(6.0)) and x.to("cuda") is x


def test_views_share_the_storage(virtual_cuda):
    x = torch.zeros(5, device="cuda")
    x[1:3].add_(1)
    x.view(5, 1)[4, 0] = 7.0
    assert x.cpu().tolist() == [0.0, 1.0, 1.0, 0.0, 7.0]
    assert x[2:].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x[2:].data_ptr() == x.data_ptr() + 2 * 4


def test_pinned_memory(virtual_cuda):
    p = torch.empty(8, pin_memory=True)
    q = torch.ones(8).pin_memory()
    assert p.is_pinned() and p[2:].is_pinned() and q.is_pinned() and type(p) is torch.Tensor
    assert not torch.ones(8).is_pinned() and not torch.ones(8, device="cuda").is_pinned()
    assert torch.equal(q, torch.ones(8))


def test_copies_new_tensors_and_modules(virtual_cuda, tmp_path):
    x = torch.arange(4.0, device="cuda")
    assert x.new_tensor([1, 2]).is_cuda and x.new_zeros(2).is_cuda and x.new_tensor([1]).dtype == x.dtype
    y = copy.deepcopy(x)
    y.add_(1)
    assert y.is_cuda and x.cpu().tolist() == [0, 1, 2, 3]
    layer = torch.nn.Linear(3, 2).to("cuda")
    assert all(p.is_cuda and isinstance(p, torch.nn.Parameter) for p in copy.deepcopy(layer).parameters())
    start = virtual_cuda.sync_count
    torch.save(x, tmp_path / "x.pt")  # its numbers come to the host
    assert virtual_cuda.syncs[start:][-1].kind == "pickle (torch.save)"
    assert torch.equal(torch.load(tmp_path / "x.pt"), torch.arange(4.0))
    too_small = torch.empty(2, device="cuda")
    with pytest.raises(NotImplementedError, match="resized a virtual tensor"), pytest.warns(UserWarning):
        torch.add(x, 1, out=too_small)


def test_autograd_runs_on_virtual_tensors(virtual_cuda):
    w = torch.randn(4, 3, device="cuda", requires_grad=True)
    x = torch.randn(2, 4, device="cuda")
    (x @ w).square().sum().backward()
    assert isinstance(w.grad, VirtualTensor)
    expected = 2 * x.cpu().T @ (x.cpu() @ w.detach().cpu())
    assert torch.allclose(w.grad.cpu(), expected)


def test_gradients_through_dtype_casts_stay_on_the_device(virtual_cuda):
    """autograd's backward of a cast (HF's RMSNorm: bf16 -> fp32 -> bf16) asks C++ for the input's device, which is
    the host for a virtual tensor: the gradient stays on the device all the same; a move the program asks for
    (``.cpu()``) still leaves it."""
    w = torch.randn(3, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 3, device="cuda", dtype=torch.bfloat16)
    y = (x.to(torch.float64) @ w.to(torch.float64)).to(torch.bfloat16)
    (y.float().square().sum() + w.cpu().double().sum()).backward()
    assert isinstance(w.grad, VirtualTensor) and w.grad.dtype == torch.bfloat16
    assert not isinstance(w.cpu(), VirtualTensor)


def test_autocast_cuda_casts_virtual_tensors(virtual_cuda):
    a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cuda")
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def test_a_cpu_tensor_beside_a_cuda_tensor_fails_as_on_cuda(virtual_cuda):
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(4)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([x, torch.ones(4)])
    assert torch.equal((x * torch.tensor(3.0)).cpu(), torch.full((4,), 3.0))  # a CPU scalar is a value
    # tensors torch makes inside a composite op from its inputs' options are not the caller's CPU tensors
    q = torch.randn(1, 2, 4, 8, device="cuda")
    assert torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).is_cuda


def test_used_outside_its_context_fails_clearly():
    with VirtualCuda():
        x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match="outside its VirtualCuda context"):
        x + 1


# ----------------------------------------------------------------------------------------------------- runtime API
def test_the_cuda_api_is_patched_for_the_context_only():
    from transformers.utils import import_utils

    before = (
        torch.cuda.is_available(), torch.cuda.Stream, torch.cuda.Event, torch.cuda.synchronize, torch.Generator,
        torch.cuda.memory_allocated, torch.accelerator.synchronize, import_utils.is_torch_cuda_available(),
    )  # fmt: skip
    with VirtualCuda(capability=(8, 0), total_memory=1 << 30) as vdev:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert import_utils.is_torch_cuda_available()  # a cached answer: cleared on entry and on exit
        assert torch.cuda.get_device_capability() == (8, 0)
        vdev.capability = (9, 0)
        assert torch.cuda.get_device_capability(torch.device("cuda")) == (9, 0)
        assert torch.cuda.get_device_properties(0).total_memory == 1 << 30
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.cuda.Stream() != torch.cuda.current_stream()
        g = torch.Generator(device="cuda").manual_seed(1)
        assert isinstance(g, torch.Generator) and g.device.type == "cuda"
        a = torch.randn(3, device="cuda", generator=g).cpu()
        assert torch.equal(a, torch.randn(3, generator=torch.Generator().manual_seed(1)))
    after = (
        torch.cuda.is_available(), torch.cuda.Stream, torch.cuda.Event, torch.cuda.synchronize, torch.Generator,
        torch.cuda.memory_allocated, torch.accelerator.synchronize, import_utils.is_torch_cuda_available(),
    )  # fmt: skip
    assert after == before


def test_memory_statistics_follow_the_live_storages(virtual_cuda):
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(1000, device="cuda")
    assert torch.cuda.memory_allocated() - base == 4000
    view = x[10:20]
    assert torch.cuda.memory_allocated() - base == 4000  # a view allocates nothing
    y = x * 2
    assert torch.cuda.memory_allocated() - base == 8000
    del x, y
    assert torch.cuda.memory_allocated() - base == 4000  # the view holds the storage
    del view
    assert torch.cuda.memory_allocated() == base and torch.cuda.max_memory_allocated() - base == 8000
    free, total = torch.cuda.mem_get_info()
    assert total == virtual_cuda.total_memory and free == total - base
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base


def test_events_and_device_progress():
    with VirtualCuda() as vdev:  # the host infinitely far ahead: work completes only when the host waits for it
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.ones(4, device="cuda").add_(1)
            e = s.record_event()
        assert torch.cuda.current_stream() != s and not e.query() and not s.query()
        e.synchronize()
        assert e.query() and vdev.syncs[-1].kind == "Event.synchronize"
    with VirtualCuda(host_lead=2):  # the device two kernels behind the host
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x = torch.ones(4, device="cuda")
        for _ in range(3):
            x.add_(1)
        end.record()
        assert not end.query()
        torch.ones(1, device="cuda"), torch.ones(1, device="cuda")
        assert end.query() and start.elapsed_time(end) == pytest.approx(4e-3)


# ----------------------------------------------------------------------------------------------------- the checker
def _side_stream_copy(order: str) -> VirtualCuda:
    """A copy on a side stream of a tensor the compute stream made, read back on the compute stream."""
    with VirtualCuda(check=False) as vdev:
        compute, side = _stream_pair()
        src = torch.randn(64, device="cuda")
        dst = torch.empty(64, device="cuda")
        if order != "no wait before":
            side.wait_stream(compute)
        with torch.cuda.stream(side):
            dst.copy_(src)
            done = side.record_event()
        if order == "wait_stream":
            compute.wait_stream(side)
        elif order == "wait_event":
            compute.wait_event(done)
        elif order == "event.wait":
            done.wait()
        out = dst * 2
        assert torch.equal(out.cpu(), src.cpu() * 2)
        if order.startswith("no wait"):
            torch.cuda.synchronize()  # (else dropping them would be "freed while in use" too)
        del src, dst, out
    return vdev


@pytest.mark.parametrize("order", ["wait_stream", "wait_event", "event.wait"])
def test_ordered_side_stream_copy_has_no_race(order):
    assert _side_stream_copy(order).races == []


def test_a_side_stream_copy_read_without_a_wait_is_a_race():
    races = _side_stream_copy("no wait after").races
    assert [r.kind for r in races] == ["read after write"]
    (race,) = races
    assert race.first.stream != race.second.stream and race.first.write and not race.second.write
    assert "copy_" in race.first.op and "mul" in race.second.op
    assert HERE in race.first.stack[0] and HERE in race.second.stack[0]  # both accesses' stacks
    assert "dst.copy_(src)" not in race.first.stack[0]  # frames, not source text
    assert str(race).count(HERE) >= 2


def test_a_side_stream_without_waiting_for_the_producer_is_a_race():
    kinds = [r.kind for r in _side_stream_copy("no wait before").races]
    # the copy reads src and writes dst, both made on the compute stream; then compute reads dst unordered
    assert kinds == ["read after write", "write after write", "read after write"]


def test_a_race_fails_the_context_at_exit():
    with pytest.raises(VirtualCudaError, match="read after write") as err:
        with VirtualCuda():
            side = torch.cuda.Stream()
            x = torch.ones(4, device="cuda")
            with torch.cuda.stream(side):
                x.add_(1)
            x.sum()
    assert HERE in str(err.value)


def test_a_write_through_a_view_races_with_a_read_of_its_base():
    with VirtualCuda(check=False) as vdev:
        side = torch.cuda.Stream()
        x = torch.zeros(8, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x[4:].fill_(1)
        x[:4].sum()
    assert [r.kind for r in vdev.races] == ["read after write"]


def _pinned_reuse(sync: str, host_lead: int | None = None) -> VirtualCuda:
    """An asynchronous copy out of a pinned buffer, then the host writes the buffer again (a pool reusing it)."""
    with VirtualCuda(check=False, host_lead=host_lead) as vdev:
        h2d = torch.cuda.Stream()
        buf = torch.empty(256, pin_memory=True)
        buf.fill_(1.0)
        dev = torch.empty(256, device="cuda")
        h2d.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(h2d):
            dev.copy_(buf, non_blocking=True)
            read = h2d.record_event()
        if sync == "event.synchronize":
            read.synchronize()
        elif sync == "query":
            assert read.query() == (host_lead == 0)
        elif sync == "stream.synchronize":
            h2d.synchronize()
        elif sync == "device synchronize":
            torch.cuda.synchronize()
        buf.fill_(2.0)
        torch.cuda.current_stream().wait_event(read)
        del dev
    return vdev


@pytest.mark.parametrize("sync", ["event.synchronize", "stream.synchronize", "device synchronize"])
def test_a_pinned_buffer_reused_after_its_copy_is_ordered_with_the_host(sync):
    assert _pinned_reuse(sync).races == []


def test_a_pinned_buffer_reused_under_a_pending_copy_is_a_race():
    races = _pinned_reuse("none").races
    assert [(r.kind, r.first.stream == "host", r.second.stream == "host") for r in races] == [
        ("write after read", False, True)
    ]
    assert "pinned host storage" in races[0].storage
    # a query that says "done" orders it too; one that says "not yet" does not
    assert _pinned_reuse("query", host_lead=0).races == []
    assert len(_pinned_reuse("query", host_lead=None).races) == 1


def test_the_host_reading_a_pending_device_to_host_copy_is_a_race():
    with VirtualCuda(check=False) as vdev:
        d2h = torch.cuda.Stream()
        host = torch.empty(16, pin_memory=True)
        x = torch.arange(16.0, device="cuda")
        d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d2h):
            host.copy_(x, non_blocking=True)
            written = d2h.record_event()
        host.sum()
        written.synchronize()
        host.sum()
        x.record_stream(d2h)
        del x
    assert [(r.kind, r.second.stream) for r in vdev.races] == [("read after write", "host")]


def _freed_in_flight(cover: str) -> VirtualCuda:
    """A tensor made on the compute stream, copied to the host on a side stream, then dropped."""
    with VirtualCuda(check=False) as vdev:
        compute, d2h = _stream_pair()
        host = torch.empty(1024, pin_memory=True)
        base = torch.cuda.memory_allocated()
        t = torch.randn(1024, device="cuda")
        d2h.wait_stream(compute)
        with torch.cuda.stream(d2h):
            host.copy_(t, non_blocking=True)
            copied = d2h.record_event()
        if cover == "record_stream":
            t.record_stream(d2h)
        elif cover == "wait_event":
            compute.wait_event(copied)
        del t
        vdev.held_after_free = torch.cuda.memory_allocated() - base
        d2h.synchronize()
        vdev.held_after_sync = torch.cuda.memory_allocated() - base
    return vdev


def test_a_tensor_freed_with_a_copy_in_flight_is_an_error():
    vdev = _freed_in_flight("nothing")
    assert [r.kind for r in vdev.races] == ["freed while in use"]
    assert "free" in vdev.races[0].second.op and HERE in vdev.races[0].second.stack[0]


def test_record_stream_keeps_the_memory_until_the_stream_has_run_it():
    vdev = _freed_in_flight("record_stream")
    assert vdev.races == [] and vdev.held_after_free == 4096 and vdev.held_after_sync == 0


def test_the_allocating_stream_waiting_for_the_copy_frees_at_once():
    vdev = _freed_in_flight("wait_event")
    assert vdev.races == [] and vdev.held_after_free == 0


# ----------------------------------------------------------------------------------------------------- host syncs
def test_pageable_copies_in_a_loop_are_counted_per_iteration(virtual_cuda):
    pageable, pinned = torch.ones(64), torch.ones(64).pin_memory()
    dev = torch.empty(64, device="cuda")
    start = virtual_cuda.sync_count
    for _ in range(5):
        dev.copy_(pageable, non_blocking=True)
    assert virtual_cuda.sync_count - start == 5
    assert {s.kind for s in virtual_cuda.syncs[start:]} == {"pageable H2D copy"}
    start = virtual_cuda.sync_count
    for _ in range(5):
        dev.copy_(pinned, non_blocking=True)
    assert virtual_cuda.sync_count == start  # pinned and asynchronous: no sync
    torch.cuda.synchronize()


def test_item_is_counted_with_its_stack(virtual_cuda):
    x = torch.arange(4.0, device="cuda")
    start = virtual_cuda.sync_count
    value = x.sum().item()  # the line the sync must point at
    assert value == 6.0 and virtual_cuda.sync_count == start + 1
    sync = virtual_cuda.syncs[-1]
    assert sync.kind == "item()" and sync.stack[0].endswith("in test_item_is_counted_with_its_stack")
    assert f"{HERE}:" in sync.stack[0]


def test_every_kind_of_host_sync_is_counted(virtual_cuda):
    x = torch.arange(6.0, device="cuda")
    s = torch.cuda.Stream()
    calls = {
        "bool()": lambda: bool(x[1] > 0),
        "int()": lambda: int(x[2]),
        "float()": lambda: float(x[3]),
        "tolist": lambda: x.tolist(),
        "pageable D2H copy": lambda: x.cpu(),
        "torch.tensor(..., device=cuda)": lambda: torch.tensor([1, 2], device="cuda"),
        "data-dependent shape (nonzero)": lambda: torch.nonzero(x),
        "data-dependent shape (boolean mask index)": lambda: x[x > 2],
        "data-dependent shape (unique)": lambda: torch.unique(x),
        "data-dependent shape (masked_select)": lambda: torch.masked_select(x, x > 2),
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "torch.accelerator.synchronize": torch.accelerator.synchronize,
        "Stream.synchronize": s.synchronize,
        "Event.synchronize": lambda: s.record_event().synchronize(),
    }
    for kind, call in calls.items():
        start = virtual_cuda.sync_count
        call()
        assert [y.kind for y in virtual_cuda.syncs[start:]] == [kind]
    start = virtual_cuda.sync_count
    y = (x * 2).sum(0, keepdim=True).expand(6).contiguous()  # no value leaves the device
    s.wait_stream(torch.cuda.current_stream())
    assert virtual_cuda.sync_count == start and y.is_cuda
