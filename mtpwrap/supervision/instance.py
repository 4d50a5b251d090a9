"""The instance file: how a running `mtpwrap up` tells `status`, `down` and the next `up` about
itself (paths.state_dir()/instance.json, written atomically on every state change, removed
on a clean exit).

A file left by an instance that did not exit cleanly outlives its processes, and their pids go
to others. So the file records this boot's id and each process's start time (mtpwrap's own,
llama-server's and each companion's, `pids.Identity`), and nothing is signalled unless the boot
and the start time still match: a pid that is another process now makes the file stale.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.errors import RuntimeFailure
from mtpwrap.pids import Identity, alive, boot_id, identify, send, signal_group, ticks_now

log = logging.getLogger("mtpwrap.instance")

INSTANCE_FILE = "instance.json"


def instance_path() -> Path:
    return paths.state_dir() / INSTANCE_FILE


def read_instance() -> dict[str, Any] | None:
    try:
        data = json.loads(instance_path().read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _identity(pid: object, start: object) -> Identity | None:
    """A recorded pid and start time, when the file has both."""
    if isinstance(pid, int) and pid > 1 and isinstance(start, int):
        return Identity(pid, start)
    return None


def _recorded(data: dict[str, Any], pid_key: str, start_key: str) -> Identity | None:
    """The process the file names under `pid_key`, when the file is of this boot and says when
    that process started; None otherwise (nothing it names can then be trusted)."""
    if data.get("boot_id") != boot_id():
        return None
    return _identity(data.get(pid_key), data.get(start_key))


def owner(data: dict[str, Any] | None) -> Identity | None:
    """The mtpwrap that wrote `data`, while it still runs; None when the file is stale."""
    who = _recorded(data, "pid", "pid_start") if data else None
    return who if who is not None and alive(who) else None


def instance_running(data: dict[str, Any] | None) -> bool:
    """True when the recorded mtpwrap process is still there (the same process, not its pid)."""
    return owner(data) is not None


def stale_reason(data: dict[str, Any]) -> str:
    """Why a file that names no running instance is stale, in a few words."""
    pid = data.get("pid")
    if not isinstance(data.get("pid_start"), int) or not data.get("boot_id"):
        return f"it does not say when pid {pid} started"
    if data.get("boot_id") != boot_id():
        return "it was written before the machine last booted"
    now = identify(pid) if isinstance(pid, int) else None
    if now is None or not alive(now):
        return f"pid {pid} is gone"
    return f"pid {pid} is another process now"


def not_running() -> str:
    """What `down` says when no instance runs: whether the state file was stale."""
    data = read_instance()
    if data is None:
        return "no instance is running"
    return (f"no instance is running: the state file {instance_path()} is stale "
            f"({stale_reason(data)}); nothing was signalled")


def write_instance(data: dict[str, Any]) -> None:
    """Write the file for the instance that calls it: stamped with this boot's id, its own
    start time, and when (`written`, on the clock of start times)."""
    me = identify(os.getpid())
    data = {**data, "boot_id": boot_id(), "pid_start": me.start if me else None,
            "written": ticks_now()}
    paths.replace_text(instance_path(), json.dumps(data, indent=2, default=str))


def reap_leftovers(data: dict[str, Any] | None) -> list[int]:
    """Kill what is left of the llama-server groups (the chat model's and each companion's)
    that a previous, SIGKILLed mtpwrap left behind. Returns the pids killed.

    The child itself dies with its parent (PR_SET_PDEATHSIG), but a grandchild it started
    survives as an orphan and may hold the GPU memory or port the next start needs. The
    group's id is its leader's pid, which goes to another process once the group is empty:
    so only a group whose leader's identity the file records, of this boot, is touched, and
    only while it is provably still that group (`pids.signal_group`: no process with the
    leader's pid but the leader, every member started after the leader, the oldest before the
    file was last written, while the leader held the id)."""
    if not data or instance_running(data) or data.get("boot_id") != boot_id():
        return []
    written = data.get("written") if isinstance(data.get("written"), int) else None
    groups = [_identity(data.get("child_pgid"), data.get("child_start")),
              *(_identity(c.get("pid"), c.get("pid_start"))
                for c in data.get("companions") or [] if isinstance(c, dict))]
    victims: list[int] = []
    for leader in groups:
        if leader is None or written is None:
            continue
        killed = signal_group(leader, signal.SIGKILL, started_by=written)
        if killed:
            log.warning("killed %d process(es) of group %d left behind by an earlier mtpwrap "
                        "(pid %s)", len(killed), leader.pid, data.get("pid"))
        victims += killed
    return victims


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s}s"


def instance_report() -> dict[str, Any]:
    data = read_instance()
    if data is None:
        return {"running": False, "reason": f"no state file at {instance_path()}"}
    if not instance_running(data):
        return {"running": False,
                "reason": f"stale state file: {stale_reason(data)}",
                "last_state": data.get("state"), "last_exit": data.get("last_exit")}
    started = data.get("started_at")
    import httpx

    try:
        # the front's own public /livez, not llama-server: no upstream client here
        responding = httpx.get(f"{data.get('url')}/livez", timeout=1.0,
                               trust_env=False).status_code == 200
    except httpx.HTTPError:
        responding = False
    return {
        "running": True, "responding": responding, "state": data.get("state"),
        "reason": data.get("reason"),
        "pid": data.get("pid"), "child_pid": data.get("child_pid"),
        "url": data.get("url"), "profile": data.get("profile"), "model": data.get("model"),
        "binary": data.get("binary"),
        "uptime_s": (time.time() - started) if started else None,
        "ready_since": data.get("ready_since"), "restarts": data.get("restarts", 0),
        "last_exit": data.get("last_exit"), "log_file": data.get("log_file"),
        "updated_at": data.get("updated_at"), "reload": data.get("reload"),
        "persist": data.get("persist"), "persist_dir": data.get("persist_dir"),
        "command": data.get("command"),
        "companions": [{k: c.get(k) for k in ("name", "role", "model", "state", "reason",
                                              "pid", "restarts", "last_exit", "log_file")}
                       for c in data.get("companions") or [] if isinstance(c, dict)],
    }


def stop_instance(timeout: float | None = None, force: bool = False) -> int | None:
    """SIGTERM the running instance and wait for it; its pid, or None when none runs."""

    data = read_instance()
    who = owner(data)
    if who is None or data is None:
        return None
    pid = who.pid
    if timeout is None:
        timeout = float(data.get("drain_s") or 30) + float(data.get("stop_grace_s") or 10) + 10
    try:
        if not send(who, signal.SIGTERM):
            return pid
    except PermissionError as exc:
        raise RuntimeFailure(f"not allowed to signal mtpwrap (pid {pid}); run `mtpwrap down` "
                             "as the user that runs it (or use systemctl stop).") from exc
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(who):
            return pid
        time.sleep(0.1)
    if force:
        send(who, signal.SIGKILL)
        return pid
    raise RuntimeFailure(f"mtpwrap (pid {pid}) did not stop within {timeout:.0f}s.",
                         hint="Wait longer with --timeout, or use --force.")


#: what each of `mtpwrap reload`, `restart` and `documents forget` asks of the running
#: instance: the signal its service takes as that request
RELOAD_SIGNALS = {"reload": signal.SIGHUP, "restart": signal.SIGUSR2, "forget": signal.SIGUSR1}


def request_reload(kind: str, timeout: float) -> dict[str, Any]:
    """Ask the running instance to reload (SIGHUP), restart llama-server (SIGUSR2) or restart
    it cold, every document forgotten (SIGUSR1), and wait for the outcome it records in the
    state file: {"result": "ok"|"refused"|"failed", "message": ..., "exit_code": ...}."""

    data = read_instance()
    who = owner(data)
    if who is None or data is None:
        raise RuntimeFailure(f"no mtpwrap instance is running (no live state file at "
                             f"{instance_path()}).", hint="Start one with `mtpwrap up`.")
    pid = who.pid
    before = int((data.get("reload") or {}).get("generation") or 0)
    try:
        if not send(who, RELOAD_SIGNALS[kind]):
            raise RuntimeFailure(f"mtpwrap (pid {pid}) exited before the {kind}.")
    except PermissionError as exc:
        raise RuntimeFailure(f"not allowed to signal mtpwrap (pid {pid}); run `mtpwrap {kind}` "
                             "as the user that runs it (or use systemctl reload).") from exc
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        now = read_instance() or {}
        state = now.get("reload") or {}
        if int(state.get("generation") or 0) > before and state.get("result") not in (
                None, "running"):
            return dict(state)
        if not alive(who):
            raise RuntimeFailure(f"mtpwrap (pid {pid}) exited during the {kind}.")
        time.sleep(0.1)
    raise RuntimeFailure(f"the {kind} did not finish within {timeout:.0f}s; `mtpwrap status` "
                         "shows how it ends.", hint="Wait longer with --timeout.")


#: the documents `mtpwrap documents warm` read in (name, hash, tokens: never the text), beside
#: the state file; `/status` lists them too
WARMED = "documents.json"


def read_warmed() -> list[dict[str, Any]]:
    """The warmed documents' record (empty when there is none or it is unreadable)."""
    try:
        data = json.loads(instance_path().with_name(WARMED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def write_warmed(entries: list[dict[str, Any]]) -> None:
    paths.replace_text(instance_path().with_name(WARMED), json.dumps(entries, indent=1), 0o600)
