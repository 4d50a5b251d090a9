"""`mtpwrap up`'s entry point: every check that can fail on bad input runs before anything
starts; then the summary, and the service until it stops."""

from __future__ import annotations

import asyncio
import logging

from mtpwrap import paths
from mtpwrap.errors import ConfigError
from mtpwrap.run import instance
from mtpwrap.service.launch import Launch, persist_config, prepare
from mtpwrap.service.server import bind_public, public_url, serve
from mtpwrap.settings import Settings


def configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_mtpwrap", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: "
                                               "%(message)s"))
        handler._mtpwrap = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Access lines carry paths and client addresses, nothing the journal needs by default.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def summary_lines(settings: Settings, launch: Launch) -> list[str]:
    i = launch.info
    keys = (f"{len(settings.api_keys)} API key(s) required" if settings.api_keys
            else "no API keys: open to anyone who can reach it")
    rows = [
        ("profile", f"{i.profile} ({i.profile_reason})"),
        ("binary", i.binary + (f" (commit {i.commit})" if i.commit else "")),
        ("model", i.model),
        ("context", i.context),
        ("KV cache", i.kv),
        ("speculation", i.speculation),
        ("memory plan", i.memory_plan),
        ("URL", f"{public_url(settings.host, settings.port)}/v1 ({keys})"),
        ("logs", str(paths.log_dir() / "llama-server.log")),
        ("snapshots", str(snaps.directory) if (snaps := persist_config(settings)) else "off"),
    ]
    out = ["mtpwrap up"] + [f"  {k:<12} {v}" for k, v in rows]
    out += [f"  warning: {w}" for w in launch.warnings]
    return out


def run_up(settings: Settings) -> int:
    """`mtpwrap up`: every check that can fail on bad input runs before anything starts."""
    configure_logging(settings.log_level)
    previous = instance.read_instance()
    if instance.instance_running(previous):
        assert previous is not None
        raise ConfigError(f"an mtpwrap instance is already running (pid {previous['pid']}, "
                          f"{previous.get('url')}).",
                          hint="Stop it with `mtpwrap down`, or set MTPWRAP_STATE_DIR to run "
                               "another one beside it.")
    instance.reap_leftovers(previous)
    launch, _, front_config = prepare(settings)
    sock = bind_public(settings.host, settings.port)

    def announce() -> None:
        from mtpwrap import console

        if launch.deferred is not None:
            launch.deferred()
        for line in summary_lines(settings, launch):
            console.out.print(line, markup=False)

    try:
        return asyncio.run(serve(settings, launch, sock, front_config=front_config,
                                 announce=announce))
    finally:
        sock.close()
