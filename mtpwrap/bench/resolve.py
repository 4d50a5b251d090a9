"""Find the llama-server binary and the model a benchmark runs, and parse list options."""

from __future__ import annotations

import os
from pathlib import Path

from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.errors import ConfigError
from mtpwrap.models import known as models
from mtpwrap.run.inputs import find_server


def server_binary(explicit: str | Path | None) -> Path:
    """--binary, `MTPWRAP_BINARY`, or the installed build's llama-server."""

    binary, _caps, _manifest = find_server(explicit)
    assert binary is not None
    return binary


def model_path(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit).expanduser()
        if p.is_file():
            return p

        return Path(models.resolve_model(explicit))
    env = os.environ.get("MTPWRAP_DEMO_MODEL")
    if env and Path(env).is_file():
        return Path(env)

    return Path(models.ensure_demo_model())


def int_list(value: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {value!r}.") from None
    if not out or any(v < 1 for v in out):
        raise ConfigError(f"{what} must list positive integers, got {value!r}.")
    return out


def float_list(value: str, what: str) -> list[float]:
    try:
        out = [float(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated numbers, got {value!r}.") from None
    if not out or any(not 0.0 <= v <= 1.0 for v in out):
        raise ConfigError(f"{what} must list numbers between 0 and 1, got {value!r}.")
    return out


def model_context(model: Path) -> int | None:
    """The training context from the GGUF header (contexts above it are clipped)."""

    try:
        return read_facts(Path(model)).n_ctx_train or None
    except ConfigError:
        return None
