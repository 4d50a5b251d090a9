"""Client API keys as configured: the key file's lines, their scopes, the one key table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError

#: What a key may do: `inference` the model APIs, `admin` what changes the server or shows
#: other users' data (slots, POST /props, LoRA adapters), `metrics` /metrics and /healthz.
#: A key listed without scopes has all of them.
SCOPES = ("inference", "admin", "metrics")

KeyTable = tuple[tuple[bytes, frozenset[str]], ...]


def parse_key(entry: str, where: str) -> tuple[str, frozenset[str]]:
    """One key as written in a key file: `KEY` or `KEY SCOPE[,SCOPE...]`. The message of a
    bad entry never repeats the key."""
    secret, *rest = entry.split(None, 1) or [""]
    if not rest:
        return secret, frozenset(SCOPES)
    scopes = rest[0].replace(",", " ").split()
    for x in scopes:
        if x not in SCOPES:
            raise ConfigError(f"{where}: unknown scope {x!r}; known scopes: "
                              f"{', '.join(SCOPES)} (a key without scopes has them all)")
    return secret, frozenset(scopes)


def key_table(entries: tuple[str, ...], where: str) -> KeyTable:
    """Key entries → (key bytes, scopes) for `key_scopes`; the same key twice is refused."""
    table: dict[str, frozenset[str]] = {}
    for entry in entries:
        secret, scopes = parse_key(entry, where)
        if table.get(secret, scopes) != scopes:
            raise ConfigError(f"{where}: one key is listed twice with different scopes; "
                              "list each key once")
        table[secret] = scopes
    return tuple((k.encode("utf-8", "surrogateescape"), v) for k, v in table.items())


def read_keys_file(path: Any, where: str) -> tuple[str, ...]:
    """API keys from a file: one per line, optionally followed by its scopes (`KEY
    inference,metrics`, see `parse_key`); blank lines and lines starting with # are skipped."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: must be a file path")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {path}: {err.strerror or err}; create it with "
                          "one key per line, readable only by the service user") from err
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.strip().startswith("#"):
            parse_key(line, f"{where}: {path} line {n}")
            keys.append(" ".join(line.split()))
    if not keys:
        raise ConfigError(f"{where}: {path} holds no key; put one key per line")
    return tuple(keys)
