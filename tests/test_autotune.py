"""chunk_size="auto" and offload="auto": the rule c >= kappa * F / B with injected measurements."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.autotune import (
    MAX_CHUNK,
    MIN_CHUNK,
    Autotuner,
    attention_bytes_per_token,
    overlap_kappa,
    pick_chunk_size,
    resolve_offload,
)

GIB = 1 << 30


@pytest.mark.parametrize("flops,bandwidth", [(400e12, 25e9), (989e12, 50e9), (312e12, 12e9), (50e12, 25e9)])
@pytest.mark.parametrize("elem_bytes,kv_ratio", [(2, 1.0), (2, 0.125), (4, 1.0)])
@pytest.mark.parametrize("sp_size", [1, 3, 8])
def test_pick_is_smallest_aligned_chunk_above_the_bound(flops, bandwidth, elem_bytes, kv_ratio, sp_size):
    c = pick_chunk_size(flops, bandwidth, elem_bytes=elem_bytes, kv_ratio=kv_ratio, sp_size=sp_size)
    need = overlap_kappa(elem_bytes, kv_ratio) * flops / bandwidth
    step = math.lcm(1024, sp_size)
    assert c % step == 0
    assert MIN_CHUNK <= c <= MAX_CHUNK
    assert c >= need or c + step > MAX_CHUNK  # above the bound unless clamped at the top
    assert c - step < max(need, MIN_CHUNK)  # and the smallest such multiple


def test_kappa_is_about_one_for_bf16():
    assert overlap_kappa(2, 1.0) == pytest.approx(14 / 12)
    assert overlap_kappa(2, 0.125) == pytest.approx(10.5 / 12)
    # bf16 MHA on an H100-like machine: F = 400 TFLOP/s, B = 25 GB/s -> F/B = 16000 tokens
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2) == 19456  # 1.167 * 16000 = 18667 -> 19 * 1024


def test_pick_clamps_to_bounds():
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2) == MIN_CHUNK  # transfer is free: smallest chunk
    assert pick_chunk_size(1e18, 1e6, elem_bytes=2) == MAX_CHUNK  # hopeless link: largest chunk
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2, sp_size=3) == 3072  # lower bound aligned to sp_size
    assert pick_chunk_size(1e9, 1e12, elem_bytes=2, bounds=(4096, 8192)) == 4096


def test_memory_budget_lowers_the_chunk():
    free_pick = pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096)
    per_token = attention_bytes_per_token(2, 4096)
    budget = 8192.5 * per_token  # fits 8192 tokens, not free_pick
    assert free_pick > 8192
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096, memory_budget=budget) == 8192
    # with SP the per-rank footprint shrinks, so the same budget fits a P times larger chunk
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, width=4096, memory_budget=budget, sp_size=2) == 16384
    # never below the lower bound, even if nothing fits
    assert pick_chunk_size(400e12, 25e9, elem_bytes=2, memory_budget=1.0) == MIN_CHUNK


def test_pick_rejects_nonsense_measurements():
    with pytest.raises(ValueError, match="positive"):
        pick_chunk_size(0.0, 1e9, elem_bytes=2)


class Counting:
    """Injected measurements that count their calls."""

    def __init__(self, flops: float, bandwidth: float, free: int = 60 * GIB, total: int = 80 * GIB) -> None:
        self.values = (flops, bandwidth, free, total)
        self.calls = {"flops": 0, "bandwidth": 0, "memory": 0}

    def tuner(self, **kwargs) -> Autotuner:
        return Autotuner(measure_flops=self.flops, measure_bandwidth=self.bandwidth, memory_info=self.memory, **kwargs)

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
    assert fake.calls == {"flops": 1, "bandwidth": 1, "memory": 1}
    tuner.measured_chunk_size(dev, dtype=torch.float32)  # another dtype: F is measured again
    assert fake.calls["flops"] == 2
    m = tuner.measurements()[(str(dev), torch.bfloat16)]
    assert (m.flops, m.bandwidth, m.free_bytes) == (400e12, 25e9, 60 * GIB)


def test_autotuner_memory_fraction_binds_on_small_free_memory():
    fake = Counting(400e12, 25e9, free=2 * GIB)
    tuner = fake.tuner(memory_fraction=0.25)
    c = tuner.measured_chunk_size(torch.device("cuda", 0), dtype=torch.bfloat16, width=8192)
    assert c * attention_bytes_per_token(2, 8192) <= 0.25 * 2 * GIB
    assert c == 1024 * int(0.25 * 2 * GIB / attention_bytes_per_token(2, 8192) // 1024)


def test_runtime_resolves_auto_once_with_its_tuner():
    fake = Counting(1e12, 1e8)  # F/B = 10000 tokens
    runtime = FPDTRuntime(FPDTConfig(chunk_size="auto"), autotuner=fake.tuner())
    c = runtime.global_chunk_size(torch.device("cpu"), dtype=torch.float32, width=256)
    assert c == pick_chunk_size(1e12, 1e8, elem_bytes=4, width=256, memory_budget=0.25 * 60 * GIB)
    assert runtime.config.chunk_size == "auto"  # kept in the runtime, never written into a config
    assert runtime.global_chunk_size(torch.device("cpu")) == c  # every layer and step uses the same chunks
    assert fake.calls["flops"] == 1


def test_resolve_offload_accepts_an_injected_tuner():
    fake = Counting(1e12, 1e8)
    assert resolve_offload(torch.device("cpu"), tuner=fake.tuner()) == (False, 0)


def test_real_measurements_on_cpu_are_positive_and_pick_a_valid_chunk():
    tuner = Autotuner()
    m = tuner.measure(torch.device("cpu"))
    assert m.flops > 0 and m.bandwidth > 0
    c = tuner.measured_chunk_size(torch.device("cpu"))
    assert MIN_CHUNK <= c <= MAX_CHUNK and c % 1024 == 0


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
