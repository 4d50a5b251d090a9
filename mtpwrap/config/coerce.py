"""The one coercer: a YAML value, an environment string or a flag's text -> the key's type."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from mtpwrap.config.table import REFUSED, SECTIONS, STRICT_SECTIONS, Key
from mtpwrap.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse(raw: Any, kind: str) -> tuple[bool, Any]:
    """(ok, value) for one raw value of `kind`."""
    if kind == "tristate":
        low = raw.strip().lower() if isinstance(raw, str) else raw
        if low == "auto":
            return True, "auto"
        if isinstance(low, bool):
            return True, low
        if low in _TRUE or low in _FALSE:
            return True, low in _TRUE
        return False, None
    if kind == "list":
        items = [v.strip() for v in raw.split(",") if v.strip()] if isinstance(raw, str) else raw
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
            return True, tuple(items)
        return False, None
    if kind == "bool":
        if isinstance(raw, bool):
            return True, raw
        if isinstance(raw, str) and raw.strip().lower() in (*_TRUE, *_FALSE, ""):
            return True, raw.strip().lower() in _TRUE
        return False, None
    if isinstance(raw, bool):
        return False, None  # true is not 1, and not a host name either
    if kind in ("int", "float"):
        number = int if kind == "int" else float
        if isinstance(raw, int) or (kind == "float" and isinstance(raw, float)):
            return True, number(raw)
        if isinstance(raw, str):
            try:
                return True, number(raw.strip())
            except ValueError:
                return False, None
        return False, None
    if isinstance(raw, (str, int, float)):  # "str"
        return True, str(raw)
    return False, None


def convert(raw: Any, key: Key, where: str, name: str, *, strict: bool = False) -> Any:
    """Turn a YAML value or an environment string into the key's type, or say what is wrong.
    strict: a YAML value must already have the key's type (no "3" for 3); kind "list": a list
    of strings, or one comma-separated string."""
    ok = not (strict and key.kind != "list" and isinstance(raw, str) != (key.kind == "str"))
    value = None
    if ok:
        ok, value = _parse(raw, key.kind)
    if not ok or not key.accepts(value):
        raise ConfigError(f"{where}: {name}: expected {key.expected()}, got {raw!r}.",
                          hint=_fix(where, name))
    return value


def _fix(where: str, name: str) -> str | None:
    if where.startswith("--"):
        return None  # the flag is on the command line just typed
    if where.startswith("MTPWRAP_"):
        return f"Fix or unset {where}."
    return f"Fix {name} in {where}."


def check_names(section: str, names: Iterable[Any], where: str) -> None:
    """Every name is a key of `section`, or a ConfigError says what to do instead."""
    keys = SECTIONS[section]
    for name in names:
        dotted = f"{section}.{name}"
        if dotted in REFUSED:
            raise ConfigError(f"{where}: {dotted}: {REFUSED[dotted]}")
        if name not in keys:
            raise unknown_key(where, dotted, list(keys))


def check_section(section: str, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A section as a file gives it (a profile's `supervisor:`), each value coerced to its
    key's type and checked."""
    check_names(section, data, where)
    keys = SECTIONS[section]
    return {name: convert(value, keys[name], where, f"{section}.{name}",
                          strict=section in STRICT_SECTIONS)
            for name, value in data.items()}


def unknown_key(where: str, name: str, known: Iterable[str]) -> ConfigError:
    """`name` is no key here: the closest known one, else the list."""
    known = list(known)
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], known, n=1)
    hint = f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(sorted(known))}."
    return ConfigError(f"{where}: {name}: unknown key.", hint=hint)
