"""The stages form a DAG: import-linter holds the layer contract (`make lint`); this file holds
the rules it cannot express: the project's own modules are imported at module top, except in
the lazy command table and where the import defers a heavy third-party package for `--help`; and
a name is imported from the module that defines it, never through a forwarding `import X as X`
left behind when a module was split; and every third-party package the code imports is declared
in pyproject.toml, not only present because another dependency pulls it in."""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mtpwrap"
# Imports that cost `mtpwrap --help` its speed (measured with `python -X importtime`).
HEAVY = {"uvicorn", "starlette", "matplotlib", "pynvml", "numpy", "gguf", "httpx", "rich",
         "psutil", "yaml", "prometheus_client", "huggingface_hub", "openai", "asyncio"}


def module_name(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str, pkg: Path) -> Path | None:
    base = pkg.parent.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def top_imports(path: Path) -> set[str]:
    """Absolute names imported at module level (inside `if` too, outside functions)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
    visit(tree.body)
    return names


@cache
def is_heavy(name: str, pkg: Path) -> bool:
    """Whether importing `name` (a project module) loads a heavy third-party package."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        mod = todo.pop()
        path = module_path(mod, pkg)
        if mod in seen or path is None:
            continue
        seen.add(mod)
        for imp in top_imports(path):
            root = imp.split(".")[0]
            if root in HEAVY:
                return True
            if root == "mtpwrap":
                todo.append(imp)
    return False


def deferred_imports(pkg: Path = PKG) -> list[tuple[str, int, str]]:
    """(file, line, module) of each function-level import of a light project module."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        name = module_name(path, pkg)
        if name == "mtpwrap.cli" or name.startswith("mtpwrap.commands"):
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.startswith("mtpwrap"):
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                    if not any(module_path(t, pkg) and is_heavy(t, pkg) for t in targets):
                        found.append((str(path.relative_to(pkg.parent)), node.lineno,
                                      node.module))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("mtpwrap") and not is_heavy(a.name, pkg):
                            found.append((str(path.relative_to(pkg.parent)), node.lineno,
                                          a.name))
    return found


def test_project_modules_are_imported_at_module_top() -> None:
    found = deferred_imports()
    assert not found, "import these at module top (they load nothing heavy): " + ", ".join(
        f"{f}:{line} {mod}" for f, line, mod in found)


def test_a_deferred_light_import_is_found(tmp_path: Path) -> None:
    """The check can fail: a function-level import of a light module is reported, one of a
    module that loads a heavy package is not."""
    pkg = tmp_path / "mtpwrap"
    (pkg / "decide").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decide" / "__init__.py").write_text("")
    (pkg / "decide" / "light.py").write_text("X = 1\n")
    (pkg / "decide" / "heavy.py").write_text("import numpy\n")
    (pkg / "decide" / "user.py").write_text(
        "def f():\n    from mtpwrap.decide import light\n    from mtpwrap.decide import heavy\n"
        "    return light, heavy\n")
    assert deferred_imports(pkg) == [("mtpwrap/decide/user.py", 2, "mtpwrap.decide")]


def forwarding_imports(pkg: Path = PKG) -> list[tuple[str, int, str]]:
    """(file, line, name) of each `from M import X as X` or `import X as X`: a re-export that
    keeps a moved name reachable under its old module instead of its importers being changed."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [(str(path.relative_to(pkg.parent)), node.lineno, a.name)
                          for a in node.names if a.asname == a.name]
    return found


def test_no_forwarding_imports() -> None:
    found = forwarding_imports()
    assert not found, "import these from the module that defines them: " + ", ".join(
        f"{f}:{line} {name}" for f, line, name in found)


def test_a_forwarding_import_is_found(tmp_path: Path) -> None:
    """The check can fail: `X as X` is reported, a plain import or a real rename is not."""
    pkg = tmp_path / "mtpwrap"
    pkg.mkdir()
    (pkg / "m.py").write_text("from mtpwrap.a import f as f\nfrom mtpwrap.a import g\n"
                              "from mtpwrap.a import h as other\nimport json as json\n")
    assert forwarding_imports(pkg) == [("mtpwrap/m.py", 1, "f"), ("mtpwrap/m.py", 4, "json")]


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_third_party_imports_are_declared_dependencies() -> None:
    """Every import is a declared dependency; one from an extra (`bench`, `bundle`: what a
    serving-only install lacks) only inside a function, so the package imports without it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    def names(deps: list[str]) -> set[str]:
        return {_dist(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}

    project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]
    declared = names(project["dependencies"])
    extras = set().union(*(names(deps) for extra, deps in
                           project["optional-dependencies"].items()
                           if extra not in ("test", "cuda"))) - {"mtpwrap"}
    providers = packages_distributions()
    undeclared = set()
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root in sys.stdlib_module_names or root in ("mtpwrap", "__future__"):
                    continue
                dists = {_dist(d) for d in providers.get(root, [])}
                if dists & declared or (dists & extras and id(node) not in top):
                    continue
                undeclared.add(f"{root} ({path.relative_to(PKG.parent)}:{node.lineno})")
    assert not undeclared, "declare in pyproject.toml: " + ", ".join(sorted(undeclared))
