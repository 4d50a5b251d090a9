"""`mtpwrap reload` and `mtpwrap restart`: apply a changed configuration, or restart
llama-server, behind the front without dropping a connection."""

from __future__ import annotations

import click

from mtpwrap.config.options import shared_option


def finish(kind: str, timeout: float) -> None:
    from mtpwrap import console
    from mtpwrap.errors import ConfigError, RuntimeFailure
    from mtpwrap.supervision import instance

    outcome = instance.request_reload(kind, timeout)
    message = str(outcome.get("message") or "")
    if outcome.get("result") == "ok":
        console.info(f"{kind}: {message}")
        return
    if outcome.get("result") == "refused" and outcome.get("exit_code") == 78:
        raise ConfigError(message)
    raise RuntimeFailure(message or f"the {kind} failed.")


@click.command("reload")
@shared_option("MTPWRAP_RELOAD_TIMEOUT")
def command(timeout: float) -> None:
    """Re-read settings, API keys and the profile; swap what changed behind the front.

    The new configuration is checked here first, then again by the running instance; an
    invalid one (exit 78) changes nothing. The API keys (scopes, classes, budgets) are swapped
    at once: a key taken out is refused from the next request on, requests already running
    finish. llama-server is restarted only when its command line changed: new requests wait in
    the front's queue, in-flight ones finish, long contexts are carried over (persist.*). Exit
    0 when done (the new llama-server ready, or the running one left as it was), 78 when
    refused, 1 when the new llama-server did not start (the previous configuration is back).
    """
    from mtpwrap.errors import RuntimeFailure
    from mtpwrap.service import reload, startup
    from mtpwrap.supervision import instance

    data = instance.read_instance()
    if not instance.instance_running(data):
        raise RuntimeFailure(f"no mtpwrap instance is running (no live state file at "
                             f"{instance.instance_path()}).", hint="Start one with `mtpwrap up`.")
    assert data is not None
    startup.load_runtime(reload.reread_settings(data.get("reload_inputs") or {}))
    finish("reload", timeout)
