"""`mtpwrap up`: launch, supervise and serve llama-server for a profile until stopped."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("up")
@click.option("--profile", help="Profile name or file, or `auto` for this machine. "
              "[env: MTPWRAP_PROFILE; default: auto]")
@click.option("--model", help="Model path or name, overriding the profile's. [env: MTPWRAP_MODEL]")
@click.option("--host", help="Address the HTTP front listens on. [env: MTPWRAP_HOST; "
              "default: 127.0.0.1]")
@click.option("--port", help="Port of the HTTP front. [env: MTPWRAP_PORT; default: 8080]")
@click.option("--binary", help="llama-server to run (default: the built one). "
              "[env: MTPWRAP_BINARY]")
@click.option("--api-key-file", help="File with one client API key per line. "
              "[env: MTPWRAP_API_KEY_FILE; keys also from MTPWRAP_API_KEYS]")
@click.option("--drain-s", help="Seconds in-flight requests get on shutdown. "
              "[env: MTPWRAP_DRAIN_S; default: 30]")
@click.option("--no-plan", "no_plan", is_flag=True, default=None,
              help="Launch a GPU profile without the memory plan's check (say so in the "
                   "summary). [env: MTPWRAP_PLAN=skip]")
@click.option("--config", "config", type=click.Path(path_type=Path), envvar="MTPWRAP_CONFIG",
              help="YAML config file. [env: MTPWRAP_CONFIG; default: /etc/mtpwrap/mtpwrap.yaml "
                   "when present]")
def command(profile: str | None, model: str | None, host: str | None, port: str | None,
            binary: str | None, api_key_file: str | None, drain_s: str | None,
            no_plan: bool | None, config: Path | None) -> None:
    """Serve a profile: start llama-server on loopback, keep it running, front it over HTTP.

    Runs in the foreground until SIGTERM or Ctrl-C, then drains and stops cleanly. Exit codes:
    0 after a clean stop, 78 for a configuration error, 1 for a runtime failure.
    Settings come from flags, then MTPWRAP_* variables, then the config file.
    """
    from mtpwrap.config import settings
    from mtpwrap.service import up

    cli = {"profile": profile, "model": model, "host": host, "port": port, "binary": binary,
           "api_key_file": api_key_file, "drain_s": drain_s,
           "plan": "skip" if no_plan else None}
    s = settings.load_settings(cli, config=config)
    sys.exit(up.run_up(s))
