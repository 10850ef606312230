"""``accelerate_configs/``: every file is an Accelerate config that ``accelerate launch`` takes, and says what it means.

* each file loads with Accelerate's own config class (unknown keys are an error there), its process counts fit
  together (``num_processes`` = ``num_machines`` x processes per node, ``machine_rank`` < ``num_machines``), and
  a multi-node file names node 0's address and port and a launcher that runs on each node by itself (DeepSpeed:
  ``standard``, i.e. torchrun, not pdsh);
* the 2-node files differ from their one-node twins only in those multi-node fields;
* ``accelerate launch --config_file <2-node file> --machine_rank k`` is dry-run: Accelerate's own launch command
  with torchrun's entry point replaced by a recorder, so the torchrun arguments each node would start with are
  checked (2 nodes, 8 processes each, node rank k, node 0's address) and nothing starts;
* docs/guides/launch.md's table names every file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
MULTI_NODE = [p for p in CONFIGS if yaml.safe_load(p.read_text()).get("num_machines", 1) > 1]
TWINS = {"deepspeed_zero3_2nodes.yaml": "deepspeed_zero3.yaml", "fsdp2_2nodes.yaml": "fsdp2.yaml"}
NODE_FIELDS = {"num_machines", "num_processes", "main_process_ip", "main_process_port", "machine_rank"}


def test_the_2_node_files_exist():
    assert {p.name for p in MULTI_NODE} == set(TWINS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_counts_fit(path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(path))  # raises on keys Accelerate does not know
    assert config.num_machines >= 1 and 0 <= config.machine_rank < config.num_machines
    assert config.num_processes >= 1 and config.num_processes % config.num_machines == 0, (
        f"{path.name}: num_processes {config.num_processes} is not num_machines {config.num_machines} x processes "
        "per node"
    )
    if config.distributed_type == DistributedType.NO:
        assert config.num_processes == 1
    if config.num_machines == 1:
        return
    assert config.main_process_ip and config.main_process_port, f"{path.name}: node 0's address and port"
    assert config.rdzv_backend == "static"
    per_node = config.num_processes // config.num_machines
    assert (config.num_machines, per_node) == (2, 8)
    if config.distributed_type == DistributedType.DEEPSPEED:  # pdsh (the default) would need ssh and a hostfile
        assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    text = path.read_text()
    assert "--machine_rank 1" in text, f"{path.name} must say what node 1 passes"


@pytest.mark.parametrize("name", sorted(TWINS))
def test_2_node_file_is_its_twin_plus_the_node_fields(name: str) -> None:
    two, one = (yaml.safe_load((ROOT / "accelerate_configs" / n).read_text()) for n in (name, TWINS[name]))
    for config in (two, one):
        config.get("deepspeed_config", {}).pop("deepspeed_multinode_launcher", None)
    assert {k: v for k, v in two.items() if k not in NODE_FIELDS} == {
        k: v for k, v in one.items() if k not in NODE_FIELDS
    }
    assert two["num_processes"] == two["num_machines"] * one["num_processes"]  # 8 GPUs on each node


def _no_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"accelerate launch started a process instead of torchrun on this node: {args}")


@pytest.mark.parametrize("machine_rank", [0, 1])
@pytest.mark.parametrize("name", sorted(TWINS))
def test_accelerate_launch_starts_torchrun_on_each_node(name: str, machine_rank: int, monkeypatch) -> None:
    import torch.distributed.run as torchrun
    from accelerate.commands.launch import launch_command, launch_command_parser
    from distributed import free_port

    if "deepspeed" in name:
        pytest.importorskip("deepspeed")
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(vars(args).copy()))
    monkeypatch.setattr("subprocess.Popen", _no_process)  # DeepSpeed's pdsh path would start `deepspeed` here
    port = free_port()  # the file's 29500 may be taken on this machine (node 0 checks that it is free)
    args = launch_command_parser().parse_args(
        ["--config_file", str(ROOT / "accelerate_configs" / name), "--machine_rank", str(machine_rank),
         "--main_process_port", str(port), "train.py", "--sp-size", "8"]
    )  # fmt: skip
    launch_command(args)
    assert len(started) == 1, "accelerate launch did not hand over to torchrun on this node"
    got = started[0]
    assert (got["nnodes"], got["nproc_per_node"], got["node_rank"]) == ("2", "8", machine_rank)
    assert got["rdzv_backend"] == "static" and got["rdzv_endpoint"] == f"10.0.0.1:{port}"
    assert (got["training_script"], got["training_script_args"]) == ("train.py", ["--sp-size", "8"])


def test_launch_page_names_every_config():
    text = (ROOT / "docs" / "guides" / "launch.md").read_text()
    missing = [p.name for p in CONFIGS if f"| `{p.name}` |" not in text]
    assert not missing, f"docs/guides/launch.md's table of launch configs lacks {missing}"
