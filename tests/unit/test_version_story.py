"""docs/troubleshooting.md's version story agrees with the package it describes (issue 43, item 7: it said that
"hf_fpdt up to 0.3.0 pinned transformers<5.24" while the installed 0.3.0 admits every 5.x)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement

import hf_fpdt

ROOT = Path(__file__).resolve().parents[2]


def _transformers_range() -> tuple[str, Requirement]:
    """setup.cfg's transformers requirement: its line and its parsed form."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    line = next(line for line in lines if Requirement(line).name == "transformers")
    return line, Requirement(line)


def test_an_old_pin_is_told_of_the_release_not_of_this_version() -> None:
    """Every sentence that says hf_fpdt pinned transformers below a release this checkout admits names the release
    as released, with its date as the CHANGELOG gives it, and says this checkout's range."""
    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    line, admitted = _transformers_range()
    dates = dict(re.findall(r"^## (\d+\.\d+\.\d+) \(([\d-]+)\)$", (ROOT / "CHANGELOG.md").read_text(), re.M))
    claims = [m for m in re.finditer(r"pinned `transformers<([\d.]+)`", text)]
    assert claims, "the page tells of the old pin"
    for claim in claims:
        if not admitted.specifier.contains(claim.group(1)):
            continue  # this checkout excludes that release too: the pin is still true
        sentence = text[text.rfind(". ", 0, claim.start()) + 2 : text.find(". ", claim.end())]
        assert f"up to {hf_fpdt.__version__} pinned" not in sentence, sentence  # the installed version does not
        versions = re.findall(r"\b(\d+\.\d+\.\d+) as released \(([\d-]+)\)", sentence)
        assert versions and all(dates.get(v) == d for v, d in versions), (sentence, dates)
    assert f"`{line}`" in text, line  # this checkout's range, as setup.cfg says it
