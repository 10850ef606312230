"""``GROUP_RANK`` set on rank 0 only, both ranks on one host (issue 38 item 2b): ``build_groups`` names the
variable and places both ranks on one node (was: "2 nodes" and a warning that ``sp_size`` exceeds the processes
per node). Two gloo ranks of one launch (:func:`distributed.run_distributed`), each given its own environment."""

from __future__ import annotations

import logging

import pytest
from distributed import run_distributed

from hf_fpdt.distributed.groups import build_groups


def _groups_with(rank: int, world_size: int) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("hf_fpdt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    env = {"LOCAL_WORLD_SIZE": "2", **({"GROUP_RANK": "0"} if rank == 0 else {})}
    groups = build_groups(2, env=env)
    return {"nodes": groups.placement.nodes, "log": records}


@pytest.mark.multiprocess
def test_group_rank_on_one_rank_only_is_named() -> None:
    ranks = run_distributed(_groups_with, 2, timeout=120)
    assert ranks[0]["nodes"] == ranks[1]["nodes"] == (0, 0)  # one host: one node
    log = "\n".join(ranks[0]["log"])
    assert "hf_fpdt placement: 2 ranks on 1 node (2 per node)" in log, log
    assert "GROUP_RANK (the launcher's node rank) is set on world ranks [0] (0) but not on world ranks [1]" in log
    assert "span" not in log  # no made-up second node, no sp_size warning
    assert ranks[1]["log"] == []  # rank 0 logs, once
