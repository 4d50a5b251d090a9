"""`mtpwrap args`: the llama-server command line a profile gives on this binary and machine."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import click

from mtpwrap import console
from mtpwrap.decide import capabilities, hardware, launch, profiles
from mtpwrap.errors import ConfigError, MissingToolError


def find_server(explicit: Path | None) -> tuple[Path, dict[str, Any] | None]:
    """The llama-server to use and, when it is the built one, its manifest's capabilities."""
    if explicit is not None:
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise ConfigError(f"--binary {explicit}: not an executable file.")
        return explicit, None
    from mtpwrap.build import builder

    manifest = builder.load_manifest()
    if manifest is None:
        raise MissingToolError("no built llama-server found.",
                               hint="Run `mtpwrap build`, or pass --binary PATH "
                                    "(or set MTPWRAP_LLAMA_SERVER).")
    return manifest.binary("llama-server"), manifest.capabilities


def resolve_model(name: str) -> tuple[str, str | None]:
    """(path or name, warning). A missing model is a warning here: `args` only shows."""
    from mtpwrap.decide import models

    if name in models.DEMO_ALIASES:
        # resolve_model would fetch the demo model; a preview must not download anything.
        demo = Path(os.environ.get("MTPWRAP_DEMO_MODEL") or models.demo_model_path())
        if demo.is_file():
            return str(demo), None
        return str(demo), f"the demo model is not fetched yet ({demo}); `mtpwrap models` gets it"
    try:
        return str(models.resolve_model(name, what="model")), None
    except ConfigError as exc:
        return name, f"{exc} (shown as given)"


@click.command("args")
@click.option("--profile", "profile_name", default="auto", show_default=True,
              envvar="MTPWRAP_PROFILE", help="Profile name or file, or `auto` for this machine.")
@click.option("--model", type=str, envvar="MTPWRAP_MODEL",
              help="Model path, overriding the profile's.")
@click.option("--binary", type=click.Path(path_type=Path), envvar="MTPWRAP_LLAMA_SERVER",
              help="llama-server to use (default: the one `mtpwrap build` made).")
@click.option("--replay", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="MTPWRAP_HW_REPLAY",
              help="Hardware recording to use instead of this machine (see `mtpwrap hw`).")
@click.option("--port", type=int, envvar="MTPWRAP_UPSTREAM_PORT",
              help="Internal port to show in the command line.")
@click.option("--json", "as_json", is_flag=True, envvar="MTPWRAP_JSON", help="Print JSON.")
def command(profile_name: str, model: str | None, binary: Path | None, replay: Path | None,
            port: int | None, as_json: bool) -> None:
    """Print the llama-server command line for a profile, and why each flag is there."""
    snap = hardware.load_snapshot(replay) if replay else hardware.snapshot()
    if profile_name == "auto":
        prof, why = profiles.select_profile(snap)
    else:
        prof, why = profiles.load_profile(profile_name), "chosen with --profile"
    server, manifest_caps = find_server(binary)
    caps = (capabilities.Capabilities.from_dict(manifest_caps) if manifest_caps
            else capabilities.probe(server))
    model_path, model_warning = resolve_model(model or prof.model)
    spec = launch.build_command(prof, caps, snap, model=model_path, listen_port=port,
                                binary=server)
    warnings = ([model_warning] if model_warning else []) + spec.warnings
    if as_json:
        console.print_json({**spec.to_dict(), "profile_reason": why, "warnings": warnings,
                            "binary": caps.describe()})
        return
    console.out.print(f"# profile {prof.name}: {why}", markup=False)
    console.out.print(f"# binary {caps.describe()}", markup=False)
    console.out.print(shlex.join(spec.argv), markup=False)
    console.out.print("")
    width = max((len(d.flag) for d in spec.decisions), default=0)
    for d in spec.decisions:
        value = f" {d.value}" if d.value is not None else ""
        console.out.print(f"  {(d.flag + value):<{width + 12}}  {d.reason}", markup=False)
    for w in warnings:
        console.warn(w)
