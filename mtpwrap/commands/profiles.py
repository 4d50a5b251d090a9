"""`mtpwrap profiles list|show`: the shipped and user profiles."""

from __future__ import annotations

import click

from mtpwrap import console
from mtpwrap.config.options import SettingType, shared_option
from mtpwrap.config.table import env_name
from mtpwrap.decide import profiles


@click.group("profiles")
def command() -> None:
    """List and show profiles (user ones in ~/.config/mtpwrap/profiles override shipped ones)."""


@command.command("list")
@shared_option("MTPWRAP_JSON")
def list_cmd(as_json: bool) -> None:
    """Name, hardware, context, KV types, speculation and description of every profile."""
    rows = [p.summary() for p in profiles.list_profiles()]
    if as_json:
        console.print_json(rows)
        return
    console.table(None, ["name", "hardware", "context", "KV", "speculation", "description"],
                  [[r["name"], r["hardware"], r["context"], r["kv"], r["speculation"],
                    r["description"]] for r in rows])


@command.command("show")
@click.argument("name", envvar=env_name("profile"), type=SettingType("profile"))
@shared_option("MTPWRAP_JSON")
def show_cmd(name: str, as_json: bool) -> None:
    """Every setting of one profile (by name or path), and the file it came from."""
    p = profiles.load_profile(name)
    data = p.to_dict()
    if as_json:
        console.print_json(data)
        return
    import yaml

    console.out.print(f"# {p.source}")
    shown = {k: v for k, v in data.items() if k != "source" and v not in (None, {}, [])}
    text = yaml.safe_dump(shown, sort_keys=False, width=1000, default_flow_style=None)
    console.out.print(text.rstrip(), markup=False)
