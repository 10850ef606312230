"""The host store's CUDA path on the virtual CUDA device (``tests/virtual_cuda.py``; issue 49, finding 2): puts copy
chunks to pinned host buffers on the device-to-host stream, fetches bring them back through the staging ring.

* device memory does not depend on how far the host runs ahead of the device: a loop of puts and fetches with the
  device one chunk behind the host and with it a whole loop (50 chunks) behind peaks at the same bytes, the same at
  10 chunks as at 50. An offload that left its source tensors to ``record_stream`` did not: their memory came back
  only when the device had run their copies, so a host that ran ahead held every chunk it had put;
* no race over a whole put / fetch / release cycle, spills of resident tensors and accumulator updates included;
* no host synchronisation in the loops: none per chunk, none per step;
* the same on a whole attention forward + backward with offload (``fpdt_attention``, the math kernel: the fused CUDA
  kernels do not run on the CPU): no race, no host sync, device memory growing per chunk by the step's outputs only
  however far the host runs ahead, and the results equal the CPU path's bit for bit;
* a checkpointed Llama training step with every chunk and layer input offloaded (``device_memory=0``): no race, the
  same few host syncs per step at 4 and 8 chunks (none per chunk), loss and gradients equal to the CPU path's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from testkit import tiny_model
from virtual_cuda import VirtualCuda

import hf_fpdt
from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.memory.host_store import HostStore, Prefetch
from hf_fpdt.memory.staging import WRITES_IN_FLIGHT

SHAPE = (1, 64, 4, 16)  # one chunk: 16 KiB in float32
CHUNK_BYTES = 64 * 4 * 16 * 4
CUDA = torch.device("cuda", 0)


def _cycle(vdev: VirtualCuda, n: int) -> dict:
    """Put ``n`` chunks (each made by a kernel and dropped by the caller at once), fetch them back in order through a
    :class:`Prefetch`, each read by a kernel, release them; the device peak and host syncs of the loops."""
    store = HostStore(CUDA, enabled=True)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    syncs = vdev.sync_count
    slots = []
    for i in range(n):
        chunk = torch.full(SHAPE, float(i), device=CUDA) * 2
        slots.append(store.put(chunk))
        del chunk
    put_peak = torch.cuda.max_memory_allocated() - base
    put_syncs = vdev.sync_count - syncs
    total = torch.zeros((), device=CUDA)
    prefetch = Prefetch(store, [(s,) for s in slots])
    for _ in range(n):
        (chunk,) = prefetch.take()
        total += chunk.sum()
        del chunk
    for slot in slots:
        store.release(slot)
    loop_syncs = vdev.sync_count - syncs
    peak = torch.cuda.max_memory_allocated() - base
    expected = sum(2.0 * i for i in range(n)) * CHUNK_BYTES / 4
    assert total.item() == expected  # the numbers made the round trip
    ring = store.staging_bytes
    return {"put_peak": put_peak, "peak": peak, "put_syncs": put_syncs, "syncs": loop_syncs, "ring": ring}


def _kernels_per_chunk() -> int:
    with VirtualCuda() as vdev:
        store = HostStore(CUDA, enabled=True)
        slots = [store.put(torch.full(SHAPE, 1.0, device=CUDA) * 2)]
        start = vdev.launches
        slots.append(store.put(torch.full(SHAPE, 1.0, device=CUDA) * 2))
        per_chunk = vdev.launches - start
        torch.cuda.synchronize()
        del slots
    return per_chunk


def _run(n: int, chunks_ahead: int) -> dict:
    with VirtualCuda(host_lead=chunks_ahead * _kernels_per_chunk()) as vdev:
        return _cycle(vdev, n)


def test_device_memory_does_not_grow_with_the_host_lead():
    one, ten, fifty = _run(50, 1), _run(50, 10), _run(50, 50)
    short = _run(10, 50)
    # bounded: the live chunk, the sources held for their copies, the staging ring (no chunk per chunk put)
    bound = CHUNK_BYTES + 2 * WRITES_IN_FLIGHT * CHUNK_BYTES + fifty["ring"] + 64
    for run in (one, ten, fifty, short):
        assert run["peak"] <= bound, (run, bound)
        assert run["syncs"] == 0
    # the same peak 10 and 50 chunks ahead, over 10 and 50 chunks; one chunk ahead, the held sources' copies are
    # done (query) before the bound is reached: at most the bound's chunks less
    assert fifty["put_peak"] == ten["put_peak"] == short["put_peak"]
    assert fifty["peak"] == ten["peak"] == short["peak"]
    assert 0 <= fifty["put_peak"] - one["put_peak"] <= WRITES_IN_FLIGHT * CHUNK_BYTES


def test_a_put_fetch_release_cycle_has_no_race_and_no_host_sync(virtual_cuda):
    result = _cycle(virtual_cuda, 12)
    assert result["syncs"] == 0 and result["put_syncs"] == 0
    # the fixture fails the test at teardown on any race; none recorded so far either
    assert virtual_cuda.races == []


@pytest.mark.parametrize("host_lead", [None, 0])
def test_spills_and_accumulator_updates_have_no_race_and_no_host_sync(host_lead):
    """Resident tensors spilled to the host to make room (the device budget), and an accumulator fetched, updated
    on the device and put back into its slot, several rounds: the checker finds no race, the loop no host sync."""
    with VirtualCuda(host_lead=host_lead) as vdev:
        store = HostStore(CUDA, enabled=True, resident_bytes=2 * CHUNK_BYTES)
        syncs = vdev.sync_count
        lasting = [store.put(torch.full(SHAPE, float(i), device=CUDA), lasting=True) for i in range(5)]
        assert store.budget.spilled == 3 * CHUNK_BYTES  # three went to the host to make room
        acc = store.put(torch.zeros(SHAPE, device=CUDA))
        for i in range(6):
            current = store.fetch(acc).wait()
            store.put(current.add_(float(i)), acc)
            del current
        values = [store.get(s).sum() for s in lasting]
        final = store.get(acc)
        assert vdev.sync_count == syncs
        assert [v.item() for v in values] == [float(i) * CHUNK_BYTES / 4 for i in range(5)]
        assert torch.equal(final.cpu(), torch.full(SHAPE, 15.0))
        del values, final
        for s in [*lasting, acc]:
            store.release(s)


def test_a_buffer_a_put_takes_while_its_fetch_is_in_flight_is_written_after_the_fetch(virtual_cuda):
    """A slot released while its fetch is still copying (the compute stream not yet waiting for it): the pool hands
    the buffer to the next put, whose copy to the host must wait for that fetch's read, not only for compute."""
    store = HostStore(CUDA, enabled=True)
    first = store.put(torch.full(SHAPE, 1.0, device=CUDA))
    buffer = first.buffer
    fetched = store.fetch(first)
    store.release(first)
    second = store.put(torch.full(SHAPE, 2.0, device=CUDA))
    assert second.buffer is buffer  # the same pinned buffer, reused
    assert torch.equal(fetched.wait().cpu(), torch.full(SHAPE, 1.0))
    assert torch.equal(store.get(second).cpu(), torch.full(SHAPE, 2.0))
    store.release(second)
    assert virtual_cuda.races == []


HEADS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 64  # an attention chunk of 64 tokens


def _attention_step(device: torch.device, chunks: int, vdev: VirtualCuda | None = None, timed: bool = False) -> dict:
    """``fpdt_attention`` forward + backward over ``chunks`` chunks (the last one half), everything offloaded; on
    ``vdev``, the host syncs of the forward + backward. ``timed``: the transfer statistics on (their own wait path)."""
    seq = chunks * TOKENS - TOKENS // 2
    runtime = FPDTRuntime(FPDTConfig(chunk_size=TOKENS, offload=True, backend="math"))
    runtime.transfer_stats.enabled = timed
    g = torch.Generator().manual_seed(chunks)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=g).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(1, seq, HEADS, HEAD_DIM, generator=g).to(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    syncs = vdev.sync_count if vdev is not None else 0
    out = fpdt_attention(q, k, v, runtime)
    out.backward(dout)
    syncs = vdev.sync_count - syncs if vdev is not None else 0
    result = {"tensors": [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)], "syncs": syncs}
    if device.type == "cuda":
        result["peak"] = torch.cuda.max_memory_allocated() - base
        result["ring"] = runtime.store(device).staging_bytes
        assert runtime.store(device).host_bytes > 0  # the chunks went through the host
    return result


def test_the_timed_transfers_take_the_same_orderings():
    """With the transfer statistics on (``TransferStats``: the copies and the compute stream's waits between timing
    events), the offloaded step is as race- and sync-free as without, and its numbers the same: the timed wait path
    orders the streams too (no other test turns the statistics on)."""
    for chunks in (4, 8):
        with VirtualCuda() as vdev:  # a race fails at exit
            timed = _attention_step(CUDA, chunks, vdev, timed=True)
        assert timed["syncs"] == 0
        plain = _attention_step(torch.device("cpu"), chunks)
        assert all(torch.equal(a, b) for a, b in zip(timed["tensors"], plain["tensors"]))


def _virtual_steps(host_lead: int | None) -> dict:
    steps = {}
    for chunks in (4, 8, 16):
        with VirtualCuda(host_lead=host_lead) as vdev:  # a race fails at exit
            steps[chunks] = _attention_step(CUDA, chunks, vdev)
    return steps


def test_an_offloaded_attention_step_is_race_free_sync_free_and_bounded():
    ahead, behind = _virtual_steps(None), _virtual_steps(0)  # the host infinitely ahead / the device keeping up
    outputs = TOKENS * (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * 4  # out, dq, dk, dv of one chunk (float32)
    held = WRITES_IN_FLIGHT * TOKENS * HEADS * HEAD_DIM * 4  # the puts held for their copies (q-sized)
    for steps in (ahead, behind):
        assert all(s["syncs"] == 0 for s in steps.values())
        assert steps[8]["ring"] == steps[16]["ring"]  # the staging ring: a few stages per size class
        for a, b in ((4, 8), (8, 16)):  # beyond the ring, the step grows per chunk by its outputs
            growth = (steps[b]["peak"] - steps[b]["ring"]) - (steps[a]["peak"] - steps[a]["ring"])
            assert growth <= (b - a) * outputs, (a, b, growth / outputs)
    for chunks in (4, 8, 16):
        assert 0 <= ahead[chunks]["peak"] - behind[chunks]["peak"] <= held
        cpu = _attention_step(torch.device("cpu"), chunks)["tensors"]
        assert all(torch.equal(a, b) for a, b in zip(ahead[chunks]["tensors"], cpu))


def _training_step(model: torch.nn.Module, device: torch.device, tokens: int, vdev: VirtualCuda | None = None) -> dict:
    """A checkpointed step of ``model`` (a copy, on ``device``) over ``tokens`` tokens, after a first step (which
    probes and plans); on ``vdev``, the second step's host syncs."""
    model = hf_fpdt.apply(
        copy.deepcopy(model).to(device),
        FPDTConfig(chunk_size=TOKENS, offload=True, device_memory=0, backend="math"),
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
    syncs = vdev.sync_count if vdev is not None else 0
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    syncs = [s.kind for s in vdev.syncs[syncs:]] if vdev is not None else []
    if device.type == "cuda":
        assert model.fpdt.runtime.store(device).host_bytes > 0  # the chunks went through the host
        assert model.fpdt.layer_offloader.store(device).host_bytes > 0  # and the layer inputs
    return {"tensors": [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters()], "syncs": syncs}


def test_a_checkpointed_training_step_offloading_everything():
    model = tiny_model(
        "llama", "sdpa", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    steps = {}
    for chunks in (4, 8):
        with VirtualCuda() as vdev:  # a race fails at exit
            steps[chunks] = _training_step(model, CUDA, chunks * TOKENS, vdev)
        cpu = _training_step(model, torch.device("cpu"), chunks * TOKENS)
        assert all(torch.equal(a, b) for a, b in zip(steps[chunks]["tensors"], cpu["tensors"]))
    # a few per step (HF's packed-sequence check, the tiled loss's one look at its targets), none per chunk
    assert steps[4]["syncs"] == steps[8]["syncs"] and len(steps[8]["syncs"]) <= 3, steps[8]["syncs"]
