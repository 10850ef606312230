"""The package's layout: folders read as the data path, each imports only folders below it, no import circle.

Also the one chunk-size path: a runtime built by hand with an ``"auto"`` setting and no autotuner is refused
with the argument named, and the step's plan uses the integer the attention uses.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
from testkit import tiny_model

import hf_fpdt

PACKAGE = Path(hf_fpdt.__file__).parent
FLOORS = [
    "config",
    "models",
    "data",
    "memory",
    "distributed",
    "attention",
    "integrations",
    "trainers",
    "bench",
]  # from the ground up


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """hf_fpdt module -> the hf_fpdt modules it imports (at any depth of its code)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            found |= {c for c in candidates if c in modules and c != name and c.startswith("hf_fpdt.")}
        graph[name] = found
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(FLOORS)  # hf_fpdt/__init__.py: the top, it may import anything
    return FLOORS.index(parts[1]) if parts[1] in FLOORS else -1


def test_every_module_sits_on_a_floor_and_few_stay_at_the_top():
    graph = _imports()
    loose = [m for m in graph if _floor(m) < 0]
    assert not loose, f"modules outside the layout's folders: {loose}"
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert sorted(top) == ["__init__.py", "config.py"], top
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(names) == len(set(names)), "two files of one name"


def test_imports_only_point_down():
    up = [
        (a, b)
        for a, targets in _imports().items()
        for b in targets
        if _floor(b) > _floor(a) and not b.startswith(a + ".")  # a package's own __init__ may name its modules
    ]
    assert not up, f"imports from a lower folder to a higher one: {up}"


def test_no_import_circle():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_public_surface():
    for name in hf_fpdt.__all__:
        assert getattr(hf_fpdt, name) is not None
    from hf_fpdt.data.collate import SPCollator
    from hf_fpdt.data.layout import shard_batch
    from hf_fpdt.distributed.groups import build_groups

    assert (hf_fpdt.shard_batch, hf_fpdt.build_groups, hf_fpdt.SPCollator) == (shard_batch, build_groups, SPCollator)


def test_runtime_by_hand_with_auto_and_no_tuner_names_the_argument():
    from hf_fpdt.attention.autotune import Autotuner
    from hf_fpdt.data.chunk_size import resolve_chunk_size

    runtime = hf_fpdt.FPDTRuntime(hf_fpdt.FPDTConfig(chunk_size="auto"))
    with pytest.raises(ValueError, match="autotuner="):
        runtime.global_chunk_size(torch.device("cpu"), dtype=torch.float32, width=64, kv_ratio=1.0)
    with pytest.raises(ValueError, match="tuner="):
        resolve_chunk_size("auto", torch.device("cpu"), dtype=torch.float32, width=64, kv_ratio=1.0)
    tuned = hf_fpdt.FPDTRuntime(hf_fpdt.FPDTConfig(chunk_size="auto"), autotuner=Autotuner())
    assert tuned.global_chunk_size(torch.device("cpu"), dtype=torch.float32, width=64, kv_ratio=1.0) >= 1024
    # offload="auto" on CPU needs no measurement (the device is the host)
    assert hf_fpdt.FPDTRuntime(hf_fpdt.FPDTConfig(offload="auto")).store(torch.device("cpu")).enabled is False


def test_auto_chunk_size_plans_with_the_measured_size(monkeypatch, caplog):
    """chunk_size="auto" with plain apply: the step's plan uses the integer the attention runs with."""

    from hf_fpdt.attention.autotune import Autotuner
    from hf_fpdt.integrations import step_plan

    planned = []
    real_plan = step_plan.plan

    def spy(*args, **kwargs):
        planned.append(kwargs["chunk_size"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(step_plan, "plan", spy)
    monkeypatch.setattr(Autotuner, "measured_chunk_size", lambda self, device, sp_size=1, **hints: 3072)
    model = tiny_model("tiny-llama", "fpdt", dtype=None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size="auto"))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    with caplog.at_level(logging.INFO, logger="hf_fpdt"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert planned == [3072]
    assert model.fpdt.runtime.global_chunk_size(ids.device) == 3072
