"""Every Python block of README.md and ``docs/`` runs as it stands, or says it is a fragment (issue 37, item 3).

A block whose first line is ``# fragment: the complete program is examples/NAME.py`` is an excerpt: the file it
names must exist, and the suite runs every example (``tests/integration/test_example.py`` names each one). Every
other block is run as is, in a fresh interpreter from an empty folder (it builds its own tiny model and data;
nothing downloaded), and must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = re.compile(r"^# fragment: the complete program is (examples/[\w/]+\.py)$")
EXAMPLE_TESTS = ROOT / "tests" / "integration" / "test_example.py"


def python_blocks() -> list[tuple[str, list[str]]]:
    """``(page:line, the block's lines)`` of every fenced ```python block of README.md and docs/."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines()
        start = None
        for i, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = i
            elif start is not None and line.strip().startswith("```"):
                blocks.append((f"{path.relative_to(ROOT)}:{start + 1}", lines[start + 1 : i]))
                start = None
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [(where, block) for where, block in BLOCKS if not FRAGMENT.match(block[0] if block else "")]
FRAGMENTS = [
    (where, FRAGMENT.match(block[0]).group(1)) for where, block in BLOCKS if block and FRAGMENT.match(block[0])
]


def test_blocks_are_found_and_both_kinds_exist() -> None:
    assert len(BLOCKS) >= 15 and RUNNABLE and FRAGMENTS, (len(BLOCKS), len(RUNNABLE), len(FRAGMENTS))


@pytest.mark.parametrize(("where", "example"), FRAGMENTS, ids=[w for w, _ in FRAGMENTS])
def test_a_fragment_names_an_example_the_suite_runs(where: str, example: str) -> None:
    assert (ROOT / example).is_file(), f"{where}: {example} does not exist"
    assert f'"{Path(example).name}"' in EXAMPLE_TESTS.read_text(), f"{where}: no test in test_example.py runs {example}"


def test_every_example_is_run_by_the_suite() -> None:
    text = EXAMPLE_TESTS.read_text()
    missing = [p.name for p in sorted((ROOT / "examples").glob("*.py")) if f'"{p.name}"' not in text]
    assert not missing, f"tests/integration/test_example.py runs no {missing}"


@pytest.mark.slow
@pytest.mark.parametrize(("where", "block"), RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_a_runnable_block_runs_as_it_stands(where: str, block: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FPDT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    res = subprocess.run(
        [sys.executable, "-c", "\n".join(block)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, f"{where} fails as written:\n" + "\n".join(block) + "\n" + res.stderr[-3000:]
