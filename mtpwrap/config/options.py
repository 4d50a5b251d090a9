"""Click options generated from the table, so a flag's help, variable and default cannot drift
from the setting they stand for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from mtpwrap.config.table import DEFAULT_CONFIG_FILE, Key, env_name, every_key, flag_name, key

F = TypeVar("F", bound=Callable[..., Any])

_TYPES: dict[str, Any] = {"int": int, "float": float}


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
                          type=click.Path(path_type=Path) if default is None else str,
                          help=text)
    return option if f is None else option(f)


def setting_option(dotted: str, *names: str, help: str | None = None,
                   default: Any = ..., **kwargs: Any) -> Callable[[F], F]:
    """A setting as an option of another command: its flag (or `names`), variable, type and
    default from the table; `help` may say what it means for this command."""
    k = key(dotted)
    decls = names or (flag_name(dotted),)
    if not any(d.startswith("-") for d in decls):
        decls = (flag_name(dotted), *decls)
    kwargs.setdefault("type", click.Choice(k.choices) if k.choices else _TYPES.get(k.kind, str))
    value = k.default if default is ... else default
    return click.option(*decls, envvar=env_name(dotted), show_envvar=True, default=value,
                        show_default=value is not None, help=help or k.help, **kwargs)
