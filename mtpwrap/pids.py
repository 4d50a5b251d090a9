"""Telling a process from any later one that gets its pid: its identity (pid and start time),
signals sent through a pidfd after that identity is checked, and a process group signalled only
while it is still the group its leader led.

A pid names a process only while it runs: after it is reaped the number goes to the next
process that needs one, and a process group's id (its leader's pid) with it. So nothing here
signals a bare pid: `send` takes an `Identity`, `signal_group` the leader's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    """One process, told apart from any later one that gets its pid: the pid and its start
    time (field 22 of /proc/PID/stat, clock ticks since boot; unique per pid within a boot)."""

    pid: int
    start: int


def boot_id() -> str | None:
    """This boot's id: a pid and a start time recorded in another boot name nothing here."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def ticks_now() -> int:
    """Now, on the clock of `Identity.start` (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from its third field on (state, ppid, pgrp, ...); None: no such pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def identify(pid: int) -> Identity | None:
    """The process that has `pid` now (a zombie included); None when there is none."""
    fields = _stat(pid)
    return Identity(pid, int(fields[19])) if fields is not None else None


def alive(who: Identity) -> bool:
    """`who` still runs: its pid is there, not a zombie, and has `who`'s start time."""
    fields = _stat(who.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == who.start


def send(who: Identity, sig: int) -> bool:
    """`sig` to `who` and to no other process; False when it is gone (or its pid is another
    process's now). A pidfd is opened before the start time is checked, so the process
    checked is the one signalled even if its pid is reused in between; where the kernel has
    no pidfds (before Linux 5.3), os.kill follows the check. PermissionError is the caller's."""
    fd: int | None = None
    try:
        fd = os.pidfd_open(who.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        fd = None
    try:
        if (now := identify(who.pid)) is None or now.start != who.start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(who.pid, sig)
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
    return True


def _members(pgid: int) -> list[Identity]:
    """The live processes of group `pgid`, each with its identity."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None \
                and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(Identity(int(entry.name), int(fields[19])))
    return found


def signal_group(leader: Identity | None, sig: int, *, started_by: int | None = None
                 ) -> list[int]:
    """`sig` to the process group `leader` led, only while it is still that group; the pids
    signalled (its live members) — none when there was nothing of it.

    While the leader is there (running, or a zombie not yet reaped), its pid is the group's
    id and cannot go to another process: one killpg. Once it is reaped, the id is free when
    the group is empty, and another process may take it and lead a group of its own. So then:
    a process with the leader's pid that is not the leader means the id is someone else's
    now (nothing is sent); otherwise every member must have started after the leader, the
    oldest no later than `started_by` (a moment the leader was known to be alive, when the
    caller knows one) — as long as one of the group's first members lives, its id cannot have
    been reused — and each one is signalled on its own identity (`send`)."""
    if leader is None:
        return []
    now = identify(leader.pid)
    members = _members(leader.pid)
    if now is not None:
        if now.start != leader.start:
            return []
        # Check and killpg are two steps: the leader's owner reaps it only in its own code
        # (Popen.wait, the event loop's thread), never while this call runs.
        try:
            os.killpg(leader.pid, sig)
        except (ProcessLookupError, PermissionError):
            return []
        return [m.pid for m in members]
    if not members or min(m.start for m in members) < leader.start or (
            started_by is not None and min(m.start for m in members) > started_by):
        return []
    return [m.pid for m in members if send(m, sig)]
