"""Client API keys as configured: the key file's lines, each key's name, scopes, class and
budget, and the one key table.

A key file line is the key, then either its scopes (`KEY inference,metrics`, the older form) or
fields (`KEY name=contracts-app scopes=inference class=batch tokens_per_day=2000000`; scopes
separated by `,` or `+`, the latter for MTPWRAP_API_KEYS, whose keys a comma separates). The name
— never the key — is what logs, metrics and the audit trail show; a key without a name gets
`key-` and the first 8 hex digits of its SHA-256. Messages about a bad line never repeat the key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError

#: What a key may do: `inference` the model APIs, `admin` what changes the server or shows
#: other users' data (slots, POST /props, LoRA adapters), `metrics` /metrics, /healthz and
#: /status. A key listed without scopes has all of them.
SCOPES = ("inference", "admin", "metrics")
#: The admission queue's classes, served in this order (batch work ages into its turn).
CLASSES = ("interactive", "batch")
#: The budget fields of a key line: requests per minute, tokens per hour and per day (prompt
#: and completion tokens together).
BUDGETS = ("rpm", "tokens_per_hour", "tokens_per_day")
FIELDS = ("name", "scopes", "class", *BUDGETS)
#: the shortest key the front takes: a shorter one is a typo or a guessable word
MIN_KEY_CHARS = 8
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Budget:
    """A key's limits; 0 is none."""

    rpm: int = 0
    tokens_per_hour: int = 0
    tokens_per_day: int = 0

    def limits(self) -> dict[str, int]:
        """The limits set, by field name (BUDGETS)."""
        every = {"rpm": self.rpm, "tokens_per_hour": self.tokens_per_hour,
                 "tokens_per_day": self.tokens_per_day}
        return {k: v for k, v in every.items() if v}


@dataclass(frozen=True)
class ApiKey:
    secret: bytes = field(repr=False)
    name: str
    scopes: frozenset[str]
    klass: str = "interactive"
    budget: Budget = Budget()


KeyTable = tuple[ApiKey, ...]


def default_name(secret: str) -> str:
    digest = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()
    return "key-" + digest[:8]


def _scopes(text: str, where: str) -> frozenset[str]:
    scopes = text.replace(",", " ").replace("+", " ").split()
    for x in scopes:
        if x not in SCOPES:
            raise ConfigError(f"{where}: unknown scope {x!r}; known scopes: "
                              f"{', '.join(SCOPES)} (a key without scopes has them all)")
    return frozenset(scopes) or frozenset(SCOPES)


def parse_key(entry: str, where: str) -> ApiKey:
    """One key as written in a key file (see the module docstring)."""
    secret, *rest = entry.split() or [""]
    fields_: dict[str, str] = {}
    bare: list[str] = []
    for word in rest:
        name, eq, value = word.partition("=")
        if not eq:
            bare.append(word)
            continue
        if name not in FIELDS:
            raise ConfigError(f"{where}: unknown field {name!r}; a key line is `KEY "
                              f"name=N scopes=S,S class=C`; fields: {', '.join(FIELDS)}")
        if name in fields_:
            raise ConfigError(f"{where}: the field {name!r} is given twice")
        fields_[name] = value
    if bare and "scopes" in fields_:
        raise ConfigError(f"{where}: scopes are given twice (bare and as scopes=); give "
                          "scopes=S,S only")
    scopes = _scopes(fields_.get("scopes", " ".join(bare)), where)
    name = fields_.get("name", default_name(secret))
    if not _NAME.match(name):
        raise ConfigError(f"{where}: name={name!r} is not a usable name; use up to 64 letters, "
                          "digits, '.', '_' or '-', starting with a letter or digit")
    klass = fields_.get("class", CLASSES[0])
    if klass not in CLASSES:
        raise ConfigError(f"{where}: class={klass!r}: expected one of {', '.join(CLASSES)}")
    limits: dict[str, int] = {}
    for b in BUDGETS:
        if b in fields_:
            text = fields_[b]
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"{where}: {b}={text!r}: expected a whole number >= 1 "
                                  "(leave the field out for no limit)")
            limits[b] = int(text)
    return ApiKey(secret.encode("utf-8", "surrogateescape"), name, scopes, klass,
                  Budget(**limits))


def key_table(entries: tuple[str, ...], where: str) -> KeyTable:
    """Key entries → the table `access.find_key` reads; the same key twice with different
    fields, or one name for two keys, is refused."""
    by_secret: dict[bytes, ApiKey] = {}
    by_name: dict[str, bytes] = {}
    for entry in entries:
        k = parse_key(entry, where)
        if by_secret.get(k.secret, k) != k:
            raise ConfigError(f"{where}: one key is listed twice with different fields; "
                              "list each key once")
        if by_name.setdefault(k.name, k.secret) != k.secret:
            raise ConfigError(f"{where}: two keys are named {k.name!r}; give each key its own "
                              "name")
        by_secret[k.secret] = k
    return tuple(by_secret.values())


def checked_table(entries: tuple[str, ...], where: str) -> KeyTable:
    """`key_table`, with every key at least MIN_KEY_CHARS long: the table the front may
    serve."""
    table = key_table(entries, where)
    if any(len(k.secret) < MIN_KEY_CHARS for k in table):
        raise ConfigError(f"{where}: each key must be at least {MIN_KEY_CHARS} characters "
                          "without spaces")
    return table


def configured_keys(env: Mapping[str, str], keys_file: str | None, where: str
                    ) -> tuple[str, ...]:
    """The key entries `up` serves, each once: `MTPWRAP_API_KEYS` (comma separated), then the
    lines of `keys_file` (`where`: what its errors name as the file's origin)."""
    keys = [k.strip() for k in env.get("MTPWRAP_API_KEYS", "").split(",") if k.strip()]
    if keys_file:
        keys += read_keys_file(keys_file, where)
    return tuple(dict.fromkeys(keys))


def table_change(old: KeyTable, new: KeyTable) -> str | None:
    """What changed from one key table to the next, by key name (never a key): the counts, the
    keys removed and added, and the fields changed of the keys kept; None when nothing did."""
    before = {k.secret: k for k in old}
    after = {k.secret: k for k in new}
    removed = sorted(k.name for s, k in before.items() if s not in after)
    added = sorted(k.name for s, k in after.items() if s not in before)
    changed = []
    for s, k in sorted(after.items(), key=lambda item: item[1].name):
        was = before.get(s)
        if was is not None and was != k:
            what = [f for f, a, b in (("name", was.name, k.name),
                                      ("scopes", was.scopes, k.scopes),
                                      ("class", was.klass, k.klass),
                                      ("budget", was.budget, k.budget)) if a != b]
            changed.append(f"{k.name} ({', '.join(what)})")
    if not (removed or added or changed):
        return None
    parts = [f"removed {', '.join(removed)}"] if removed else []
    parts += [f"added {', '.join(added)}"] if added else []
    parts += [f"changed {', '.join(changed)}"] if changed else []
    return f"{len(old)} key(s) -> {len(new)}: {'; '.join(parts)}"


def read_keys_file(path: Any, where: str) -> tuple[str, ...]:
    """API keys from a file: one per line (see `parse_key`); blank lines and lines starting
    with # are skipped. Errors name the file and the line."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: must be a file path")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {path}: {err.strerror or err}; create it with "
                          "one key per line, readable only by the service user") from err
    keys = []
    names: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.strip().startswith("#"):
            k = parse_key(line, f"{where}: {path} line {n}")
            first = names.setdefault(k.name, n)
            if first != n:
                raise ConfigError(f"{where}: {path} line {n}: the name {k.name!r} is already "
                                  f"used on line {first}; give each key its own name")
            keys.append(" ".join(line.split()))
    if not keys:
        raise ConfigError(f"{where}: {path} holds no key; put one key per line")
    return tuple(keys)
