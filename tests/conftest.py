"""Shared fixtures: a fixed seed, a clean ``FPDT_*`` environment, and a temporary HF datasets cache; the CUDA
suite's (``tests/gpu``) skip without CUDA and its ``cuda`` fixture; the virtual CUDA device (``virtual_cuda``,
``tests/virtual_cuda.py``) and ``cuda_or_virtual`` (a real GPU when there is one, else the virtual device), whose
tests of ``tests/gpu`` run without a GPU too.

Helpers shared by test modules live in ``testkit`` (importable: pytest's ``pythonpath`` has ``tests/``), never
here: conftest is pytest's, not a module to import.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from testkit import (
    SCRATCH,  # noqa: F401  (sets HF_DATASETS_CACHE before any test module imports datasets)
    no_deprecation_from_hf_fpdt,
)
from virtual_cuda import VirtualCuda


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA every test taking the ``cuda`` fixture is skipped, with the reason (``gpu.cases.NEEDS_CUDA``); those
    taking ``cuda_or_virtual`` run on the virtual device, and those taking neither on the CPU."""
    if torch.cuda.is_available():
        return
    from gpu.cases import NEEDS_CUDA

    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if "cuda" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    """The current CUDA device (``tests/gpu``)."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def virtual_cuda() -> Iterator[VirtualCuda]:
    """The virtual CUDA device, entered for the test; a race found on it fails the test at teardown."""
    with VirtualCuda() as vdev:
        yield vdev


@pytest.fixture
def cuda_or_virtual(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The current CUDA device; without one, ``cuda:0`` of the virtual device (races fail the test), whose torch
    cuDNN and flash attention ops answer with the references of ``tests/standins.py`` for a test marked
    ``virtual_kernels``."""
    if torch.cuda.is_available():
        yield torch.device("cuda", torch.cuda.current_device())
        return
    with VirtualCuda(kernels=request.node.get_closest_marker("virtual_kernels") is not None):
        yield torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _clean_fpdt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests state their settings; a developer's shell (FPDT_SP_SIZE=8, say) must not change them.
    for name in list(os.environ):
        if name.startswith("FPDT_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _deprecations_from_hf_fpdt_raise() -> Iterator[None]:
    # A DeprecationWarning or FutureWarning that hf_fpdt's own call causes fails the test (pyproject's
    # filterwarnings: the ones attributed to hf_fpdt's modules); those raised inside a library stay quiet.
    # The attribution alone misses a deprecated keyword passed through ``module(...)`` (it lands in torch's
    # Module.__call__), so the callers are walked (testkit.no_deprecation_from_hf_fpdt).
    with no_deprecation_from_hf_fpdt():
        yield
