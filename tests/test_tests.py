"""The tests' own rules: test modules take plain helpers from tests/helpers.py and fixtures
from conftest.py, never import conftest or one another; no test compiles llama.cpp."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import GUARD_EXIT

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


def test_no_test_compiles_llama_cpp(tmp_path: Path) -> None:
    """`cmake` on the tests' PATH is the guard: it refuses `cmake --build` of a folder configured
    from a llama.cpp tree (one with ggml/src) and names the make target, and runs cmake for
    anything else (the fake tree the build tests compile, configure, --version)."""
    real = shutil.which("cmake")
    if real is None:
        pytest.skip("no cmake on PATH (the hermetic tier): nothing can compile")
    assert Path(real).parent == Path(os.environ["TESTS_COMPILE_GUARD"]), real
    tree, build = tmp_path / "llama.cpp", tmp_path / "build"
    (tree / "ggml" / "src").mkdir(parents=True)
    build.mkdir()
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={tree}\n")
    refused = subprocess.run(["cmake", "--build", str(build), "--target", "llama-server"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == GUARD_EXIT, refused
    assert "tests never compile it" in refused.stderr and "make build" in refused.stderr
    (tree / "ggml" / "src").rmdir()
    other = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True,
                           timeout=30)
    assert other.returncode not in (0, GUARD_EXIT), other  # the real cmake: not configured
    assert subprocess.run(["cmake", "--version"], capture_output=True, timeout=30).returncode == 0
