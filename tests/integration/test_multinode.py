"""Beyond one node: 2 "nodes" x 2 CPU processes on loopback, each node its own ``torchrun --nnodes 2 --node-rank k``
(static rendezvous at 127.0.0.1, gloo), as a 2-node job starts (:func:`launch.torchrun_nodes`).

``tests/scripts/multinode_step.py`` builds the groups through ``FPDTPlugin`` (``build_groups``) and runs one training
step of a tiny Llama. With ``sp_size`` 2 (= processes per node) every SP group is inside one node (its ranks share
torchrun's ``GROUP_RANK``), the DP groups run across the nodes, rank 0 logs that placement and nothing warns; with
``sp_size`` 4 the one SP group spans both nodes and rank 0 warns, naming it, why and the sp_size values that keep
SP inside a node (a warning, not an error: the step is still exact). Both steps equal one process on the global
batch (loss and every gradient). About 20 s per case on 2 cores; every launcher is killed after 150 s.

And a rank that never joins the exchange of nodes ends its peer with an ``SPPeerFailure`` within the groups'
timeout, not a hang.
"""

from __future__ import annotations

import json
import time

import pytest
from distributed import run_distributed
from launch import SCRIPTS, torchrun_nodes

from hf_fpdt import SPPeerFailure, build_groups
from hf_fpdt.distributed.groups import gather_placement

pytestmark = pytest.mark.multiprocess

NODES, PER_NODE = 2, 2


def _step(tmp_path, sp_size: int) -> tuple[dict, list[str]]:
    out = tmp_path / f"sp{sp_size}.json"
    runs = torchrun_nodes(SCRIPTS / "multinode_step.py", NODES, PER_NODE, str(out), str(sp_size), timeout=150)
    for node, (rc, text) in enumerate(runs):
        assert rc == 0, f"node {node} failed ({rc}):\n{text[-4000:]}"
    return json.loads(out.read_text()), [text for _, text in runs]


def _equals_one_process(result: dict) -> None:
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-5 * abs(result["ref_loss"]), result
    assert result["max_grad_rel"] < 1e-4, result


def test_sp_groups_stay_inside_a_node_and_the_step_equals_one_process(tmp_path) -> None:
    result, outputs = _step(tmp_path, 2)
    ranks = result["ranks"]
    # torchrun numbers ranks node by node: node k holds ranks 2k, 2k+1, with local ranks 0, 1.
    assert [(r["rank"], r["node"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)
    ]  # fmt: skip
    for r in ranks:
        assert {ranks[m]["node"] for m in r["sp_group"]} == {r["node"]}, r  # SP inside the node
        assert {ranks[m]["node"] for m in r["dp_group"]} == {0, 1}, r  # DP across the nodes
    assert [r["sp_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]
    assert result["placement"]["nodes"] == [r["node"] for r in ranks] and result["placement"]["warning"] is None
    line = (
        "hf_fpdt placement: 4 ranks on 2 nodes (2 per node); SP groups of 2 (each inside one node): [0, 1] node 0, "
        "[2, 3] node 1; DP groups of 2: [0, 2] nodes 0, 1, [1, 3] nodes 0, 1"
    )
    assert result["placement"]["line"] == line
    assert outputs[0].count(line) == 1 and line not in outputs[1]  # logged once, by rank 0 (on node 0)
    assert not any("span nodes" in text or "spans nodes" in text for text in outputs)  # no warning
    _equals_one_process(result)


def test_sp_group_across_nodes_warns_and_the_step_still_equals_one_process(tmp_path) -> None:
    result, outputs = _step(tmp_path, 4)
    ranks = result["ranks"]
    assert all(r["sp_group"] == [0, 1, 2, 3] for r in ranks)
    assert {ranks[m]["node"] for m in ranks[0]["sp_group"]} == {0, 1}
    warning = result["placement"]["warning"]
    assert warning.startswith("hf_fpdt: the sequence-parallel group spans nodes ([0-3] on nodes 0, 1): sp_size 4 is")
    assert "more than the 2 processes per node" in warning and "divides the processes of every node (1, 2)" in warning
    assert outputs[0].count(warning) == 1 and warning not in outputs[1]  # warned once, by rank 0
    assert "SP groups of 4 (across nodes): [0-3] nodes 0, 1" in outputs[0]
    _equals_one_process(result)


def _peer_misses_the_node_exchange(rank: int, world_size: int) -> dict:
    groups = build_groups(2, timeout=3)
    if rank == 1:
        time.sleep(4.5)  # never joins this exchange (its peer gives up after 3 s)
        return {}
    start = time.monotonic()
    try:
        gather_placement(groups.sp, groups.dp, 2, "host-a")
    except SPPeerFailure as exc:
        return {"error": str(exc), "waited": time.monotonic() - start}
    return {"error": None}


def test_a_peer_missing_from_the_node_exchange_is_an_error_not_a_hang() -> None:
    result = run_distributed(_peer_misses_the_node_exchange, 2, timeout=60)[0]
    assert result["error"] is not None and result["waited"] < 4.4, result
    assert "build_groups (exchanging each rank's node)" in result["error"] and "world rank 1" in result["error"]
