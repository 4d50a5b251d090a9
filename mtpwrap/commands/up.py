"""`mtpwrap up`: launch, supervise and serve llama-server for a profile until stopped."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from mtpwrap.config.options import SettingsCommand, config_option, given, up_options


@click.command("up", cls=SettingsCommand)
@up_options
@click.option("--no-plan", "no_plan", is_flag=True, default=None,
              help="Launch a GPU profile without the memory plan's check (say so in the "
                   "summary); the same as --plan skip. [env: MTPWRAP_PLAN=skip]")
@config_option
def command(no_plan: bool | None, config: Path | None, **settings_given: Any) -> None:
    """Serve a profile: start llama-server on loopback, keep it running, front it over HTTP.

    Runs in the foreground until SIGTERM or Ctrl-C, then drains and stops cleanly. Exit codes:
    0 after a clean stop, 78 for a configuration error, 1 for a runtime failure.
    Settings come from flags, then MTPWRAP_* variables, then the config file, then the
    profile's own sections, then the defaults (docs/reference/configuration.md lists them).
    """
    from mtpwrap.config import settings
    from mtpwrap.service import up

    cli = given(settings_given)
    if no_plan:
        cli["plan"] = "skip"
    s = settings.load_settings(cli, config=config)
    sys.exit(up.run_up(s))
