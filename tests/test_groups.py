"""hf_fpdt.core.groups: SP and DP groups from the world (world = dp x sp).

The groups of a real 4-process world are checked in ``test_sp_models.py`` (it starts those processes anyway).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_fpdt.core.groups import build_groups, default_backend, group_ranks


def test_group_ranks_layout():
    sp, dp = group_ranks(8, 2)
    assert sp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert group_ranks(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert group_ranks(3, 1) == ([[0], [1], [2]], [[0, 1, 2]])


@pytest.mark.parametrize("world,sp", [(4, 3), (2, 4), (6, 4)])
def test_sp_size_must_divide_world(world, sp):
    with pytest.raises(ValueError, match=f"sp_size={sp} does not divide the world size {world}"):
        group_ranks(world, sp)


@pytest.mark.parametrize("sp", [0, -2, True, 1.5])
def test_sp_size_must_be_positive_int(sp):
    with pytest.raises(ValueError, match="positive number of processes"):
        group_ranks(4, sp)


def test_default_backend():
    assert default_backend("cpu") == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"


def test_build_groups_needs_initialised_world():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        build_groups(1)
