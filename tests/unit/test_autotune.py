"""chunk_size="auto" and offload="auto": the rule c >= kappa * F / B with injected measurements."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.autotune import (
    MAX_CHUNK,
    MIN_CHUNK,
    REFERENCE_SEQ_LEN,
    TIE_TOLERANCE,
    Autotuner,
    attention_bytes_per_token,
    measure_block_overhead,
    modelled_attention_seconds,
    pick_chunk_size,
)

GIB = 1 << 30


LONG = 1 << 22  # a sequence long enough that the first-fetch and last-chunk terms do not matter


def overlap_kappa(elem_bytes: int, kv_ratio: float = 1.0) -> float:
    """``kappa`` of ``c >= kappa * F / B`` (the module docstring of hf_fpdt.attention.autotune): host-link bytes per
    element per 12 FLOPs. The rule never computes it; it is what the modelled time must land at."""
    return (2 * elem_bytes * kv_ratio + 3 * elem_bytes + 4) / 12.0


@pytest.mark.parametrize("flops,bandwidth", [(400e12, 25e9), (989e12, 50e9), (312e12, 12e9), (50e12, 25e9)])
@pytest.mark.parametrize("elem_bytes,kv_ratio", [(2, 1.0), (2, 0.125), (4, 1.0)])
@pytest.mark.parametrize("sp_size", [1, 3, 8])
def test_without_fixed_cost_a_long_sequence_lands_at_the_overlap_bound(flops, bandwidth, elem_bytes, kv_ratio, sp_size):
    c = pick_chunk_size(flops, bandwidth, elem_bytes=elem_bytes, kv_ratio=kv_ratio, sp_size=sp_size, seq_len=LONG)
    need = overlap_kappa(elem_bytes, kv_ratio) * flops / bandwidth
    step = math.lcm(1024, sp_size)
    assert c % step == 0
    assert MIN_CHUNK <= c <= MAX_CHUNK
    if need <= MIN_CHUNK:
        assert c == step * math.ceil(MIN_CHUNK / step)
    else:  # c = kappa F / B, less the 1% tie tolerance (transfer-bound time falls as 1 / c)
        assert need / (1 + 2 * TIE_TOLERANCE) - step < c <= need + step


def test_kappa_is_about_one_for_bf16():
    assert overlap_kappa(2, 1.0) == pytest.approx(14 / 12)
    assert overlap_kappa(2, 0.125) == pytest.approx(10.5 / 12)
    # bf16 MHA on an H100-like machine: F = 400 TFLOP/s, B = 25 GB/s -> F/B = 16000 tokens, bound 18667
    assert 18432 <= pick_chunk_size(400e12, 25e9, elem_bytes=2, seq_len=LONG) <= 19456


def _brute_force_seconds(c, seq_len, flops, bandwidth, fixed_s, b, r, e):
    """The modelled time summed block by block (the closed form must agree)."""
    sizes = [min(c, seq_len - o) for o in range(0, seq_len, c)]
    total = 0.0
    for j, cq in enumerate(sizes):
        for ck in sizes[:j]:
            total += fixed_s + max(12 * cq * ck * e / flops, (2 * b * r * ck + (3 * b + 4) * cq) * e / bandwidth)
        total += fixed_s + 6 * cq * cq * e / flops
    return total + (2 * b * r + 3 * b) * sizes[0] * e / bandwidth


@pytest.mark.parametrize("c,seq_len", [(1024, 5000), (4096, 4096), (6144, 32768), (16384, 32768), (8192, 3000)])
def test_modelled_time_sums_the_blocks(c, seq_len):
    args = dict(flops=300e12, bandwidth=25e9, fixed_s=2e-3, elem_bytes=2, kv_ratio=0.25)
    got = modelled_attention_seconds(c, seq_len=seq_len, width=2048, sp_size=2, **args)
    want = _brute_force_seconds(c, seq_len, 300e12, 25e9, 2e-3, 2, 0.25, 1024)
    assert got == pytest.approx(want, rel=1e-12)


def test_a_fixed_cost_per_block_moves_the_chunk_up():
    """The issue's H100 case (llama-1b: width 2048, 8:32 KV heads, bf16; 32K tokens): without a fixed cost the
    rule stays near kappa F / B; with a few ms per block it lands on 16384, the best measured fixed chunk."""
    shape = dict(elem_bytes=2, kv_ratio=0.25, width=2048, seq_len=32768)
    free = pick_chunk_size(300e12, 25e9, **shape)
    costly = pick_chunk_size(300e12, 25e9, fixed_s=3e-3, **shape)
    assert free < 16384 and costly == 16384
    for fixed_s, pick in ((0.0, free), (3e-3, costly)):  # the pick is the model's best (within the tie tolerance)
        times = {c: modelled_attention_seconds(c, flops=300e12, bandwidth=25e9, fixed_s=fixed_s, **shape)
                 for c in range(1024, 32768 + 1, 1024)}  # fmt: skip
        assert times[pick] <= min(times.values()) * (1 + TIE_TOLERANCE)
        assert all(t > min(times.values()) * (1 + TIE_TOLERANCE) for c, t in times.items() if c < pick)
    # longer sequences amortise the exposed first fetch: the fixed cost pushes the chunk further up
    assert pick_chunk_size(300e12, 25e9, fixed_s=3e-3, **{**shape, "seq_len": 131072}) > 16384


def test_pick_clamps_to_bounds():
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2) == MIN_CHUNK  # transfer is free: smallest chunk
    assert pick_chunk_size(1e18, 1e6, elem_bytes=2, seq_len=LONG) == MAX_CHUNK  # hopeless link: largest chunk
    assert pick_chunk_size(1e18, 1e6, elem_bytes=2, seq_len=5000) == 5120  # never beyond the sequence
    assert pick_chunk_size(1e18, 1e6, elem_bytes=2) == REFERENCE_SEQ_LEN  # the length modelled when unknown
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2, sp_size=3) == 3072  # lower bound aligned to sp_size
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2, bounds=(4096, 8192)) == 4096


def test_memory_budget_lowers_the_chunk():
    free_pick = pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096)
    per_token = attention_bytes_per_token(2, 4096)
    budget = 8192.5 * per_token  # fits 8192 tokens, not free_pick
    assert free_pick > 8192
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096, memory_budget=budget) == 8192
    # with SP the per-rank footprint per token shrinks (heads / P), though by less than P: dO is fetched per block too
    per_rank = attention_bytes_per_token(2, 4096, sp_size=2)
    assert per_token / 2 < per_rank < per_token
    sp_budget = 16384.5 * per_rank
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096, memory_budget=sp_budget, sp_size=2) == 16384
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096, memory_budget=budget, sp_size=2) > 8192
    # never below the lower bound, even if nothing fits
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, memory_budget=1.0) == MIN_CHUNK


def test_pick_rejects_nonsense_measurements():
    with pytest.raises(ValueError, match="positive"):
        pick_chunk_size(0.0, 1e9, elem_bytes=2)
    with pytest.raises(ValueError, match="positive"):
        pick_chunk_size(1e12, 1e9, elem_bytes=2, fixed_s=-1.0)


class Counting:
    """Injected measurements that count their calls."""

    def __init__(
        self, flops: float, bandwidth: float, free: int = 60 * GIB, total: int = 80 * GIB, fixed_s: float = 0.0
    ) -> None:
        self.values = (flops, bandwidth, free, total, fixed_s)
        self.calls = {"flops": 0, "bandwidth": 0, "memory": 0, "overhead": 0}

    def tuner(self, **kwargs) -> Autotuner:
        return Autotuner(
            measure_flops=self.flops,
            measure_bandwidth=self.bandwidth,
            memory_info=self.memory,
            measure_overhead=self.overhead,
            **kwargs,
        )

    def overhead(self, device, dtype, flops):
        assert flops == self.values[0]  # t0 is measured net of the compute at the measured F
        self.calls["overhead"] += 1
        return self.values[4]

    def flops(self, device, dtype):
        self.calls["flops"] += 1
        return self.values[0]

    def bandwidth(self, device):
        self.calls["bandwidth"] += 1
        return self.values[1]

    def memory(self, device):
        self.calls["memory"] += 1
        return self.values[2], self.values[3]


def test_autotuner_measures_once_per_device_and_dtype():
    fake = Counting(400e12, 25e9)
    tuner = fake.tuner()
    dev = torch.device("cuda", 0)  # a descriptor only: nothing runs on it
    c = tuner.measured_chunk_size(dev, dtype=torch.bfloat16)
    assert c == pick_chunk_size(400e12, 25e9, elem_bytes=2, memory_budget=0.25 * 60 * GIB)
    assert tuner.measured_chunk_size(dev, dtype=torch.bfloat16, sp_size=6) % 3072 == 0  # lcm(1024, 6)
    assert fake.calls == {"flops": 1, "bandwidth": 1, "memory": 1, "overhead": 1}
    tuner.measured_chunk_size(dev, dtype=torch.float32)  # another dtype: F is measured again
    assert fake.calls["flops"] == 2
    m = tuner.measurements()[(str(dev), torch.bfloat16)]
    assert (m.flops, m.bandwidth, m.free_bytes) == (400e12, 25e9, 60 * GIB)


def test_autotuner_memory_fraction_binds_on_small_free_memory():
    fake = Counting(400e12, 25e9, free=4 * GIB)
    tuner = fake.tuner(memory_fraction=0.25)
    c = tuner.measured_chunk_size(torch.device("cuda", 0), dtype=torch.bfloat16, width=8192)
    assert c * attention_bytes_per_token(2, 8192) <= 0.25 * 4 * GIB
    assert (
        c
        == 1024 * int(0.25 * 4 * GIB / attention_bytes_per_token(2, 8192) // 1024)
        < pick_chunk_size(400e12, 25e9, elem_bytes=2, width=8192)
    )


def test_runtime_resolves_auto_once_with_its_tuner():
    fake = Counting(1e12, 1e8, fixed_s=1e-3)  # F/B = 10000 tokens
    runtime = FPDTRuntime(FPDTConfig(chunk_size="auto"), autotuner=fake.tuner())
    sizes = runtime.chunk_sizes(40000, torch.device("cpu"), dtype=torch.float32, width=256)  # seq_len 40000
    c = runtime.global_chunk_size(torch.device("cpu"))
    want = pick_chunk_size(1e12, 1e8, elem_bytes=4, width=256, memory_budget=15 * GIB, fixed_s=1e-3, seq_len=40000)
    assert c == want and sum(sizes) == 40000 and sizes[0] == c
    assert runtime.config.chunk_size == "auto"  # kept in the runtime, never written into a config
    assert runtime.global_chunk_size(torch.device("cpu")) == c  # every layer and step uses the same chunks
    assert fake.calls["flops"] == 1


def test_the_tuner_measures_the_runtimes_backend_and_refuses_an_impossible_one():
    seen = []
    fake = Counting(1e12, 1e8)
    tuner = Autotuner(
        measure_flops=lambda device, dtype, backend=None: seen.append(("F", backend)) or 1e12,
        measure_overhead=lambda device, dtype, flops, backend=None: seen.append(("t0", backend)) or 0.0,
        measure_bandwidth=fake.bandwidth,
        memory_info=fake.memory,
        backend="math",
    )
    tuner.measure(torch.device("cpu"))
    assert seen == [("F", "math"), ("t0", "math")]
    runtime = FPDTRuntime(FPDTConfig(chunk_size="auto", backend="cudnn"), autotuner=Autotuner(backend="cudnn"))
    with pytest.raises(ValueError, match="'cudnn' cannot run"):
        runtime.global_chunk_size(torch.device("cpu"))


def test_real_measurements_on_cpu_are_positive_and_pick_a_valid_chunk():
    tuner = Autotuner()
    m = tuner.measure(torch.device("cpu"))
    assert m.flops > 0 and m.bandwidth > 0 and 0.0 <= m.fixed_s < 1.0
    c = tuner.measured_chunk_size(torch.device("cpu"))
    assert MIN_CHUNK <= c <= MAX_CHUNK and c % 1024 == 0


def test_block_overhead_grows_with_the_work_it_is_not_told_about():
    """t0 is what the pipeline costs beyond the compute at F: claiming a lower F leaves less of it unexplained."""
    cpu = torch.device("cpu")
    honest = measure_block_overhead(cpu, torch.float32, flops=1e18)  # compute ~0: all of it is fixed cost
    assert honest > 0.0
    assert measure_block_overhead(cpu, torch.float32, flops=1e3) == 0.0  # "compute" explains more than all


# offload="auto" -------------------------------------------------------------------------------------


def test_offload_auto_is_off_on_cpu():
    fake = Counting(1e12, 1e9)
    assert fake.tuner().offload(torch.device("cpu")) == (False, 0)
    assert fake.calls["memory"] == 0  # nothing to measure: host memory is device memory
    runtime = FPDTRuntime(FPDTConfig(offload="auto"), autotuner=fake.tuner())
    assert runtime.store(torch.device("cpu")).enabled is False


@pytest.mark.parametrize("free", [0, 3 * GIB, 70 * GIB])
def test_offload_auto_keeps_a_share_of_free_device_memory_resident(free):
    fake = Counting(1e12, 1e9, free=free)
    enabled, resident = fake.tuner(resident_fraction=0.4).offload(torch.device("cuda", 0))
    assert enabled is True
    assert resident == int(0.4 * free)
