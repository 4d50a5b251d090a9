"""A serving-only install (`pip install mtpwrap`, no extras) serves; what needs an extra says
which, in one sentence: `bundle create` refuses before it writes anything, a benchmark's report
says why its plots are missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtpwrap.errors import MissingExtra, require_extra
from tests.helpers import REPO

#: run the CLI as if the named modules were not installed
_WITHOUT = """
import sys
for name in {names!r}:
    sys.modules[name] = None  # an import of it raises ImportError
from mtpwrap.cli import main
sys.argv = ["mtpwrap", *{args!r}]
main()
"""


def _run(names: list[str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT.format(names=names, args=list(args))],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                               "MTPWRAP_HOME": str(cwd / "home")})


def test_bundle_create_without_its_extra_names_it(tmp_path: Path) -> None:
    r = _run(["cyclonedx"], "bundle", "create", str(tmp_path / "b"), cwd=tmp_path)
    assert r.returncode == 78, r.stderr
    assert "from mtpwrap's `bundle` extra" in r.stderr
    assert "pip install 'mtpwrap[bundle]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()


def test_a_module_of_an_extra_that_is_missing_is_named_with_its_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the benchmarks' reports say in place of their plots on a serving-only install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra) as info:
        require_extra("matplotlib", "bench", "the plots")
    assert str(info.value) == ("the plots needs matplotlib, from mtpwrap's `bench` extra, which "
                               "this installation lacks: install it with pip install "
                               "'mtpwrap[bench]'.")
    require_extra("json", "bench", "the plots")  # there: nothing said
