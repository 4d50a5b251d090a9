"""The instance file: how a running `mtpwrap up` tells `status`, `down` and the next `up` about
itself (paths.state_dir()/instance.json, written atomically on every state change, removed
on a clean exit)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.errors import RuntimeFailure

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


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def instance_running(data: dict[str, Any] | None) -> bool:
    """True when the recorded mtpwrap process is still there (and is still mtpwrap)."""
    if not data or not pid_alive(data.get("pid")):
        return False
    try:
        cmdline = Path(f"/proc/{data['pid']}/cmdline").read_bytes()
    except OSError:
        return False
    return b"mtpwrap" in cmdline


def write_instance(data: dict[str, Any]) -> None:
    path = instance_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)  # readers never see half a file


def reap_leftovers(data: dict[str, Any] | None) -> list[int]:
    """Kill the llama-server groups (the chat model's and each companion's) that a previous,
    SIGKILLed mtpwrap left behind.

    The child itself dies with its parent (PR_SET_PDEATHSIG), but a grandchild it started
    survives as an orphan and may hold the GPU memory or port the next start needs. A group
    id can be reused after its processes are gone, so only orphans are killed (or the
    recorded binary itself, should the child have survived). Returns the pids killed."""
    if not data or instance_running(data):
        return []
    binary = data.get("binary")
    groups = [data.get("child_pgid"), *(c.get("pid") for c in data.get("companions") or []
                                        if isinstance(c, dict))]
    victims: list[int] = []
    for pgid in groups:
        if isinstance(pgid, int) and pgid > 1 and binary:
            victims += _reap_group(pgid, str(binary), data.get("pid"))
    return victims


def _reap_group(pgid: int, binary: str, owner: object) -> list[int]:
    import psutil

    victims = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) != pgid or p.info.get("status") == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        cmd = p.info.get("cmdline") or []
        if p.info.get("ppid") == 1 or (cmd and cmd[0] == binary):
            victims.append(p.pid)
        else:
            return []  # somebody else's live group now: leave it alone
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if victims:
        log.warning("killed %d process(es) of group %d left behind by an earlier mtpwrap "
                    "(pid %s)", len(victims), pgid, owner)
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
                "reason": f"stale state file: pid {data.get('pid')} is gone",
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
        "companions": [{k: c.get(k) for k in ("name", "role", "model", "state", "reason",
                                              "pid", "restarts", "last_exit", "log_file")}
                       for c in data.get("companions") or [] if isinstance(c, dict)],
    }


def stop_instance(timeout: float | None = None, force: bool = False) -> int | None:
    """SIGTERM the running instance and wait for it; its pid, or None when none runs."""

    data = read_instance()
    if not instance_running(data):
        return None
    assert data is not None
    pid = int(data["pid"])
    if timeout is None:
        timeout = float(data.get("drain_s") or 30) + float(data.get("stop_grace_s") or 10) + 10
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    except PermissionError as exc:
        raise RuntimeFailure(f"not allowed to signal mtpwrap (pid {pid}); run `mtpwrap down` "
                             "as the user that runs it (or use systemctl stop).") from exc
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not pid_alive(pid):
            return pid
        time.sleep(0.1)
    if force:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid
    raise RuntimeFailure(f"mtpwrap (pid {pid}) did not stop within {timeout:.0f}s.",
                         hint="Wait longer with --timeout, or use --force.")


def request_reload(kind: str, timeout: float) -> dict[str, Any]:
    """Ask the running instance to reload (SIGHUP) or restart llama-server (SIGUSR2) and wait
    for the outcome it records in the state file: {"result": "ok"|"refused"|"failed",
    "message": ..., "exit_code": ...}."""

    data = read_instance()
    if not instance_running(data):
        raise RuntimeFailure(f"no mtpwrap instance is running (no live state file at "
                             f"{instance_path()}).", hint="Start one with `mtpwrap up`.")
    assert data is not None
    pid = int(data["pid"])
    before = int((data.get("reload") or {}).get("generation") or 0)
    try:
        os.kill(pid, signal.SIGHUP if kind == "reload" else signal.SIGUSR2)
    except ProcessLookupError:
        raise RuntimeFailure(f"mtpwrap (pid {pid}) exited before the {kind}.") from None
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
        if not pid_alive(pid):
            raise RuntimeFailure(f"mtpwrap (pid {pid}) exited during the {kind}.")
        time.sleep(0.1)
    raise RuntimeFailure(f"the {kind} did not finish within {timeout:.0f}s; `mtpwrap status` "
                         "shows how it ends.", hint="Wait longer with --timeout.")
