"""Dead code stays out: vulture (`make lint`, configured in pyproject.toml) finds none, it does find
a function nothing calls, and its whitelist names only what the code defines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WHITELIST = REPO / "vulture_whitelist.py"


def _config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["vulture"]


def test_vulture_finds_no_dead_code() -> None:
    pytest.importorskip("vulture")
    r = subprocess.run([sys.executable, "-m", "vulture"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_unused_function_is_found_and_a_command_is_not(tmp_path: Path) -> None:
    vulture = pytest.importorskip("vulture")
    cfg = _config()
    src = tmp_path / "mod.py"
    src.write_text(
        "import click\n\n\n"
        "@click.group()\ndef group():\n    pass\n\n\n"
        "@group.command('run')\ndef run_cmd():\n    pass\n\n\n"
        "def used():\n    return 1\n\n\n"
        "def never_called():\n    return used()\n")
    v = vulture.Vulture(ignore_decorators=cfg["ignore_decorators"])
    v.scavenge([str(src)])
    found = [item.name for item in v.get_unused_code(min_confidence=cfg["min_confidence"])]
    assert found == ["never_called"]


def test_the_whitelist_names_only_what_the_code_defines() -> None:
    listed = {node.attr for node in ast.walk(ast.parse(WHITELIST.read_text()))
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "_"}
    defined: set[str] = set()
    for folder in ("mtpwrap", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    defined.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
    assert listed and not listed - defined, f"not defined any more: {sorted(listed - defined)}"
