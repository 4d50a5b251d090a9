"""Settings for `mtpwrap up`: CLI flag > `MTPWRAP_*` environment > YAML config file > default.

The config file is `--config FILE` (must exist) or `/etc/mtpwrap/mtpwrap.yaml` when present.
Every key has an environment twin: `port` is `MTPWRAP_PORT`, `supervisor.backoff_max_s` is
`MTPWRAP_SUPERVISOR_BACKOFF_MAX_S`. The `proxy:` section belongs to the HTTP front and is
checked by it; `MTPWRAP_API_KEYS` (comma separated) and `--api-key-file` feed its keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError

DEFAULT_CONFIG = Path("/etc/mtpwrap/mtpwrap.yaml")


@dataclass(frozen=True)
class Key:
    kind: str  # "str" | "int" | "float" | "bool" | "tristate" (bool or "auto") | "list"
    default: Any
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # how to describe a valid value in an error


def _port(v: int) -> bool:
    return 1 <= v <= 65535


def _nonneg(v: float) -> bool:
    return v >= 0


def _pos(v: float) -> bool:
    return v > 0


TOP: dict[str, Key] = {
    "profile": Key("str", "auto"),
    "model": Key("str", None),
    "host": Key("str", "127.0.0.1"),
    "port": Key("int", 8080, _port, "an integer 1..65535"),
    "binary": Key("str", None),
    # a recorded hardware snapshot (`mtpwrap hw --record`) instead of this machine's NVML
    "hw_replay": Key("str", None),
    # the memory plan that gates a GPU launch: auto (refuse what does not fit or cannot be
    # planned), skip (launch unchecked; `up --no-plan`)
    "plan": Key("str", "auto", lambda v: v in ("auto", "skip"), "auto or skip"),
    "api_key_file": Key("str", None),
    "drain_s": Key("float", 30.0, _nonneg, "a number of seconds >= 0"),
    # before draining: /readyz says 503 while requests are still taken, so a load balancer's
    # checks move traffic away before any request is refused (0: drain at once)
    "drain_grace_s": Key("float", 0.0, _nonneg, "a number of seconds >= 0"),
    "ready_timeout_s": Key("float", 0.0, _nonneg, "a number of seconds >= 0 (0: no limit)"),
    "log_level": Key("str", "info", lambda v: v in ("debug", "info", "warning", "error"),
                     "one of debug, info, warning, error"),
}

SUPERVISOR: dict[str, Key] = {
    "load_stall_s": Key("float", 120.0, _pos, "a number of seconds > 0"),
    "probe_timeout_s": Key("float", 60.0, _pos, "a number of seconds > 0"),
    "monitor_interval_s": Key("float", 1.0, _pos, "a number of seconds > 0"),
    "backoff_initial_s": Key("float", 1.0, _pos, "a number of seconds > 0"),
    "backoff_max_s": Key("float", 30.0, _pos, "a number of seconds > 0"),
    "max_failures": Key("int", 5, _pos, "an integer >= 1"),
    "failure_window_s": Key("float", 300.0, _pos, "a number of seconds > 0"),
    "oom_max_retries": Key("int", 8, _pos, "an integer >= 1"),
    # step down to cheaper launches after out-of-memory starts: true, false, or auto (on when
    # the memory plan leaves the GPU near its edge)
    "oom_step_down": Key("tristate", "auto"),
    "stop_grace_s": Key("float", 10.0, _nonneg, "a number of seconds >= 0"),
    "wedge_s": Key("float", 60.0, _nonneg, "a number of seconds >= 0 (0: off)"),
    "rss_limit_mb": Key("int", 0, _nonneg, "an integer number of MiB >= 0 (0: off)"),
    "memory_interval_s": Key("float", 5.0, _pos, "a number of seconds > 0"),
    "recycle_drain_s": Key("float", 60.0, _nonneg, "a number of seconds >= 0"),
    # after a crash loop (max_failures in failure_window_s): exit 1 instead of staying failed;
    # auto: exit when started by systemd (NOTIFY_SOCKET set), so its Restart= and start limits
    # take over
    "exit_on_failed": Key("tristate", "auto"),
}

#: KV snapshots carried across restarts of llama-server (see mtpwrap.run.persist)
PERSIST: dict[str, Key] = {
    "enabled": Key("bool", True),
    "dir": Key("str", None),  # default: <MTPWRAP_HOME>/kv-snapshots
    "min_tokens": Key("int", 2048, _pos, "an integer number of tokens >= 1"),
    "max_mb": Key("int", 0, _nonneg, "an integer number of MiB >= 0 (0: a quarter of the "
                                     "free disk)"),
    "checkpoints": Key("bool", False),
    # a checkpoint is taken when llama-server has prefilled this many tokens since the last one
    # and has been idle for a few seconds
    "checkpoint_tokens": Key("int", 2048, _pos, "an integer number of tokens >= 1"),
}

# None: free-form, checked by its owner
SECTIONS = {"supervisor": SUPERVISOR, "persist": PERSIST, "proxy": None}


@dataclass(frozen=True)
class Settings:
    profile: str
    model: str | None
    host: str
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
    proxy: dict[str, Any]
    api_keys: tuple[str, ...]
    config_file: Path | None
    sources: dict[str, str] = field(default_factory=dict)  # key -> where its value came from
    persist: dict[str, Any] = field(
        default_factory=lambda: {k: key.default for k, key in PERSIST.items()})

    @property
    def proxy_source(self) -> str:
        return str(self.config_file) if self.config_file else "settings"


def convert(raw: Any, key: Key, where: str, name: str, *, strict: bool = False) -> Any:
    """Turn a YAML value or an environment string into the key's type, or say what is wrong.
    The one config coercer: settings, their `supervisor:` section, the profile's sections and
    the front's `proxy:` section. strict: a YAML value must already have the key's type (no
    "3" for 3); kind "list": a list of strings, or one comma-separated string."""
    value: Any = raw
    bad = False
    if strict and key.kind != "list" and isinstance(raw, str) != (key.kind == "str"):
        bad = True  # a YAML value of another type ("3" for 3, 5 for a host name)
    elif key.kind == "tristate":
        low = raw.strip().lower() if isinstance(raw, str) else raw
        if low == "auto":
            value = "auto"
        elif isinstance(low, bool):
            value = low
        elif low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            value = low in ("1", "true", "yes", "on")
        else:
            bad = True
    elif key.kind == "list":
        items = [v.strip() for v in raw.split(",") if v.strip()] if isinstance(raw, str) else raw
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
            value = tuple(items)
        else:
            bad = True
    elif key.kind == "bool":
        if isinstance(raw, str):
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                value = True
            elif low in ("0", "false", "no", "off", ""):
                value = False
            else:
                bad = True
        elif not isinstance(raw, bool):
            bad = True
    elif key.kind == "int":
        if isinstance(raw, bool):
            bad = True
        elif isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            try:
                value = int(raw.strip())
            except ValueError:
                bad = True
        else:
            bad = True
    elif key.kind == "float":
        if isinstance(raw, bool):
            bad = True
        elif isinstance(raw, (int, float)):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                bad = True
        else:
            bad = True
    elif key.kind == "str":
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            value = str(raw)
        else:
            bad = True
    expect = key.expect or {"bool": "true or false", "int": "an integer", "float": "a number",
                            "str": "a string", "list": "a list of strings",
                            "tristate": "true, false or auto"}[key.kind]
    if bad or (key.check is not None and not key.check(value)):
        raise ConfigError(f"{where}: {name}: expected {expect}, got {raw!r}.",
                          hint=f"Fix {name} in {where}.")
    return value


def _unknown(where: str, name: str, known: list[str]) -> ConfigError:
    import difflib

    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], known, n=1)
    hint = f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(sorted(known))}."
    return ConfigError(f"{where}: {name}: unknown key.", hint=hint)


def read_config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file.",
                          hint="Give an existing YAML file or leave --config out.") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}.") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)}).") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top, got "
                          f"{type(data).__name__}.")
    return data


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str] | None = None,
                  config: str | Path | None = None) -> Settings:
    """`cli` holds the flags a person actually gave (None values are ignored)."""
    env = os.environ if env is None else env
    config_path: Path | None = None
    if config:
        config_path = Path(config).expanduser()
        file_data = read_config(config_path)
    elif DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
        file_data = read_config(config_path)
    else:
        file_data = {}
    where_file = str(config_path) if config_path else "config"

    known_top = [*TOP, *SECTIONS]
    for name, value in file_data.items():
        if name not in known_top:
            raise _unknown(where_file, str(name), known_top)
        if name in SECTIONS and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where_file}: {name}: expected a mapping, got "
                              f"{type(value).__name__}.")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def resolve(dotted: str, key: Key, from_file: Any, present: bool) -> None:
        env_name = "MTPWRAP_" + dotted.replace(".", "_").upper()
        flag = dotted.replace("_", "-")
        if cli.get(dotted) is not None:
            values[dotted] = convert(cli[dotted], key, f"--{flag}", dotted)
            sources[dotted] = f"--{flag}"
        elif env.get(env_name) not in (None, ""):
            values[dotted] = convert(env[env_name], key, env_name, dotted)
            sources[dotted] = env_name
        elif present and from_file is not None:
            values[dotted] = convert(from_file, key, where_file, dotted)
            sources[dotted] = where_file
        else:
            values[dotted] = key.default
            sources[dotted] = "default"

    for name, key in TOP.items():
        resolve(name, key, file_data.get(name), name in file_data)

    def section(prefix: str, keys: dict[str, Key]) -> dict[str, Any]:
        from_file = file_data.get(prefix) or {}
        for name in from_file:
            if name not in keys:
                raise _unknown(where_file, f"{prefix}.{name}", list(keys))
        out: dict[str, Any] = {}
        for name, key in keys.items():
            resolve(f"{prefix}.{name}", key, from_file.get(name), name in from_file)
            out[name] = values.pop(f"{prefix}.{name}")
        return out

    supervisor = section("supervisor", SUPERVISOR)
    persist = section("persist", PERSIST)

    proxy = dict(file_data.get("proxy") or {})
    keys_file = values["api_key_file"] or proxy.pop("api_keys_file", None)
    api_keys: list[str] = []
    env_keys = env.get("MTPWRAP_API_KEYS", "")
    api_keys += [k.strip() for k in env_keys.split(",") if k.strip()]
    if keys_file:
        from mtpwrap.serve.access import read_keys_file

        where_keys = ("--api-key-file" if values["api_key_file"]
                      else f"{where_file}: proxy.api_keys_file")
        api_keys += read_keys_file(str(keys_file), where_keys)
    if proxy.get("api_keys"):
        raise ConfigError(f"{where_file}: proxy.api_keys: keys do not belong in the config file.",
                          hint="Put them in a file named by proxy.api_keys_file (mode 0600) "
                               "or in MTPWRAP_API_KEYS.")

    return Settings(
        profile=values["profile"], model=values["model"], host=values["host"],
        port=values["port"], binary=values["binary"], hw_replay=values["hw_replay"],
        plan=values["plan"],
        api_key_file=keys_file,
        drain_s=values["drain_s"], drain_grace_s=values["drain_grace_s"],
        ready_timeout_s=values["ready_timeout_s"],
        log_level=values["log_level"], supervisor=supervisor, proxy=proxy,
        api_keys=tuple(dict.fromkeys(api_keys)), config_file=config_path, sources=sources,
        persist=persist,
    )
