"""The world group's timeout comes back (issue 35, item 4): ``set_group_timeout`` returns the timeout the group
had, which ``FPDTPlugin.release`` puts back on the world it set ``sp_timeout`` on."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from hf_fpdt.distributed.timeouts import group_timeout, set_group_timeout


def test_set_group_timeout_returns_the_previous_one_and_it_can_be_put_back(tmp_path):
    own = timedelta(seconds=77)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1, timeout=own)
    try:
        world = dist.group.WORLD
        assert group_timeout(world) == own
        assert set_group_timeout(world, 5) == own
        assert group_timeout(world) == timedelta(seconds=5)
        assert set_group_timeout(world, own) == timedelta(seconds=5)
        assert group_timeout(world) == own
    finally:
        dist.destroy_process_group()
