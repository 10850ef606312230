"""The CUDA suite: every test here is skipped, with the reason, on a machine without CUDA.

Run it on a GPU machine with ``python -m pytest -q tests/gpu`` (see README 'GPU checks'). The bodies live in
``cases.py``; ``tests/test_gpu_cases_cpu.py`` runs a selection of them on CPU in CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    from gpu.cases import NEEDS_CUDA

    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:  # this hook sees the whole session's items
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
