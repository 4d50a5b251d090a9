"""Click options generated from the table, so a flag's help, variable and default cannot drift
from the setting they stand for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from mtpwrap.config.coerce import convert
from mtpwrap.config.table import DEFAULT_CONFIG_FILE, Key, env_name, every_key, flag_name, key
from mtpwrap.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

def param_name(dotted: str) -> str:
    """`supervisor.backoff_max_s` -> supervisor_backoff_max_s (the click parameter)."""
    return dotted.replace(".", "_")


def shown(k: Key) -> str:
    """A key's default as a person writes it."""
    value = k.default
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ", ".join(value) if value else "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)


def describe(dotted: str, k: Key) -> str:
    """The help of `up`'s flag: the key's help, then its variable, unit and default."""
    tail = [f"env: {env_name(dotted)}"]
    if k.unit:
        tail.append(f"unit: {k.unit}")
    if k.default is not None:
        tail.append(f"default: {shown(k)}")
    return f"{k.help} [{'; '.join(tail)}]"


def up_options(f: F) -> F:
    """One flag per setting, for `up`. The flags carry no default and no variable: the loader
    layers flag > environment > config file > default and records where each value came
    from."""
    for dotted, k in reversed(list(every_key())):
        # text: the one coercer reads it, so a bad value is a configuration error (78)
        f = click.option(flag_name(dotted), param_name(dotted), type=str, default=None,
                         help=describe(dotted, k), metavar=_metavar(k))(f)
    return f


class SettingsCommand(click.Command):
    """A command whose help lists the settings' flags by section (`supervisor:`, ...), after
    its other options."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        section_of = {param_name(d): d.rpartition(".")[0] for d, _ in every_key()}
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):
                groups.setdefault(section_of.get(param.name or "", ""), []).append(record)
        for section, records in groups.items():
            title = f"{section.capitalize()} settings" if section else "Options"
            with formatter.section(title):
                formatter.write_dl(records)


def _metavar(k: Key) -> str:
    if k.metavar:
        return k.metavar
    if k.choices:
        return "[" + "|".join(k.choices) + "]"
    return {"int": "INTEGER", "float": "NUMBER", "bool": "true|false",
            "tristate": "true|false|auto", "list": "A,B,...", "str": "TEXT"}[k.kind]


def given(params: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a person gave on `up`'s command line, by dotted key."""
    by_param = {param_name(dotted): dotted for dotted, _ in every_key()}
    return {by_param[p]: v for p, v in params.items() if p in by_param and v is not None}


#: the variable that names the config file, for every command that takes --config
CONFIG_ENV = "MTPWRAP_CONFIG"


def config_option(f: F | None = None, *, default: str | None = None,
                  help: str | None = None) -> Any:
    """`--config FILE`: the YAML file the settings are read from (`up`), or another
    command's file of the same name and variable (`service install`: the file the unit
    passes to `up`, with its own default and help)."""
    text = help or (f"YAML config file. [env: {CONFIG_ENV}; default: {DEFAULT_CONFIG_FILE} "
                    "when present]")
    option = click.option("--config", "config", envvar=CONFIG_ENV, default=default,
                          show_default=default is not None,
                          type=click.Path(dir_okay=False, path_type=Path), help=text)
    return option if f is None else option(f)


class SettingType(click.ParamType):
    """A setting's value on another command's command line or in its variable, read by the one
    coercer, so every command takes what `up` takes."""

    def __init__(self, dotted: str) -> None:
        self.dotted = dotted
        self.key = key(dotted)
        self.name = _metavar(self.key)

    def to_info_dict(self) -> Any:
        return {**super().to_info_dict(), "setting": self.dotted}

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # the table's default, already typed
        try:
            return convert(value, self.key, env_name(self.dotted), self.dotted)
        except ConfigError:  # click names the flag and its variable
            self.fail(f"expected {self.key.expected()}, got {value!r}.", param, ctx)


def setting_option(dotted: str, *names: str, help: str | None = None,
                   default: Any = ...) -> Callable[[F], F]:
    """A setting as an option of another command: its flag (or `names`), variable, type and
    default from the table; `help` may say what it means for this command."""
    k = key(dotted)
    decls = names or (flag_name(dotted),)
    if not any(d.startswith("-") for d in decls):
        decls = (flag_name(dotted), *decls)
    value = k.default if default is ... else default
    return click.option(*decls, envvar=env_name(dotted), show_envvar=True, default=value,
                        type=SettingType(dotted), show_default=value is not None,
                        help=help or k.help)


#: options several commands take, by the variable they read: the flag, its parameter and its
#: type are decided here once; a command may word the help and give the default for itself.
SHARED: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "MTPWRAP_JSON": (("--json", "as_json"), {"is_flag": True, "help": "Print JSON."}),
    "MTPWRAP_API_KEY": (("--api-key",), {"default": None, "help": "Key for --url."}),
    "MTPWRAP_BENCH_URL": (("--url",), {"default": None}),
    "MTPWRAP_BENCH_OUT": (("--out", "out_dir"),
                          {"type": click.Path(file_okay=False, path_type=Path),
                           "default": None}),
    "MTPWRAP_BENCH_THREADS": (("--threads",), {"type": click.IntRange(1, 1024), "default": None,
                                               "help": "llama-server threads (default: "
                                                       "llama.cpp's own)."}),
    "MTPWRAP_RELOAD_TIMEOUT": (("--timeout",), {"type": float, "default": 900.0,
                                                "help": "Seconds to wait for the outcome."}),
    "MTPWRAP_UNIT_DIR": (("--unit-dir",), {"type": click.Path(path_type=Path),
                                           "default": "/etc/systemd/system",
                                           "help": "Where the unit file is."}),
    "MTPWRAP_FLEET_METRICS_BIND": (("--metrics-bind",),
                                   {"default": "127.0.0.1:8404",
                                    "help": "HAProxy's Prometheus exporter (/metrics); 'none' "
                                            "for none."}),
}


def shared_option(variable: str, *decls: str, **kwargs: Any) -> Callable[[F], F]:
    """The option of `SHARED` that reads `variable`; `decls` may name the flag for this command
    (`fleet prometheus --haproxy-metrics`), `kwargs` give its help and default."""
    names, base = SHARED[variable]
    options = {**base, **kwargs}
    options.setdefault("show_default", options.get("default") is not None
                       and not options.get("is_flag"))
    return click.option(*(decls or names), envvar=variable, show_envvar=True, **options)
