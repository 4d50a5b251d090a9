"""The tests' own layout: test modules take plain helpers from tests/helpers.py and fixtures
from conftest.py, never import conftest or one another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_conftest_or_another_test_module() -> None:
    wrong = []
    for src in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(src.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if name.startswith("tests.") and (last == "conftest" or last.startswith("test_")):
                    wrong.append(f"{src.relative_to(TESTS.parent)} imports {name}")
    assert not wrong, wrong
