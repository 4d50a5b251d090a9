"""`mtpwrap restart`: restart llama-server behind the front, carrying long contexts over."""

from __future__ import annotations

import click

from mtpwrap.config.options import shared_option


@click.command("restart")
@shared_option("MTPWRAP_RELOAD_TIMEOUT")
def command(timeout: float) -> None:
    """Restart llama-server with its current command behind the front (e.g. after the binary
    at the same path was upgraded). New requests wait in the front's queue, in-flight ones
    finish, long contexts are carried over (persist.*). Exit 0 when it is ready again."""
    from mtpwrap.commands.reload import finish

    finish("restart", timeout)
