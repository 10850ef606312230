"""The declared minimum versions are the ones CI tests (issue 30, items 2 and 3).

* ``.ci/minimums.txt`` pins exactly setup.cfg's lower bounds: every library of ``install_requires`` and of the
  ``trl`` and ``deepspeed`` extras (and the ``test`` extra's copies of those two) has a ``>=`` bound, and the file
  pins that version with ``==``, no more and no fewer packages; so the bounds and the environment CI's
  ``.ci/minimums`` runs the suite in cannot drift apart;
* ``.ci/run`` runs ``.ci/minimums``, which installs that file, and ``.ci/newest``, the quick tier on the newest torch;
* every module of the package imports (run in both CI environments, the newest releases and the minimums);
* the differences between the releases in that range that hf_fpdt detects (issue 39): where transformers checkpoints
  a decoder layer (its ``__call__`` up to 5.22, its ``forward`` from 5.23), and what hf_fpdt's TRL trainers need.
"""

from __future__ import annotations

import configparser
import importlib
import re
from pathlib import Path

import pytest
from testkit import tiny_model
from torch import nn

import hf_fpdt
from hf_fpdt.integrations.state import installed_forwards
from hf_fpdt.trainers.compat_versions import trl_missing

ROOT = Path(__file__).resolve().parents[2]
MINIMUMS = ROOT / ".ci" / "minimums.txt"
TESTED_EXTRAS = ("trl", "deepspeed")  # libraries the suite runs; the other extras are tools (pytest, ruff, ...)
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)\s*(.*)$")


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def _requirements(block: str) -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln]


def _lower_bound(spec: str) -> str:
    """The version of the one ``>=`` clause of a requirement's specifier (``>=5.23,<6`` -> ``5.23``)."""
    bounds = [c.strip()[2:].strip() for c in spec.split(",") if c.strip().startswith(">=")]
    assert len(bounds) == 1, f"{spec!r}: exactly one '>=' lower bound expected"
    return bounds[0]


def declared_bounds() -> dict[str, str]:
    """package -> setup.cfg's lower bound, for the install requirements and the tested extras."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    blocks = [cfg["options"]["install_requires"], *(extras[e] for e in TESTED_EXTRAS)]
    bounds: dict[str, str] = {}
    for line in (ln for block in blocks for ln in _requirements(block)):
        name, spec = REQUIREMENT.match(line).groups()
        bound = _lower_bound(spec)
        assert bounds.setdefault(_name(name), bound) == bound, f"{name}: two lower bounds in setup.cfg"
    test_extra = {_name(m.group(1)): m.group(2) for m in map(REQUIREMENT.match, _requirements(extras["test"]))}
    tested = {_name(REQUIREMENT.match(ln).group(1)) for e in TESTED_EXTRAS for ln in _requirements(extras[e])}
    for name in sorted(tested & set(test_extra)):
        assert _lower_bound(test_extra[name]) == bounds[name], f"{name}: the test extra's bound differs"
    return bounds


def pinned_minimums() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in _requirements(MINIMUMS.read_text()):
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.+!-]*)", line)
        assert m, f"{MINIMUMS.name}: {line!r} is not 'package==version'"
        pins[_name(m.group(1))] = m.group(2)
    return pins


def _release(version: str) -> tuple[int, ...]:
    """``5.23`` and ``5.23.0`` are the same release."""
    parts = [int(p) for p in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_the_minimums_file_pins_setup_cfgs_lower_bounds():
    bounds, pins = declared_bounds(), pinned_minimums()
    assert set(pins) == set(bounds), f"setup.cfg bounds {sorted(bounds)} vs {MINIMUMS.name} pins {sorted(pins)}"
    differ = {n: (bounds[n], pins[n]) for n in bounds if _release(bounds[n]) != _release(pins[n])}
    assert not differ, f"setup.cfg's lower bound vs {MINIMUMS.name}'s pin: {differ}"


def test_ci_runs_the_minimums_with_these_pins():
    run = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/minimums" in run, ".ci/run does not run the minimums environment"
    script = (ROOT / ".ci" / "minimums").read_text()
    assert "torch" in pinned_minimums()  # torch among the pins installed on one pip line: nothing pulls another
    installs = [ln for ln in script.splitlines() if " -m pip install " in ln and not ln.lstrip().startswith("#")]
    assert installs == ['"$VENV/bin/python" -m pip install -q -r .ci/minimums.txt'], installs
    assert "--system-site-packages" in script


def test_ci_runs_the_quick_tier_on_the_newest_torch():
    """``.ci/newest`` (issue 43, item 6): a venv over the system's site-packages, the newest torch the index serves
    (unpinned unless TORCH says), the quick tier of the whole suite; ``.ci/run`` runs it before its last line."""
    run = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/newest" in run[:-1], ".ci/run does not run the newest-torch environment"
    script = (ROOT / ".ci" / "newest").read_text()
    assert "--system-site-packages" in script
    installs = [ln for ln in script.splitlines() if " -m pip install " in ln and not ln.lstrip().startswith("#")]
    assert installs == ['"$VENV/bin/python" -m pip install -q -U "${TORCH:-torch}"'], installs
    assert '"$VENV/bin/python" -m pytest -q -m "not multiprocess and not slow" tests' in script.splitlines()


def test_release_compares_numbers_not_strings():
    assert _release("5.23") == _release("5.23.0") != _release("5.2.3")
    assert _lower_bound(">=5.23,<6") == "5.23"
    with pytest.raises(AssertionError):
        _lower_bound("<6")


def _modules() -> list[str]:
    package = Path(hf_fpdt.__file__).parent
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module: str):
    """With the installed releases (both CI environments run this): a removed or renamed name in transformers,
    accelerate, peft, trl, datasets, deepspeed or torch fails here at import, module by module."""
    if module == "hf_fpdt.trainers.trl_sft":
        pytest.importorskip("trl")
    assert importlib.import_module(module).__name__ == module


def test_layer_wrappers_run_outside_hfs_checkpoint():
    """Whichever way the installed transformers checkpoints a layer, after ``apply`` nothing checkpoints the layer's
    call: hf_fpdt's wrappers (its instance ``forward``) run first and open the checkpoint themselves through the
    class's ``forward``. Up to 5.22 (HF checkpoints ``__call__``) the layer gets a subclass of its class, of the same
    name; ``unapply`` gives it its class back."""
    model = tiny_model("tiny-llama")
    layer = model.model.layers[0]
    cls = type(layer)
    hf_fpdt.apply(model, hf_fpdt.FPDTConfig(chunk_size=8))
    assert type(layer).__call__ is nn.Module.__call__
    assert isinstance(layer, cls) and type(layer).__name__ == cls.__name__
    assert [w.kind for w in installed_forwards(layer)] == ["recompute_marker", "offload_inputs"]
    hf_fpdt.unapply(model)
    assert type(layer) is cls and not installed_forwards(layer)


def test_the_installed_trl_has_what_the_trainers_need():
    """CI installs the trl extra's lower bound (and the newest): hf_fpdt's TRL trainers must find all they need."""
    pytest.importorskip("trl")
    assert trl_missing() is None
    assert hf_fpdt.FPDTGRPOTrainer.__name__ == "FPDTGRPOTrainer"
