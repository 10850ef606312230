"""generate() on CUDA through an applied model (offload on): prefill in chunks, decode, left padding and a static
cache, equal to HF sdpa (issue 22). On a GPU at ``cases.CUDA``'s sizes; without one on the virtual CUDA device at
``cases.CPU``'s."""

from __future__ import annotations

import pytest
from gpu import cases

pytestmark = pytest.mark.virtual_kernels
SIZES = cases.sizes()
KWARGS = [{}, {"prefill_chunk_size": SIZES.prefill_chunk}, {"cache_implementation": "static"}]


@pytest.mark.parametrize("kwargs", KWARGS, ids=["plain", "prefill-chunks", "static-cache"])
def test_generate_equals_sdpa(cuda_or_virtual, kwargs):
    cases.check_generate(cuda_or_virtual, SIZES, **kwargs)


def test_race_check(cuda_or_virtual, monkeypatch):
    cases.check_bit_identical(
        cuda_or_virtual,
        lambda: cases.check_generate(cuda_or_virtual, SIZES, prefill_chunk_size=SIZES.prefill_chunk),
        monkeypatch,
    )
