"""Settings for `mtpwrap up`: CLI flag > `MTPWRAP_*` environment > YAML config file > default.

The config file is `--config FILE` (must exist) or `/etc/mtpwrap/mtpwrap.yaml` when present.
Every key is declared once in mtpwrap.config.table, with its environment twin (`port` is
`MTPWRAP_PORT`, `supervisor.backoff_max_s` is `MTPWRAP_SUPERVISOR_BACKOFF_MAX_S`) and its flag.
`MTPWRAP_API_KEYS` (comma separated) and `api_key_file` feed the front's keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.config.apikeys import configured_keys
from mtpwrap.config.coerce import check_names, convert, unknown_key
from mtpwrap.config.table import (
    AUDIT,
    DEFAULT_CONFIG_FILE,
    PERSIST,
    SECTIONS,
    TOP,
    Key,
    env_name,
    flag_name,
    strict,
)
from mtpwrap.config.yamlfile import read_yaml
from mtpwrap.errors import ConfigError

DEFAULT_CONFIG = Path(DEFAULT_CONFIG_FILE)


@dataclass(frozen=True)
class Settings:
    profile: str
    model: str | None
    host: str
    #: a front on an address other than loopback may go without API keys (`up` refuses it
    #: otherwise)
    allow_open_listen: bool
    port: int
    binary: str | None
    hw_replay: str | None
    plan: str
    api_key_file: str | None
    drain_s: float
    drain_grace_s: float
    ready_timeout_s: float
    log_level: str
    supervisor: dict[str, Any]
    #: the `proxy.*` keys a flag, variable or the config file set (a profile's proxy section
    #: fills in the rest, then the defaults)
    proxy: dict[str, Any]
    api_keys: tuple[str, ...]
    config_file: Path | None
    sources: dict[str, str] = field(default_factory=dict)  # key -> where its value came from
    persist: dict[str, Any] = field(
        default_factory=lambda: {k: key.default for k, key in PERSIST.items()})
    audit: dict[str, Any] = field(
        default_factory=lambda: {k: key.default for k, key in AUDIT.items()})

    @property
    def keys_where(self) -> str:
        """What an error about the key file names as the file's origin."""
        return keys_origin(self.sources.get("api_key_file", "api_key_file"), self.config_file)

    @property
    def proxy_source(self) -> str:
        return str(self.config_file) if self.config_file else "settings"

    def layered(self, section: str, profile: Mapping[str, Any]) -> dict[str, Any]:
        """A section's values that a flag, variable or the config file set, over a profile's
        own section (checked with the table when the profile was read); the defaults are
        left to the object built from it."""
        values: dict[str, Any] = getattr(self, section)
        own = {k: v for k, v in values.items() if self.sources[f"{section}.{k}"] != "default"}
        return {**profile, **own}

    def value(self, dotted: str) -> Any:
        """A setting's value by its dotted key (`port`, `supervisor.wedge_s`)."""
        section, _, name = dotted.rpartition(".")
        if not section:
            return getattr(self, name)
        values: dict[str, Any] = getattr(self, section)
        return values[name]


def keys_origin(source: str, config_file: Path | None) -> str:
    """`api_key_file`'s origin as its errors name it: the flag or the variable that gave it,
    or the config file's `api_key_file`."""
    return f"{source}: api_key_file" if source == str(config_file) else source


def read_config(path: Path) -> dict[str, Any]:
    data = read_yaml(path, f"--config {path}" if not path.exists() else str(path),
                     what="config file",
                     missing_hint="Give an existing YAML file or leave --config out.")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top, got "
                          f"{type(data).__name__}.")
    return data


def _check_file(file_data: Mapping[str, Any], where: str) -> None:
    known_top = [*TOP, *SECTIONS]
    for name, value in file_data.items():
        if name not in known_top:
            raise unknown_key(where, str(name), known_top)
        if name in SECTIONS and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: {name}: expected a mapping, got "
                              f"{type(value).__name__}.")
    for section in SECTIONS:
        check_names(section, file_data.get(section) or {}, where)


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str] | None = None,
                  config: str | Path | None = None) -> Settings:
    """`cli` holds the flags a person actually gave, by dotted key (None values are
    ignored)."""
    env = os.environ if env is None else env
    config_path: Path | None = None
    if config:
        config_path = Path(config).expanduser()
    elif DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
    file_data = read_config(config_path) if config_path else {}
    where_file = str(config_path) if config_path else "config"
    _check_file(file_data, where_file)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def resolve(dotted: str, key: Key, section: Mapping[str, Any], name: str, strict: bool
                ) -> None:
        variable = env_name(dotted)
        if cli.get(dotted) is not None:
            values[dotted] = convert(cli[dotted], key, flag_name(dotted), dotted)
            sources[dotted] = flag_name(dotted)
        elif env.get(variable) not in (None, ""):
            values[dotted] = convert(env[variable], key, variable, dotted)
            sources[dotted] = variable
        elif section.get(name) is not None:
            values[dotted] = convert(section[name], key, where_file, dotted, strict=strict)
            sources[dotted] = where_file
        else:
            values[dotted] = key.default
            sources[dotted] = "default"

    for name, key in TOP.items():
        resolve(name, key, file_data, name, False)
    sections: dict[str, dict[str, Any]] = {}
    for prefix, keys in SECTIONS.items():
        from_file = file_data.get(prefix) or {}
        out: dict[str, Any] = {}
        for name, key in keys.items():
            resolve(f"{prefix}.{name}", key, from_file, name, strict(f"{prefix}.{name}"))
            out[name] = values.pop(f"{prefix}.{name}")
        sections[prefix] = out
    proxy = {k: v for k, v in sections["proxy"].items()
             if sources[f"proxy.{k}"] != "default"}

    keys_file = values["api_key_file"]
    api_keys = configured_keys(env, str(keys_file) if keys_file else None,
                               keys_origin(sources["api_key_file"], config_path))

    return Settings(
        profile=values["profile"], model=values["model"], host=values["host"],
        allow_open_listen=values["allow_open_listen"], port=values["port"],
        binary=values["binary"], hw_replay=values["hw_replay"],
        plan=values["plan"], api_key_file=keys_file,
        drain_s=values["drain_s"], drain_grace_s=values["drain_grace_s"],
        ready_timeout_s=values["ready_timeout_s"],
        log_level=values["log_level"], supervisor=sections["supervisor"], proxy=proxy,
        api_keys=api_keys, config_file=config_path, sources=sources,
        persist=sections["persist"], audit=sections["audit"],
    )
