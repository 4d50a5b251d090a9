"""`mtpwrap up`'s entry point: every check that can fail on bad input runs before anything
starts; then the summary, and the service until it stops."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtpwrap.config.objects import AuditConfig
from mtpwrap.config.settings import Settings
from mtpwrap.errors import ConfigError
from mtpwrap.front import loop as event_loop
from mtpwrap.service.server import bind_public, public_url, serve
from mtpwrap.service.startup import Runtime, child_log_file, load_runtime, persist_config
from mtpwrap.supervision import instance
from mtpwrap.supervision.child import child_log

log = logging.getLogger("mtpwrap.runner")


class _TerminalFilter(logging.Filter):
    """On a terminal, llama-server's own info lines (its load log, GGUF metadata, timings)
    stay in its log file; its warnings and errors, and mtpwrap's lines, show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != child_log.name or record.levelno >= logging.WARNING


def configure_logging(level: str, child_log_file: Path | None = None) -> None:
    """mtpwrap's log on stderr: everything for the journal (stderr not a terminal); on a
    terminal, llama-server's warnings and errors only, and one line naming its full log."""
    root = logging.getLogger()
    if not any(getattr(h, "_mtpwrap", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: "
                                               "%(message)s"))
        handler._mtpwrap = True  # type: ignore[attr-defined]
        terminal = child_log_file is not None and handler.stream.isatty()
        if terminal:
            handler.addFilter(_TerminalFilter())
        root.addHandler(handler)
    else:
        terminal = False
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Access lines carry paths and client addresses, nothing the journal needs by default.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if terminal:
        log.info("llama-server's warnings and errors show here; its full output is in %s",
                 child_log_file)


def summary_lines(runtime: Runtime) -> list[str]:
    settings, i = runtime.settings, runtime.info
    keys = (f"{len(settings.api_keys)} API key(s) required" if settings.api_keys
            else "no API keys: open to anyone who can reach it")
    rows = [
        ("profile", f"{i.profile} ({i.profile_reason})"),
        ("binary", f"{i.binary}" + (f" (commit {i.commit})" if i.commit else "")),
        ("model", i.model),
        ("context", i.context),
        ("KV cache", i.kv),
        ("speculation", i.speculation_type),
        ("memory plan", i.memory_plan),
        ("documents", i.documents["summary"] if i.documents is not None else None),
        ("URL", f"{public_url(settings.host, settings.port)}/v1 ({keys})"),
        ("logs", str(child_log_file())),
        ("store", _store_line(settings, i.documents)),
        ("audit", _audit_line(settings)),
    ]
    rows += [(c.role, f"{c.name}: {c.model}, {c.slots} slot(s), memory {c.plan}")
             for c in runtime.companions]
    out = ["mtpwrap up"] + [f"  {k:<12} {v}" for k, v in rows]
    out += [f"  warning: {w}" for w in runtime.warnings]
    return out


def _store_line(settings: Settings, plan: Mapping[str, Any] | None) -> str:
    """Where the document store is, its bound, and how many full-context documents fit."""
    cfg = persist_config(settings)
    if cfg is None:
        return "off (persist.enabled: false): a restart reads every document again"
    full = int((plan or {}).get("entry_bytes") or 0)
    bound = (f"{cfg.max_mb / 1024:.1f} GiB, about {cfg.max_bytes // full:,} full-context "
             "document(s)" if cfg.max_mb and full else "a quarter of the free disk")
    return f"{cfg.directory} ({bound}, kept {cfg.retention_days} days unused)"


def _audit_line(settings: Settings) -> str:
    cfg = AuditConfig(**settings.audit)
    if cfg.sink == "file":
        return f"{cfg.directory} (kept {cfg.retention_days} days)"
    return cfg.sink


def run_up(settings: Settings) -> int:
    """`mtpwrap up`: every check that can fail on bad input runs before anything starts."""
    configure_logging(settings.log_level, child_log_file=child_log_file())
    previous = instance.read_instance()
    if instance.instance_running(previous):
        assert previous is not None
        raise ConfigError(f"an mtpwrap instance is already running (pid {previous['pid']}, "
                          f"{previous.get('url')}).",
                          hint="Stop it with `mtpwrap down`, or set MTPWRAP_STATE_DIR to run "
                               "another one beside it.")
    instance.reap_leftovers(previous)
    runtime = load_runtime(settings)
    sock = bind_public(settings.host, settings.port)

    def announce(runtime: Runtime) -> None:
        from mtpwrap import console

        for line in summary_lines(runtime):
            console.out.print(line, markup=False)

    try:
        return event_loop.run(serve(runtime, sock, announce=announce))
    finally:
        sock.close()
