"""The tests build their models through the one factory, :func:`testkit.tiny_model` (a preset, an HF
``model_type`` with its config's arguments, or a config object): a test that builds one itself (``from_config``,
a ``*ForCausalLM`` class, a model config class such as ``LlamaConfig``) drifts from the others' seeds, dtypes and
shapes unseen. Configs a test needs as data come from :mod:`hf_fpdt.models.presets` or ``AutoConfig.for_model``."""

from __future__ import annotations

import re
from pathlib import Path

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

TESTS = Path(__file__).resolve().parents[1]
FACTORY = TESTS / "testkit.py"
# file (relative to tests/) -> the builds it may make itself, and why
ALLOWED = {
    # the test is about models a user builds with the class from one shared config object
    "integration/test_user_path.py": {"LlamaForCausalLM"},
    # a standalone process under RLIMIT_AS (also run by host_margin_table.py), started with only the repository on
    # PYTHONPATH, measuring what the library's own imports map
    "scripts/rlimit_step.py": {"from_config"},
}
MODEL_CONFIGS = sorted(set(CONFIG_MAPPING_NAMES.values()), key=len, reverse=True)
BUILDS = re.compile(
    r"\b(?:(?:AutoModel\w*|\w+(?:ForCausalLM|Model))\.(?P<from_config>_?from_config)"  # AutoModel*.from_config(
    r"|(?P<model_class>\w+(?:ForCausalLM|LMHeadModel))"  # LlamaForCausalLM(
    r"|(?P<config_class>" + "|".join(MODEL_CONFIGS) + r"))\("  # LlamaConfig(
)


def _builds(text: str) -> list[tuple[int, str]]:
    found = []
    for m in BUILDS.finditer(text):
        name = m.group("config_class") or m.group("model_class") or m.group("from_config").lstrip("_")
        found.append((text.count("\n", 0, m.start()) + 1, name))
    return found


def test_the_pattern_finds_each_kind_of_build():
    text = "AutoModelForCausalLM.from_config(c)\nQwen2ForCausalLM(c)\nx = LlamaConfig(hidden_size=8)\n"
    assert _builds(text) == [(1, "from_config"), (2, "Qwen2ForCausalLM"), (3, "LlamaConfig")]
    assert _builds("ModelShape.from_config(c)\nFPDTConfig(chunk_size=8)\nLoraConfig(r=4)\ntiny_model('qwen2')") == []


def test_tests_build_models_through_the_factory():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        if path in (FACTORY, Path(__file__).resolve()):
            continue
        rel = path.relative_to(TESTS).as_posix()
        allowed = ALLOWED.get(rel, set())
        bad += [f"tests/{rel}:{line}: {name}(" for line, name in _builds(path.read_text()) if name not in allowed]
    assert not bad, (
        "build test models with testkit.tiny_model (a preset, a model_type with its config's arguments, or a config "
        "object from hf_fpdt.models.presets / AutoConfig.for_model), not directly:\n" + "\n".join(bad)
    )
