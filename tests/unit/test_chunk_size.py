"""One place resolves the chunk size: integers pass, "auto" is measured and agreed, no config is written."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from test_autotune import GIB, Counting
from transformers import AutoConfig

from hf_fpdt import FPDTConfig, FPDTRuntime
from hf_fpdt.attention.autotune import pick_chunk_size
from hf_fpdt.data.chunk_size import chunk_hints, resolve_chunk_size

CPU = torch.device("cpu")


def test_an_integer_setting_is_used_as_it_is():
    fake = Counting(1e12, 1e8)
    assert resolve_chunk_size(4096, CPU, sp_size=4, tuner=fake.tuner()) == 4096
    assert fake.calls["flops"] == 0  # nothing measured
    for bad in (0, -3, 1.5, True, "big"):
        with pytest.raises(ValueError, match="chunk_size"):
            resolve_chunk_size(bad, CPU)


def test_auto_is_the_tuners_pick_with_the_hints():
    fake = Counting(1e12, 1e8)
    hints = chunk_hints(
        AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2), torch.float32
    )
    assert hints == {"dtype": torch.float32, "width": 256, "kv_ratio": 0.5}
    c = resolve_chunk_size("auto", CPU, sp_size=3, tuner=fake.tuner(), **hints)
    want = pick_chunk_size(1e12, 1e8, elem_bytes=4, kv_ratio=0.5, sp_size=3, width=256, memory_budget=0.25 * 60 * GIB)
    assert c == want and c % 3072 == 0  # lcm(1024, sp_size)


def test_the_runtime_keeps_the_resolution_and_leaves_the_callers_config_alone():
    config = FPDTConfig(chunk_size="auto")
    fake = Counting(1e12, 1e8)
    runtime = FPDTRuntime(config, autotuner=fake.tuner())
    sizes = runtime.chunk_sizes(30000, CPU, dtype=torch.float32, width=256)
    c = runtime.global_chunk_size(CPU)
    assert sizes == [c] * (30000 // c) + ([30000 % c] if 30000 % c else [])
    assert config.chunk_size == "auto" and runtime.config.chunk_size == "auto"
    assert fake.calls["flops"] == 1  # measured once, for every later layer and step


def _agree_worker(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    fake = Counting(1e12 * (1 + 2 * rank), 1e8)  # ranks measure differently: picks differ
    return resolve_chunk_size("auto", CPU, group=dist.group.WORLD, tuner=fake.tuner(), dtype=torch.float32, width=256)


@pytest.mark.multiprocess
def test_ranks_agree_on_the_largest_pick():
    picks = run_distributed(_agree_worker, 2)
    largest = pick_chunk_size(3e12, 1e8, elem_bytes=4, width=256, memory_budget=0.25 * 60 * GIB)
    assert picks == [largest, largest]
    assert largest > pick_chunk_size(1e12, 1e8, elem_bytes=4, width=256, memory_budget=0.25 * 60 * GIB)
