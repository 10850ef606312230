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


def test_the_public_setter_where_torch_has_it_else_the_private_one_else_a_clear_error(tmp_path, monkeypatch):
    """torch 2.14 on: ``torch.distributed.set_timeout`` (its private ``_set_pg_timeout`` warns there, a
    ``FutureWarning`` on every plugin set-up); below: the private one; neither: a ``ValueError`` naming the way out."""
    import warnings

    import pytest

    from hf_fpdt.distributed import timeouts

    private = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    assert timeouts._setter() is getattr(dist, "set_timeout", private)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation from the setter this torch offers
            set_group_timeout(dist.group.WORLD, 9)
        assert group_timeout(dist.group.WORLD) == timedelta(seconds=9)
        monkeypatch.delattr(dist, "set_timeout", raising=False)
        assert timeouts._setter() is private
        monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout", raising=False)
        with pytest.raises(ValueError, match=r"init_process_group\(timeout=\.\.\.\)"):
            set_group_timeout(dist.group.WORLD, 5)
    finally:
        dist.destroy_process_group()
