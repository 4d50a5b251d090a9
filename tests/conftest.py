"""Shared fixtures.

Integration tests use the real llama-server, built from the pinned source by
`mtpwrap.build.builder.ensure_built` (a no-op once the build cache has it), and the real demo model.
`MTPWRAP_HOME` is left alone on purpose so the build and model caches are shared between runs;
tests that need an isolated home use the `isolated_home` fixture.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cpu_manifest() -> dict:
    """The manifest of the CPU build of llama-server (built on first use, then cached)."""
    from mtpwrap.build import builder

    return builder.ensure_built(variant="cpu").to_dict()


@pytest.fixture(scope="session")
def llama_server_bin(request: pytest.FixtureRequest) -> Path:
    # MTPWRAP_BINARY points the tests at another build (a CUDA one, say).
    env = os.environ.get("MTPWRAP_BINARY")
    if env:
        return Path(env)
    manifest = request.getfixturevalue("cpu_manifest")
    return Path(manifest["binaries"]["llama-server"]["path"])


@pytest.fixture(scope="session")
def fit_params_bin(request: pytest.FixtureRequest) -> Path:
    env = os.environ.get("MTPWRAP_BINARY")
    if env:
        return Path(env).with_name("llama-fit-params")
    manifest = request.getfixturevalue("cpu_manifest")
    return Path(manifest["binaries"]["llama-fit-params"]["path"])


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from mtpwrap.decide import models

    return models.ensure_demo_model()  # honours MTPWRAP_DEMO_MODEL


@pytest.fixture
def drop_gguf_files(tmp_path: Path) -> Iterator[None]:
    """Shape-only models are sparse but tens of GB in apparent size: never leave them behind."""
    yield
    for f in tmp_path.glob("*.gguf"):
        f.unlink()


@pytest.fixture(scope="session")
def shape_27b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A shape-only Qwen3.6-27B GGUF (16.5 GB apparent, a few MB on disk), written once."""
    from mtpwrap.build import tiny_gguf

    path = tiny_gguf.write_shape_only(tmp_path_factory.mktemp("q27") / "q27.gguf",
                                        "qwen3.6-27b")
    yield path
    path.unlink()




@pytest.fixture
def free_port() -> int:
    from mtpwrap.proc import free_loopback_port

    return free_loopback_port()


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "mtpwrap-home"
    home.mkdir()
    monkeypatch.setenv("MTPWRAP_HOME", str(home))
    return home


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("NO_COLOR", "1")
    env.setdefault("COLUMNS", "200")
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m mtpwrap ARGS` as a person would, from this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "mtpwrap", *args],
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd or REPO),
    )


@pytest.fixture
def cli() -> Iterator[object]:
    yield run_cli


def require_tool(name: str, package: str) -> str:
    """Path of a system tool a test needs. Missing: a failure in CI (CI=true), else a skip
    that says how to install it."""
    import shutil

    path = shutil.which(name)
    if path is None:
        how = (f"{name} is not installed: run `sudo make system-deps` "
               f"(or `apt-get install {package}`)")
        if os.environ.get("CI") == "true":
            pytest.fail(how)
        pytest.skip(how)
    return path
