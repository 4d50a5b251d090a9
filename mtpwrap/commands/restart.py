"""`mtpwrap restart`: restart llama-server behind the front, carrying long contexts over."""

from __future__ import annotations

import click


@click.command("restart")
@click.option("--timeout", type=float, default=900.0, envvar="MTPWRAP_RELOAD_TIMEOUT",
              show_default=True, help="Seconds to wait for the outcome.")
def command(timeout: float) -> None:
    """Restart llama-server with its current command behind the front (e.g. after the binary
    at the same path was upgraded). New requests wait in the front's queue, in-flight ones
    finish, long contexts are carried over (persist.*). Exit 0 when it is ready again."""
    from mtpwrap.commands.reload import finish

    finish("restart", timeout)
