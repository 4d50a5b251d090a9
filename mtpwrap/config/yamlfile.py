"""The one YAML reader of configuration files (the config file, profiles): errors name the file
and the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError


def read_yaml(path: Path, where: str | None = None, *, what: str = "file",
              missing_hint: str = "Give an existing YAML file.") -> Any:
    """The parsed document of `path` (None when empty); `where` names it in errors (default:
    the path), `what` says what kind of file it is ("config file", "profile")."""
    import yaml

    where = where or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file.", hint=missing_hint) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: cannot read the {what}: not UTF-8 text ({exc.reason})."
                          ) from exc
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the {what}: {exc.strerror or exc}.") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{loc}: not valid YAML (YAML syntax error: {problem}).") from exc
