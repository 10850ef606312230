"""Shared fixtures: a fixed seed, a clean ``FPDT_*`` environment, and a temporary HF datasets cache; the CUDA
suite's (``tests/gpu``) skip without CUDA and its ``cuda`` fixture.

``tests/gpu`` has no conftest.py of its own: a second module named ``conftest`` would replace this one for the
test modules that import helpers from it (``from conftest import rel_err``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tests write only under temporary folders: the HF datasets cache too (load_dataset/map would otherwise
# fill ~/.cache/huggingface/datasets). Set before any test module imports datasets; spawned and launched
# processes inherit it.
SCRATCH = tempfile.mkdtemp(prefix="hf_fpdt_tests_")
os.environ["HF_DATASETS_CACHE"] = os.path.join(SCRATCH, "datasets")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


GPU_SUITE = Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA every test of ``tests/gpu`` is skipped, with the reason (``gpu.cases.NEEDS_CUDA``)."""
    if torch.cuda.is_available():
        return
    from gpu.cases import NEEDS_CUDA

    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if GPU_SUITE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    """The current CUDA device (``tests/gpu``)."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _clean_fpdt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests state their settings; a developer's shell (FPDT_SP_SIZE=8, say) must not change them.
    for name in list(os.environ):
        if name.startswith("FPDT_"):
            monkeypatch.delenv(name)


def reference_attention(q, k, v, scale: float, causal: bool = True) -> torch.Tensor:
    """Causal (top-left aligned) attention in float64 over the whole sequence, differentiable.

    ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``[B, Sq, H, D]``; written independently of
    ``hf_fpdt.core.kernels`` (plain softmax, ``repeat_interleave`` for GQA) so it can judge every backend.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().repeat_interleave(groups, dim=2).transpose(1, 2)
    vh = v.double().repeat_interleave(groups, dim=2).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute error over the reference's largest magnitude (absolute where the reference is all
    zeros, e.g. dq and dk of a one-token sequence)."""
    scale = ref.double().abs().max().item()
    return max_err(a, ref) / (scale if scale > 0 else 1.0)
