"""`mtpwrap down`: stop the running instance cleanly."""

from __future__ import annotations

import click


@click.command("down")
@click.option("--timeout", type=float, envvar="MTPWRAP_DOWN_TIMEOUT",
              help="Seconds to wait (default: the instance's drain budget + grace + 10).")
@click.option("--force", is_flag=True, envvar="MTPWRAP_DOWN_FORCE",
              help="SIGKILL mtpwrap if it has not stopped within the timeout.")
def command(timeout: float | None, force: bool) -> None:
    """Send SIGTERM to the running instance and wait until it has exited."""
    from mtpwrap import console
    from mtpwrap.supervision import instance

    pid = instance.stop_instance(timeout=timeout, force=force)
    if pid is None:
        console.info(instance.not_running())
    else:
        console.info(f"stopped mtpwrap (pid {pid})")
