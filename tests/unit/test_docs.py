"""The README is the front page and ``docs/`` the rest (issue 28, item 5): what a reader meets must hold.

* README.md stays short (<= 300 lines), its first two commands are the install and the test command, the test
  command is exactly what CI runs last (``.ci/run``), the install means what CI installs, and its requirements
  line names ``setup.cfg``'s pins;
* every relative link and ``#anchor`` in README.md and ``docs/**/*.md`` resolves: the file exists, the anchor is
  a heading of the target, slugified both the way MkDocs does (Python-Markdown's ``toc``) and the way GitHub does,
  so a link works on either;
* every page under ``docs/`` is in ``mkdocs.yml``'s nav (and every nav entry exists), and ``mkdocs build
  --strict`` runs clean (skipped only where mkdocs is not installed);
* the reference pages keep up with the code: the layout table names every module of ``hf_fpdt/``, the settings
  table every ``FPDTConfig`` field and ``FPDT_*`` variable, and files the pages name exist.
"""

from __future__ import annotations

import configparser
import dataclasses
import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

FENCE = re.compile(r"^(\s*)(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def markdown_files() -> list[Path]:
    return [README, *pages()]


def split_fenced(text: str) -> tuple[list[str], list[list[str]]]:
    """(the lines outside fenced code blocks, the fenced blocks' lines in order)."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            blocks.append([])
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            blocks[-1].append(line)
        else:
            prose.append(line)
    assert fence is None, "an unclosed code fence"
    return prose, blocks


def commands(text: str) -> list[str]:
    """Shell command lines of the fenced blocks, in order (comments and blank lines dropped)."""
    out = []
    for block in split_fenced(text)[1]:
        for line in block:
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def ci_lines() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def normalise_install(cmd: str) -> str:
    words = cmd.split()
    if words[:3] == ["python", "-m", "pip"]:
        words = ["pip", *words[3:]]
    return " ".join(w for w in words if w not in ("-q", "--quiet"))


# ---- slugs: MkDocs (Python-Markdown toc) and GitHub ---------------------------------------------------------


def heading_text(raw: str) -> str:
    """A heading's text as rendered: code spans' contents, link texts, no emphasis markers or HTML comments."""
    text = re.sub(r"<!--.*?-->", "", raw)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"(\*\*|__|\*)", "", text).strip()


def slug_mkdocs(text: str) -> str:
    """``markdown.extensions.toc.slugify``: ASCII, drop what is not a word character, space or hyphen; runs of
    spaces and hyphens become one hyphen."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def slug_github(text: str) -> str:
    """GitHub's heading ids: lower-case, drop punctuation (keep word characters, spaces, hyphens), each space
    a hyphen."""
    text = re.sub(r"[^\w\s-]", "", text.lower())
    return text.strip().replace(" ", "-")


def headings(path: Path) -> list[str]:
    prose, _ = split_fenced(path.read_text())
    return [heading_text(m.group(1)) for line in prose if (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))]


def anchors(path: Path) -> set[str]:
    """Anchors that work on both GitHub and the MkDocs site (a heading whose two slugs agree)."""
    return {slug_mkdocs(h) for h in headings(path) if slug_mkdocs(h) == slug_github(h)}


def links(path: Path) -> list[str]:
    prose, _ = split_fenced(path.read_text())
    text = "\n".join(CODE_SPAN.sub("", line) for line in prose)
    return LINK.findall(text)


# ---- the README ---------------------------------------------------------------------------------------------


def test_readme_is_a_front_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move sections to docs/"


def test_readme_starts_with_the_install_and_the_ci_test_command():
    install, test = commands(README.read_text())[:2]
    ci = ci_lines()
    assert test == ci[-1], f"README's test command {test!r} is not .ci/run's last line {ci[-1]!r}"
    ci_install = [ln for ln in ci if " pip install " in f" {ln} "]
    assert ci_install, ".ci/run installs nothing"
    assert normalise_install(install) == normalise_install(ci_install[0]), (install, ci_install[0])


def test_readme_requirements_match_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    requires = [r for r in requires if not r.startswith("#")]
    text = README.read_text()
    for spec in [*requires, cfg["options"]["python_requires"].strip()]:
        assert spec.replace(" ", "") in text, f"README's requirements line lacks {spec!r} (setup.cfg)"


# ---- links and anchors --------------------------------------------------------------------------------------


def test_slugs_follow_mkdocs_and_github():
    assert slug_mkdocs("Chunk size and offload: auto") == "chunk-size-and-offload-auto"
    assert slug_mkdocs(heading_text("Every memory part: `hf_fpdt.apply`")) == "every-memory-part-hf_fpdtapply"
    assert slug_github("a -- b") == "a----b" and slug_mkdocs("a -- b") == "a-b"  # why both are checked
    assert "a-b" not in anchors_of_text("# a -- b")


def anchors_of_text(text: str) -> set[str]:
    hs = [heading_text(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")]
    return {slug_mkdocs(h) for h in hs if slug_mkdocs(h) == slug_github(h)}


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path: Path):
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        if path != README and DOCS not in dest.parents:
            bad.append(f"{target}: outside docs/ (the site cannot link it; name the repository path in code)")
        if anchor:
            if dest.suffix != ".md":
                bad.append(f"{target}: an anchor into a file that is not a page")
            elif anchor not in anchors(dest):
                bad.append(f"{target}: no heading of {dest.name} has the anchor #{anchor}")
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_every_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in walk(value)]
        return []

    nav = walk(config["nav"])
    on_disk = {str(p.relative_to(DOCS)) for p in pages()}
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    assert set(nav) == on_disk, f"not in nav: {sorted(on_disk - set(nav))}; missing: {sorted(set(nav) - on_disk)}"
    assert nav[0] == "index.md"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[test]')")
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "index.html").exists()


# ---- the reference pages keep up with the code ---------------------------------------------------------------


def test_layout_table_lists_every_module():
    table = {}
    for line in (DOCS / "development.md").read_text().splitlines():
        m = re.match(r"^\| `([\w/]+/)` \| (.*)\|$", line)
        if m:
            table[m.group(1)] = set(re.findall(r"`([\w.]+\.py)`", m.group(2)))
    package = ROOT / "hf_fpdt"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        folder = "hf_fpdt/" if len(rel.parts) == 1 else f"{rel.parts[0]}/"
        if len(rel.parts) > 1 and rel.name == "__init__.py":
            continue  # a subfolder's __init__ only names what the folder holds
        if rel.name not in table.get(folder, set()):
            missing.append(str(Path("hf_fpdt") / rel))
    assert not missing, f"docs/development.md's layout table lacks {missing}"


def test_settings_page_names_every_field_and_variable():
    from hf_fpdt.config import FPDTConfig

    text = (DOCS / "reference" / "settings.md").read_text()
    fields = [f.name for f in dataclasses.fields(FPDTConfig)]
    variables = set(re.findall(r"FPDT_[A-Z_]+", (ROOT / "hf_fpdt" / "config.py").read_text()))
    missing = [f for f in fields if f"| `{f}` |" not in text] + sorted(v for v in variables if f"`{v}`" not in text)
    assert not missing, f"docs/reference/settings.md lacks {missing}"


def test_files_the_pages_name_exist():
    known = {p.name for d in ("hf_fpdt", "tests", "examples", "accelerate_configs") for p in (ROOT / d).rglob("*")}
    bad = []
    for path in markdown_files():
        for token in CODE_SPAN.findall(path.read_text()):
            name = token[1].strip()
            if not re.fullmatch(r"[\w./-]+\.(py|yaml)", name):
                continue
            ok = (ROOT / name).exists() or (ROOT / "hf_fpdt" / name).exists() if "/" in name else name in known
            if not ok:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "files named in the docs that do not exist:\n" + "\n".join(bad)


def test_sp_means_sequence_parallelism():
    """The sparse patterns are ``hf_fpdt.patterns``, never imported as ``sp`` (SP is sequence parallelism)."""
    for path in markdown_files():
        assert not re.search(r"\bas sp\b", path.read_text()), path


# ---- cross-references in the examples' headers and comments (issue 37, item 5) -------------------------------

REPO_PATH = re.compile(r"\b((?:docs|examples|tests|hf_fpdt|accelerate_configs)/[\w/.-]*\w\.(?:py|md|yaml))")
SECTION = re.compile(r"\b(README|docs/[\w/.-]+\.md), \"([^\"]+)\"")


def reference_problems(text: str) -> list[str]:
    """The repository paths ``text`` names that do not exist, and the ``PAGE, "Section"`` references (README or a
    docs page) whose page has no such heading."""
    bad = [f"{name}: no such file" for name in REPO_PATH.findall(text) if not (ROOT / name).exists()]
    for page, section in SECTION.findall(text):
        path = README if page == "README" else ROOT / page
        if not path.exists() or section not in headings(path):
            bad.append(f'{page}, "{section}": no such section')
    return bad


def test_reference_check_catches_a_moved_section():
    assert reference_problems('see README, "Launch configs"') == ['README, "Launch configs": no such section']
    assert reference_problems('docs/guides/launch.md, "Launch configs"') == []
    assert reference_problems("examples/nothing_here.py") == ["examples/nothing_here.py: no such file"]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_example_cross_references_resolve(path: Path):
    bad = reference_problems(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)
