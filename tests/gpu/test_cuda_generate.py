"""generate() on CUDA through an applied model (offload on): prefill in chunks, decode, left padding and a static
cache, equal to HF sdpa (issue 22)."""

from __future__ import annotations

import pytest
from gpu import cases
from gpu.cases import CUDA

KWARGS = [{}, {"prefill_chunk_size": 97}, {"cache_implementation": "static"}]


@pytest.mark.parametrize("kwargs", KWARGS, ids=["plain", "prefill-chunks", "static-cache"])
def test_generate_equals_sdpa(cuda, kwargs):
    cases.check_generate(cuda, CUDA, **kwargs)


def test_race_check(cuda, monkeypatch):
    cases.check_bit_identical(lambda: cases.check_generate(cuda, CUDA, prefill_chunk_size=97), monkeypatch)
