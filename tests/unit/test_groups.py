"""hf_fpdt.core.groups: SP and DP groups from the world (world = dp x sp).

The groups of a real 4-process world are checked in ``test_sp_models.py`` (it starts those processes anyway).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_fpdt.core.groups import build_groups, group_ranks


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


def test_build_groups_needs_initialised_world():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        build_groups(1)


def test_groups_built_here_are_destroyed_at_exit_and_the_program_s_are_left(tmp_path):
    """``build_groups`` registers its groups for destruction at exit (issue 21, item 5); the handler
    destroys only those, is a no-op for groups the program destroyed, and leaves the world alone."""
    from hf_fpdt.core.groups import _destroy, set_group_timeout

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        groups = build_groups(1, timeout=5)
        mine = dist.new_group([0])  # the program's own group
        set_group_timeout(dist.group.WORLD, 7)
        _destroy([groups.sp, groups.dp], False)
        for group in (groups.sp, groups.dp):
            with pytest.raises((ValueError, RuntimeError, KeyError)):  # no longer registered
                dist.get_process_group_ranks(group)
        assert dist.get_process_group_ranks(mine) == [0] and dist.is_initialized()
        _destroy([groups.sp], False)  # already destroyed: nothing happens
        _destroy([dist.group.WORLD], True)  # a world hf_fpdt created (FPDTTrainer): everything goes
        assert not dist.is_initialized()
        _destroy([groups.sp], False)  # no world any more: nothing happens
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
