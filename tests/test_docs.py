"""The documentation: the generated CLI reference is current, the README stays a first screen,
and every file the docs or the code cite is in the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import REPO

DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *DOCS.rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path in backticks that starts at a top-level folder of the repository.
CITED_PATH = re.compile(r"`((?:mtpwrap|tests|benchmarks|deploy|docs|patches|profiles|\.ci)/"
                        r"[^`\s*<>…]+)`")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_cli_reference",
                                                  DOCS / "gen_cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current() -> None:
    gen = _generator()
    assert gen.TARGET.read_text() == gen.render(), (
        "docs/reference/cli.md is not current: run `python docs/gen_cli_reference.py`")


def test_cli_reference_covers_every_command() -> None:
    from mtpwrap.cli import COMMANDS

    text = (DOCS / "reference" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"\n## mtpwrap {name}\n" in text


def test_readme_is_a_first_screen() -> None:
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= 5 * 1024, f"README.md is {len(readme)} bytes; move detail into docs/"
    text = readme.decode()
    for must in ("make up", "curl", "## On the GPU workstation", "## What you get"):
        assert must in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_and_cited_files_exist(page: Path) -> None:
    text = page.read_text()
    # The module map is rewritten from the tree by docs/gen_module_map.py; a module that moved
    # shows there until it is run again.
    text = re.sub(r"<!-- module map: begin -->.*<!-- module map: end -->", "", text, flags=re.S)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    for cited in CITED_PATH.findall(text):
        path = cited.split("::", 1)[0].rstrip(".,:;)")
        if not (REPO / path).exists():
            missing.append(cited)
    assert not missing, f"{page.relative_to(REPO)} cites what the repository lacks: {missing}"


def test_sources_cite_only_documents_in_the_repository() -> None:
    """A Markdown file named in code or tests is a file in the repository."""
    known = {p.name for p in REPO.rglob("*.md")
             if not {".venv", ".git", "build"} & set(p.relative_to(REPO).parts)}
    wrong = []
    for folder in ("mtpwrap", "tests", "benchmarks"):
        for src in (REPO / folder).rglob("*.py"):
            for name in re.findall(r"(?<![\w-])(\w[\w-]*\.md)\b", src.read_text()):
                if name not in known and name not in {"report.md", "gpu_check.md",
                                                      "speed_report.md", "tune.md"}:
                    wrong.append(f"{src.relative_to(REPO)}: {name}")
    assert not wrong, wrong


def test_every_package_has_a_place_in_the_architecture() -> None:
    text = (DOCS / "architecture.md").read_text()
    for entry in sorted((REPO / "mtpwrap").iterdir()):
        if entry.name.startswith("_") or entry.name == "__pycache__":
            continue
        assert f"mtpwrap/{entry.name}" in text or f"mtpwrap.{entry.stem}" in text, entry.name
