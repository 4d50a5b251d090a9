"""State, cache, build and log locations. `MTPWRAP_HOME` redirects all of the per-user ones."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The source checkout this package runs from (where `build/` and `vendor/` live)."""
    return Path(__file__).resolve().parent.parent


def home() -> Path:
    env = os.environ.get("MTPWRAP_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mtpwrap"


def downloads_dir() -> Path:
    return home() / "downloads"


def sources_dir() -> Path:
    return home() / "sources"


def build_cache_dir() -> Path:
    """Builds keyed by source and options, shared by every checkout on this machine."""
    return home() / "builds"


def models_dir() -> Path:
    env = os.environ.get("MTPWRAP_MODELS_DIR")
    return Path(env).expanduser() if env else home() / "models"


def state_dir() -> Path:
    env = os.environ.get("MTPWRAP_STATE_DIR")
    return Path(env).expanduser() if env else home() / "state"


def log_dir() -> Path:
    env = os.environ.get("MTPWRAP_LOG_DIR")
    return Path(env).expanduser() if env else home() / "logs"


def is_checkout() -> bool:
    """Whether the package runs from a source checkout (else from an installed wheel)."""
    return (repo_root() / "pyproject.toml").is_file()


def build_root() -> Path:
    """The installed builds, one folder per variant, each with manifest.json and bin/: `build/`
    of a checkout; for an installed package (a bundle's venv) `<MTPWRAP_HOME>/build`, shared by
    the venvs of every bundle installed beside another."""
    env = os.environ.get("MTPWRAP_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    return repo_root() / "build" if is_checkout() else home() / "build"


def user_config_dir() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".config") / "mtpwrap"


def replace_text(path: Path, text: str, mode: int = 0o666) -> None:
    """`path` holds `text` (created with `mode`, less the umask), written beside it and renamed:
    a reader never sees half a file, and two writers at once each replace it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_tmp(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w",
                       encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:  # a failed write (a full disk) leaves nothing behind
        tmp.unlink(missing_ok=True)


def private_tmp(path: Path) -> Path:
    """A temporary name beside `path` that no other process writes."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")
