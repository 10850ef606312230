"""The launcher's variables cross-checked by ``build_groups`` (issue 38 item 2b): an inconsistent ``GROUP_RANK`` or
``LOCAL_WORLD_SIZE`` is named, instead of a placement made up from it (``GROUP_RANK`` on rank 0 only, both ranks on
one host: the placement said 2 nodes and warned that ``sp_size`` exceeds the processes per node)."""

from __future__ import annotations

from hf_fpdt.distributed.groups import launch_env_problem

HOST, OTHER = 11, 22  # host name digests


def test_consistent_launches_pass() -> None:
    assert launch_env_problem([[HOST, -1, -1], [HOST, -1, -1]]) == (None, False)  # no launcher variables
    assert launch_env_problem([[HOST, 0, 2], [HOST, 0, 2]]) == (None, False)  # accelerate launch / torchrun
    loopback = [[HOST, 0, 2], [HOST, 0, 2], [HOST, 1, 2], [HOST, 1, 2]]  # two "nodes" on one host
    assert launch_env_problem(loopback) == (None, False)
    assert launch_env_problem([[HOST, 0, 1], [OTHER, 0, 1]]) == (None, False)  # two hosts, node rank 0 each


def test_group_rank_on_some_ranks_of_a_host_only() -> None:
    problem, hosts_only = launch_env_problem([[HOST, 0, 2], [HOST, -1, 2]])
    assert hosts_only
    assert problem.startswith("hf_fpdt: GROUP_RANK (the launcher's node rank) is set on world ranks [0] (0) but not on")
    assert "world ranks [1], which run on the same host: the ranks are placed by host name alone" in problem
    problem, hosts_only = launch_env_problem([[HOST, 0, 2], [HOST, -2, 2]])
    assert hosts_only and "GROUP_RANK is not a number on world ranks [1]" in problem


def test_local_world_size_that_is_not_the_ranks_on_the_node() -> None:
    problem, hosts_only = launch_env_problem([[HOST, 0, 2], [HOST, 0, 2], [HOST, 0, 4], [HOST, 0, 4]])
    assert not hosts_only
    assert problem.startswith("hf_fpdt: LOCAL_WORLD_SIZE (processes per node) is 2 on world ranks [0, 1], but 4 ranks")
