"""Shared fixtures and the two test tiers.

Unit tests (everything not marked `integration`) each get an empty `MTPWRAP_HOME` of their own,
no `MTPWRAP_*` variable from the caller's environment, and no build folder, so they pass on a
fresh clone without network, build tools or another checkout's caches; a unit test that asks for
a fixture that builds llama-server or downloads the demo model is refused at collection.

Integration tests use the real llama-server, built from the pinned source by `make build`
before pytest runs, and the real demo model. No test compiles llama.cpp: `cmake` on the tests'
PATH is a guard (`compile_guard`) that refuses `cmake --build` of a llama.cpp tree, so a test
that would compile fails at once, naming the make target, instead of compiling for minutes
under its timeout. Their `MTPWRAP_HOME` is left alone on purpose so the build and model caches
are shared between runs; the ones that need an isolated home use the `isolated_home` fixture.

Plain helpers (running the CLI, an `up` instance, a supervisor over the fake llama-server) are
in tests/helpers.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DATA, REPO, compile_guard

# Fixtures that compile llama-server or download the demo model on first use.
BUILDS_OR_DOWNLOADS = frozenset({"cpu_manifest", "llama_server_bin", "fit_params_bin",
                                 "demo_model"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [f"{item.nodeid} (uses {', '.join(sorted(needs))})" for item in items
             if not item.get_closest_marker("integration")
             and (needs := BUILDS_OR_DOWNLOADS & set(getattr(item, "fixturenames", ())))]
    if wrong:
        raise pytest.UsageError(
            "these tests build llama-server or download the demo model but are not marked "
            "`integration`; mark them so the unit tier stays hermetic:\n  " + "\n  ".join(wrong))


def pytest_configure(config: pytest.Config) -> None:
    """The guard goes first on PATH for the whole session, in this process and its children;
    an illegal supervisor transition raises (a bug is a failed test, not a log line)."""
    from mtpwrap.supervision import state

    state.STRICT = True
    real = shutil.which("cmake")
    if real is None or os.environ.get("TESTS_COMPILE_GUARD"):
        return
    folder = Path(tempfile.mkdtemp(prefix="mtpwrap-guard-"))
    compile_guard(real, folder)
    _HOMES.append(str(folder))
    os.environ["TESTS_COMPILE_GUARD"] = str(folder)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


_HOMES: list[str] = []  # the unit tests' homes, removed when the session ends


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A unit test runs in an empty MTPWRAP_HOME of its own, with no MTPWRAP_* variable of the
    caller's and no build folder; integration tests keep the caller's environment and so the
    shared caches. Set around the whole test, so that module and session fixtures a unit test
    is the first to ask for are made in the unit environment too."""
    if item.get_closest_marker("integration"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("MTPWRAP_")]:
            mp.delenv(key)
        home = Path(tempfile.mkdtemp(prefix="mtpwrap-home-"))
        _HOMES.append(str(home))
        mp.setenv("MTPWRAP_HOME", str(home))
        mp.setenv("MTPWRAP_BUILD_DIR", str(home / "checkout-build"))
        mp.setenv("XDG_CONFIG_HOME", str(home / "xdg-config"))
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for home in _HOMES:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def unit_home(request: pytest.FixtureRequest) -> Path | None:
    """The unit test's own MTPWRAP_HOME (None for an integration test)."""
    if request.node.get_closest_marker("integration"):
        return None
    return Path(os.environ["MTPWRAP_HOME"])


@pytest.fixture
def isolated_home(unit_home: Path | None, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of the test's own, also for an integration test."""
    if unit_home is not None:
        return unit_home
    home = tmp_path / "mtpwrap-home"
    home.mkdir()
    monkeypatch.setenv("MTPWRAP_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg-config"))  # user profiles too
    return home


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cpu_manifest() -> dict:
    """The manifest of the CPU build of llama-server (built on first use, then cached)."""
    from mtpwrap.build import builder
    from mtpwrap.errors import MtpwrapError

    try:
        return builder.ensure_built(variant="cpu").to_dict()
    except MtpwrapError as exc:
        pytest.fail(f"no usable CPU build of llama-server in the build cache ({exc}); "
                    "`make build` makes it before the integration tests run", pytrace=False)


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
    from mtpwrap.models import known as models

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


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shape-only Qwen3.6-27B GGUF, one per test module."""
    from mtpwrap.build import tiny_gguf

    return tiny_gguf.write_shape_only(tmp_path_factory.mktemp("m") / "qwen3.6-27b.gguf")


@pytest.fixture
def fork_binary(tmp_path: Path) -> Path:
    """A stand-in llama-server that answers --help and --version as the recorded fork does."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n"
                   f'case "$1" in --help) cat "{DATA}/help/fork-1c6e4ea.txt";; '
                   f'--version) cat "{DATA}/help/fork-1c6e4ea.version.txt";; *) exit 1;; esac\n')
    exe.chmod(0o755)
    return exe


@pytest.fixture
def free_port() -> int:
    from mtpwrap.proc import free_loopback_port

    return free_loopback_port()
