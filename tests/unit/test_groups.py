"""hf_fpdt.distributed.groups: SP and DP groups from the world (world = dp x sp).

The groups of a real 4-process world are checked in ``test_sp_models.py`` (it starts those processes anyway), their
placement on 2 nodes in ``test_multinode.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from hf_fpdt.distributed.groups import Placement, build_groups, group_ranks, node_identity


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
    from hf_fpdt.distributed.groups import _destroy
    from hf_fpdt.distributed.timeouts import set_group_timeout

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


# --- nodes: where the groups sit (the 2-node launch itself: tests/integration/test_multinode.py) ----------------


def test_node_identity_tells_launchers_on_one_host_apart():
    assert node_identity({}, "gpu-a") == "gpu-a"
    assert node_identity({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"}, "gpu-a") == "gpu-a GROUP_RANK=1"
    assert node_identity({"GROUP_RANK": "0"}, "h") != node_identity({"GROUP_RANK": "1"}, "h")  # 2 "nodes" on loopback
    assert node_identity({"GROUP_RANK": "0"}, "h1") != node_identity({"GROUP_RANK": "0"}, "h2")


def test_sp_groups_inside_nodes_when_sp_divides_the_processes_per_node():
    placement = Placement.from_identities(["n0"] * 8 + ["n1"] * 8, 4)  # 2 nodes x 8, node-major
    assert placement.nodes == (0,) * 8 + (1,) * 8 and placement.node_sizes == [8, 8] and placement.node_major
    assert placement.spanning == [] and placement.warning() is None
    assert [placement.nodes_of(g) for g in placement.sp_groups] == [[0], [0], [1], [1]]
    assert all(placement.nodes_of(g) == [0, 1] for g in placement.dp_groups)  # DP across nodes
    assert placement.describe() == (
        "hf_fpdt placement: 16 ranks on 2 nodes (8 per node); SP groups of 4 (each inside one node): [0-3] node 0, "
        "[4-7] node 0, [8-11] node 1, [12-15] node 1; DP groups of 4: [0, 4, 8, 12] nodes 0, 1, [1, 5, 9, 13] nodes "
        "0, 1, [2, 6, 10, 14] nodes 0, 1, [3, 7, 11, 15] nodes 0, 1"
    )


def test_one_node_and_digest_identities():
    placement = Placement.from_identities([-5, -5, -5, -5], 2)
    assert placement.node_sizes == [4] and placement.warning() is None
    assert placement.describe().startswith("hf_fpdt placement: 4 ranks on 1 node (4 per node); SP groups of 2 (each")


@pytest.mark.parametrize(
    "nodes,sp,why,groups,fits",
    [
        (
            ["a"] * 2 + ["b"] * 2,
            4,
            "sp_size 4 is more than the 2 processes per node",
            "([0-3] on nodes 0, 1)",
            "(1, 2)",
        ),
        (["a"] * 6 + ["b"] * 6, 4, "sp_size 4 does not divide the 6 processes per node", "([4-7] on", "(1, 2, 3, 6)"),
        (
            ["a", "b"] * 4,
            2,
            "the ranks are not numbered node by node (node 0 holds ranks [0, 2, 4, 6]",
            "([0, 1] on nodes 0, 1, [2, 3] on",
            "(1, 2, 4)",
        ),
        (
            ["a"] * 6 + ["b"] * 4,
            5,
            "sp_size 5 is more than the 4 processes on the smallest node",
            "([5-9] on",
            "(1, 2)",
        ),
        (
            ["a"] * 6 + ["b"] * 6 + ["c"] * 4,
            4,
            "sp_size 4 does not divide the processes of every node (6, 6, 4)",
            "([4-7] on",
            "(1, 2)",
        ),
    ],
)
def test_sp_group_across_nodes_is_named_with_the_reason_and_the_fix(nodes, sp, why, groups, fits):
    placement = Placement.from_identities(nodes, sp)
    assert placement.spanning
    warning = placement.warning()
    assert warning is not None and why in warning and groups in warning, warning
    assert f"use an sp_size that divides the processes of every node {fits}" in warning, warning
    assert "results are the same" in warning
    assert "across nodes)" in placement.describe()


def test_long_groups_are_shortened():
    placement = Placement.from_identities([n for n in range(64) for _ in range(8)], 8)  # 64 nodes x 8
    line = placement.describe()
    assert "[0-7] node 0, [8-15] node 1" in line and "... (56 more)" in line
    assert "[0, 8, ..., 504] nodes 0-63" in line and len(line) < 1000


def test_build_groups_of_one_process_logs_its_placement(tmp_path, caplog):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.INFO, logger="hf_fpdt"):
            groups = build_groups(1, timeout=5, env={"GROUP_RANK": "3"})
        assert groups.placement == Placement((0,), 1)
        lines = [r.getMessage() for r in caplog.records if r.name == "hf_fpdt"]
        assert lines == [groups.placement.describe()] and "1 ranks on 1 node" in lines[0]
    finally:
        dist.destroy_process_group()
