"""`mtpwrap service`: the systemd unit for this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from mtpwrap.config.options import config_option, setting_option, shared_option
from mtpwrap.config.table import DEFAULT_CONFIG_FILE


def _options(profile: str | None, config: Path | None, user: str, watchdog_s: int,
             drain_s: float, drain_grace_s: float, stop_grace_s: float,
             exec_start: str | None) -> object:
    import shlex

    from mtpwrap.supervision import systemd

    argv = shlex.split(exec_start) if exec_start else systemd.default_exec_start(
        str(config) if config else None, profile)
    return systemd.UnitOptions(
        exec_start=argv, user=user, group=user,
        watchdog_s=watchdog_s, drain_s=drain_s, drain_grace_s=drain_grace_s,
        stop_grace_s=stop_grace_s)


_F = TypeVar("_F", bound=Callable[..., Any])


def _common(f: _F) -> _F:
    for opt in reversed([
        setting_option("profile", default=None, help="Profile the unit serves."),
        click.option("--exec-start", default=None,
                     help="The command line ExecStart runs (default: this Python's `mtpwrap "
                          "up` with --config and --profile); deploy/mtpwrap.service is "
                          "`--exec-start '/opt/mtpwrap/.venv/bin/mtpwrap up --config "
                          f"{DEFAULT_CONFIG_FILE}'`."),
        config_option(default=DEFAULT_CONFIG_FILE,
                      help="Config file the unit passes to `mtpwrap up`."),
        click.option("--user", envvar="MTPWRAP_SERVICE_USER", default="mtpwrap",
                     show_default=True, help="Dedicated system user the service runs as."),
        click.option("--watchdog-s", type=click.IntRange(2, 3600), default=30,
                     envvar="MTPWRAP_WATCHDOG_S", show_default=True, help="WatchdogSec."),
        setting_option("drain_s",
                       help="Drain budget; TimeoutStopSec covers it."),
        setting_option("drain_grace_s",
                       help="Time out of rotation before draining; TimeoutStopSec covers it."),
        setting_option("supervisor.stop_grace_s", "--stop-grace-s",
                       help="Grace llama-server gets after SIGTERM."),
    ]):
        f = opt(f)
    return f


@click.group("service")
def command() -> None:
    """Print, install or remove the systemd unit (Type=notify, watchdog, hardening)."""


@command.command("print")
@_common
def print_(**kw: object) -> None:
    """Print the unit file to stdout."""
    from mtpwrap import console
    from mtpwrap.supervision import systemd

    console.out.print(systemd.render_unit(_options(**kw)), markup=False, end="")  # type: ignore[arg-type]


@command.command("install")
@_common
@shared_option("MTPWRAP_UNIT_DIR")
@click.option("--etc-dir", type=click.Path(path_type=Path), default="/etc/mtpwrap",
              envvar="MTPWRAP_ETC_DIR", show_default=True,
              help="Where the environment file goes.")
@click.option("--no-user", is_flag=True, help="Do not create the system user.")
def install(unit_dir: Path, etc_dir: Path, no_user: bool, **kw: object) -> None:
    """Write the unit and /etc/mtpwrap/env, create the user, reload systemd."""
    from mtpwrap import console
    from mtpwrap.supervision import systemd

    written = systemd.install(_options(**kw), unit_dir=unit_dir,  # type: ignore[arg-type]
                              etc_dir=etc_dir, create_user=not no_user)
    for p in written:
        console.info(f"wrote {p}")
    if not systemd.booted():
        console.warn("systemd is not running here; the unit is written but not loaded")
    console.info(f"next: edit {etc_dir}/env and {etc_dir}/mtpwrap.yaml, then "
                 "`systemctl enable --now mtpwrap`")


@command.command("uninstall")
@shared_option("MTPWRAP_UNIT_DIR")
def uninstall(unit_dir: Path) -> None:
    """Stop and disable the service and remove the unit (config and user stay)."""
    from mtpwrap import console
    from mtpwrap.supervision import systemd

    removed = systemd.uninstall(unit_dir=unit_dir)
    console.info(f"removed {removed}" if removed else "no unit installed")
