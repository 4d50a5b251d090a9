"""The configuration table: each key set through `up`'s flag, its variable and the config file
lands in the built objects, with flag > environment > file > default; the objects' defaults
are the table's; the generated reference is current."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtpwrap.cli import cli
from mtpwrap.commands.up import command as up_command
from mtpwrap.config import reference
from mtpwrap.config.objects import (
    AuditConfig,
    PersistConfig,
    ProxyConfig,
    SupervisorConfig,
    supervisor_config,
)
from mtpwrap.config.options import given
from mtpwrap.config.settings import Settings, load_settings
from mtpwrap.config.table import (
    AUDIT,
    FEATURES,
    PERSIST,
    PROXY,
    SECTIONS,
    SUPERVISOR,
    TOP,
    Key,
    env_name,
    every_key,
    flag_name,
)
from mtpwrap.errors import EXIT_CONFIG, ConfigError

KEYS = dict(every_key())


def candidates(dotted: str, k: Key, tmp_path: Path) -> list[Any]:
    """Three values for a key: the first differs from the default, each from the one before
    (a file's, a variable's, a flag's)."""
    if dotted == "api_key_file":
        files = []
        for n in range(3):
            f = tmp_path / f"keys{n}"
            f.write_text(f"client-key-{n}-0123456789\n")
            files.append(str(f))
        return files
    if dotted == "proxy.enable_paths":
        return [(FEATURES[0],), (FEATURES[3], FEATURES[4]), (FEATURES[5],)]
    if dotted == "proxy.cors_origins":
        return [("https://a.example",), ("https://b.example", "https://c.example"),
                ("https://d.example",)]
    if k.choices:
        others = [c for c in k.choices if c != k.default]
        return [others[0], k.default, others[-1]]
    if k.kind == "bool":
        return [not k.default, k.default, not k.default]
    if k.kind == "tristate":
        return [True, False, "auto"]
    if k.kind == "int":
        return [k.default + 1, k.default + 2, k.default + 3]
    if k.kind == "float":
        return [k.default + 0.5, k.default + 1.5, k.default + 2.5]
    if k.kind == "list":
        return [("a.example",), ("b.example", "c.example"), ("d.example",)]
    return [f"{dotted}-file", f"{dotted}-env", f"{dotted}-flag"]


def text(value: Any) -> str:
    """A value as a variable or a flag gives it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def config_file(tmp_path: Path, dotted: str, value: Any) -> Path:
    section, _, name = dotted.rpartition(".")
    plain = list(value) if isinstance(value, tuple) else value
    data = {section: {name: plain}} if section else {name: plain}
    p = tmp_path / "mtpwrap.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def flags(dotted: str, value: Any) -> dict[str, Any]:
    """What `up`'s command line gives the loader for `--flag VALUE` (parsed by click)."""
    # under the group's own context settings, as `mtpwrap up` parses it
    parent = cli.make_context("mtpwrap", ["up"], resilient_parsing=True)
    ctx = up_command.make_context("up", [flag_name(dotted), text(value)], parent=parent)
    return given(ctx.params)


def built(s: Settings, dotted: str) -> Any:
    """The key's value in the object the program runs on."""
    section, _, name = dotted.rpartition(".")
    if not section:
        return getattr(s, name)
    if section == "supervisor":
        if name == "exit_on_failed":  # the service's decision, not the supervisor's
            return s.supervisor[name]
        cfg = supervisor_config(s.supervisor, near_edge=False)
        if name == "oom_step_down" and s.supervisor[name] == "auto":
            return "auto" if cfg.oom_step_down is False else "?"
        return getattr(cfg, name)
    if section == "persist":
        return getattr(PersistConfig(**s.persist), name)
    if section == "audit":
        return getattr(AuditConfig(**s.audit), name)
    return getattr(ProxyConfig.from_mapping(s.proxy, s.proxy_source), name)


@pytest.mark.parametrize("dotted", list(KEYS))
def test_each_key_through_flag_variable_and_file(dotted: str, tmp_path: Path) -> None:
    k = KEYS[dotted]
    in_file, in_env, on_flag = candidates(dotted, k, tmp_path)
    cfg = config_file(tmp_path, dotted, in_file)
    env = {env_name(dotted): text(in_env)}

    s = load_settings({}, env={}, config=None)
    assert built(s, dotted) == k.default and s.sources[dotted] == "default"
    s = load_settings({}, env={}, config=cfg)
    assert built(s, dotted) == in_file and s.sources[dotted] == str(cfg)
    s = load_settings({}, env=env, config=cfg)
    assert built(s, dotted) == in_env and s.sources[dotted] == env_name(dotted)
    s = load_settings(flags(dotted, on_flag), env=env, config=cfg)
    assert built(s, dotted) == on_flag and s.sources[dotted] == flag_name(dotted)
    if dotted == "api_key_file":  # the keys of the file that won, and only those
        assert s.api_keys == ("client-key-2-0123456789",)


@pytest.mark.parametrize("dotted", [d for d, k in KEYS.items()
                                    if k.kind not in ("str", "list") or k.choices])
def test_a_bad_value_names_where_it_came_from(dotted: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{env_name(dotted)}: {dotted}: expected "):
        load_settings({}, env={env_name(dotted): "[not a value"})
    with pytest.raises(ConfigError, match=rf"^{flag_name(dotted)}: {dotted}: expected ") as err:
        load_settings(flags(dotted, "[not a value"), env={})
    assert err.value.exit_code == EXIT_CONFIG


@pytest.mark.parametrize("cls, table", [(SupervisorConfig, SUPERVISOR),
                                        (PersistConfig, PERSIST), (ProxyConfig, PROXY),
                                        (AuditConfig, AUDIT)])
def test_objects_take_the_tables_names_and_defaults(cls: type, table: dict[str, Key]) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, k in table.items():
        if k.kind == "tristate":  # decided by `up` before the object is built
            continue
        assert name in fields, f"{cls.__name__} has no field for {name}"
        assert fields[name].default == k.default, name


def test_a_profiles_sections_come_below_flag_variable_and_file(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, "supervisor.wedge_s", 5.0)
    s = load_settings(flags("proxy.max_n_probs", 3), env={"MTPWRAP_PROXY_QUEUE_SIZE": "11"},
                      config=cfg)
    profile_sup = {"wedge_s": 9.0, "backoff_max_s": 4.0}
    sup = supervisor_config(s.layered("supervisor", profile_sup), near_edge=False)
    assert (sup.wedge_s, sup.backoff_max_s, sup.max_failures) == (5.0, 4.0, 5)
    profile_proxy = {"queue_size": 2, "max_n_probs": 7, "max_choices": 2}
    proxy = ProxyConfig.from_mapping(s.layered("proxy", profile_proxy), "t")
    assert (proxy.queue_size, proxy.max_n_probs, proxy.max_choices) == (11, 3, 2)


def test_settings_hold_every_top_level_key() -> None:
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert set(TOP) <= fields and set(SECTIONS) <= fields


def test_reference_and_example_config_are_current() -> None:
    for target, text in reference.generated().items():
        assert target.read_text(encoding="utf-8") == text, (
            f"{target.name} is not current: run `python -m mtpwrap.config.reference`")


def test_example_config_sets_what_it_shows(tmp_path: Path) -> None:
    """The shipped example loads and gives the table's defaults (its key file aside)."""
    keys = tmp_path / "keys"
    keys.write_text("example-key-0123456789\n")
    text = reference.EXAMPLE.read_text().replace("/etc/mtpwrap/api-keys", str(keys))
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text(text)
    s = load_settings({}, env={}, config=cfg)
    for dotted, k in KEYS.items():
        if dotted != "api_key_file":
            assert built(s, dotted) == k.default, dotted


def _options_by_variable() -> dict[str, set[tuple[str, bool, bool]]]:
    """Every MTPWRAP_* variable a command's option or argument reads -> the (type, is a flag,
    repeatable) each reading gives it."""
    import json

    import click

    seen: dict[str, set[tuple[str, bool, bool]]] = {}

    def walk(cmd: click.Command, ctx: click.Context | None) -> None:
        ctx = click.Context(cmd, parent=ctx, info_name=cmd.name)
        for p in cmd.params:
            names = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or ())
            for name in names:
                kind = json.dumps(p.type.to_info_dict(), sort_keys=True, default=str)
                seen.setdefault(name, set()).add(
                    (kind, bool(getattr(p, "is_flag", False)), p.multiple))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                walk(sub, ctx)

    walk(cli, None)
    return seen


def test_a_variable_means_one_thing_to_every_command() -> None:
    """`MTPWRAP_JSON`, `MTPWRAP_BENCH_THREADS`, ... are read by several commands: each reads it
    with the same type, so a value one command takes no other refuses."""
    seen = _options_by_variable()
    assert len(seen) > 80 and "MTPWRAP_JSON" in seen and "MTPWRAP_BENCH_THREADS" in seen
    differ = {name: kinds for name, kinds in seen.items() if len(kinds) > 1}
    assert not differ


def test_each_variable_is_declared_in_one_place() -> None:
    """A variable is named once in the source: by the settings' table (derived from the key),
    by `SHARED` (options several commands take), or by one option or `os.environ` read."""
    import re
    from collections import Counter

    import mtpwrap
    from mtpwrap.config.options import SHARED
    from mtpwrap.config.table import env_name, every_key

    named: Counter[str] = Counter()
    for f in Path(mtpwrap.__file__).parent.rglob("*.py"):
        for m in re.finditer(r'(?:envvar=|environ\.get\(|getenv\()\s*"(MTPWRAP_\w+)"',
                             f.read_text()):
            named[m.group(1)] += 1
    assert named["MTPWRAP_BENCH_KV_SPEED"] == 1 and named["MTPWRAP_HOME"] == 1
    assert {v for v, n in named.items() if n > 1} == set()
    settings = {env_name(dotted) for dotted, _ in every_key()}
    assert set(named) & settings == set()
    assert set(named) & set(SHARED) == set()
    assert set(SHARED) <= set(_options_by_variable())
