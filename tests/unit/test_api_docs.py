"""docs/reference/api.md is the list of ``hf_fpdt.__all__`` (issue 35, item 6): every exported name is documented
there, every name its tables document is exported, and the names it says are imported on first use are the
package's lazily imported ones."""

from __future__ import annotations

import re
from pathlib import Path

import hf_fpdt

API = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"


def _mentioned(text: str) -> set[str]:
    """Names written in code spans as a name or a call (`` `name` ``, `` `name(...)` ``, `` `hf_fpdt.name` ``)."""
    return set(re.findall(r"`(?:hf_fpdt\.)?([A-Za-z_]\w*)(?=[`(])", text))


def _table_names(text: str) -> set[str]:
    """The names the first column of the page's tables documents (the header rows left out)."""
    names = set()
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2 and not set(cells[1].strip()) <= {"-"}:
            names |= _mentioned(cells[1])
    return names - {"name"}


def test_every_exported_name_is_documented():
    missing = sorted(set(hf_fpdt.__all__) - _mentioned(API.read_text()))
    assert not missing, f"{API.name} misses {missing} of hf_fpdt.__all__"


def test_every_documented_entry_is_exported():
    extra = sorted(_table_names(API.read_text()) - set(hf_fpdt.__all__))
    assert not extra, f"{API.name}'s tables document {extra}, which hf_fpdt.__all__ does not export"


def test_the_lazily_imported_names_are_the_packages():
    intro = API.read_text().split("\n## ", 1)[0]
    said = re.search(r"\n?([^.]*) (?:is|are) imported\s+on first use", intro)
    assert said, f"{API.name}'s introduction no longer says which names are imported on first use"
    assert _mentioned(said.group(1)) == set(hf_fpdt._LAZY), (sorted(_mentioned(said.group(1))), sorted(hf_fpdt._LAZY))
