"""The instance file names processes by identity — this boot's id and each one's start time — so
a stale file never brings a signal to a process that merely has a recorded pid or process-group
id (docs/reliability.md 31, 32). Stand-ins are real processes; the reuse of a pid is staged by
recording a start time that is not theirs, as a file of an earlier process would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtpwrap import pids
from mtpwrap.pids import Identity
from mtpwrap.supervision import instance
from tests.helpers import cli_env, run_cli, wait_for

PAUSE = "import signal; signal.pause()"


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not mtpwrap, though "mtpwrap" is in its command line (as in
    `less mtpwrap.log`)."""
    p = subprocess.Popen([sys.executable, "-c", PAUSE, "less-mtpwrap.log"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def start_of(pid: int) -> int:
    who = pids.identify(pid)
    assert who is not None, pid
    return who.start


def write_file(home: Path, **data: object) -> None:
    (home / "state").mkdir(parents=True, exist_ok=True)
    (home / "state" / "instance.json").write_text(json.dumps(
        {"url": "http://127.0.0.1:9", "state": "ready", **data}))


def test_down_leaves_a_reused_pid_alone_and_says_the_file_was_stale(
        tmp_path: Path, stand_in: subprocess.Popen[bytes]) -> None:
    home = tmp_path / "h"
    env = cli_env(MTPWRAP_HOME=str(home))
    # The file's mtpwrap had this pid and started at another time: the pid was reused.
    write_file(home, pid=stand_in.pid, pid_start=start_of(stand_in.pid) - 1,
               boot_id=pids.boot_id())
    r = run_cli("down", env=env)
    assert r.returncode == 0, r.stderr
    assert f"is stale (pid {stand_in.pid} is another process now); nothing was signalled" \
        in r.stderr
    assert "stopped" not in r.stderr and stand_in.poll() is None
    r = run_cli("status", env=env)
    assert "stale state file: pid" in r.stdout and stand_in.poll() is None
    # The same pid and start time, written in another boot.
    write_file(home, pid=stand_in.pid, pid_start=start_of(stand_in.pid), boot_id="another")
    r = run_cli("down", env=env)
    assert "written before the machine last booted" in r.stderr and stand_in.poll() is None
    # A file that does not say when its process started names nothing it can prove.
    write_file(home, pid=stand_in.pid)
    assert not instance.instance_running(json.loads(
        (home / "state" / "instance.json").read_text()))
    r = run_cli("down", env=env)
    assert "does not say when" in r.stderr and stand_in.poll() is None


def test_down_stops_the_process_the_file_names(tmp_path: Path,
                                                stand_in: subprocess.Popen[bytes]) -> None:
    home = tmp_path / "h"
    write_file(home, pid=stand_in.pid, pid_start=start_of(stand_in.pid),
               boot_id=pids.boot_id(), drain_s=1, stop_grace_s=1)
    r = run_cli("down", env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == 0 and f"stopped mtpwrap (pid {stand_in.pid})" in r.stderr
    assert stand_in.wait(5) == -signal.SIGTERM


def test_send_reaches_only_the_process_it_names(stand_in: subprocess.Popen[bytes]) -> None:
    start = start_of(stand_in.pid)
    assert not pids.send(Identity(stand_in.pid, start + 1), signal.SIGTERM)
    assert pids.alive(Identity(stand_in.pid, start)) and stand_in.poll() is None
    assert pids.send(Identity(stand_in.pid, start), signal.SIGTERM)
    assert stand_in.wait(5) == -signal.SIGTERM
    assert not pids.send(Identity(stand_in.pid, start), signal.SIGTERM)  # gone: nothing sent


LEAVES_A_MEMBER = (f"import subprocess, sys\n"
                   f"m = subprocess.Popen([sys.executable, '-c', {PAUSE!r}])\n"
                   f"print(m.pid, flush=True)\n")  # then exits: its group keeps the member


@pytest.fixture
def leaderless_group() -> Iterator[tuple[Identity, Identity]]:
    """A group whose leader has exited (and was reaped) and whose member lives on: the
    leader's and the member's identity."""
    leader = subprocess.Popen([sys.executable, "-c", LEAVES_A_MEMBER], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    lead = Identity(leader.pid, start_of(leader.pid))
    assert leader.stdout is not None
    member_pid = int(leader.stdout.readline())
    member = Identity(member_pid, start_of(member_pid))
    leader.wait(10)
    try:
        yield lead, member
    finally:
        pids.send(member, signal.SIGKILL)


def test_a_group_that_may_be_another_now_is_not_reaped(
        stand_in: subprocess.Popen[bytes],
        leaderless_group: tuple[Identity, Identity]) -> None:
    """`up` after a SIGKILLed mtpwrap kills the leftovers of the groups its file records only
    while they are provably those groups."""
    gone = {"pid": stand_in.pid, "pid_start": start_of(stand_in.pid) - 1,  # a dead mtpwrap
            "boot_id": pids.boot_id(), "written": pids.ticks_now(), "binary": sys.executable}
    # The recorded pgid leads a live group now, started at another time: a reused id.
    stranger = subprocess.Popen([sys.executable, "-c", PAUSE], start_new_session=True)
    try:
        other = {**gone, "child_pgid": stranger.pid, "child_start": start_of(stranger.pid) - 1}
        assert instance.reap_leftovers(other) == [] and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
    # A group with no leader left: its member started after the file was last written (an id
    # reused since), or before the recorded leader itself (never its member).
    lead, member = leaderless_group
    later = {**gone, "child_pgid": lead.pid, "child_start": lead.start,
             "written": member.start - 1}
    older = {**gone, "child_pgid": lead.pid, "child_start": member.start + 1}
    for data in (later, older):
        assert instance.reap_leftovers(data) == [] and pids.alive(member)
    # Another boot's file names nothing here.
    assert instance.reap_leftovers({**gone, "child_pgid": lead.pid, "child_start": lead.start,
                                    "boot_id": "another"}) == [] and pids.alive(member)
    # The group the file does describe is reaped.
    ours = {**gone, "child_pgid": lead.pid, "child_start": lead.start}
    assert instance.reap_leftovers(ours) == [member.pid]
    wait_for("the member gone", lambda: not pids.alive(member), 5, every=0.02)


def test_a_group_whose_id_is_another_process_now_is_never_signalled(
        stand_in: subprocess.Popen[bytes]) -> None:
    """The stop policy's group signal, after its leader was reaped and its id went to a
    process that leads a group of its own."""
    stranger = subprocess.Popen([sys.executable, "-c", PAUSE], start_new_session=True)
    try:
        assert pids.signal_group(Identity(stranger.pid, start_of(stranger.pid) - 1),
                                 signal.SIGKILL) == []
        assert stranger.poll() is None
        assert pids.signal_group(Identity(stranger.pid, start_of(stranger.pid)),
                                 signal.SIGKILL) == [stranger.pid]
        assert stranger.wait(5) == -signal.SIGKILL
    finally:
        stranger.kill()
        stranger.wait()
