"""mtpwrap.proc with real processes: a leader that ignores SIGTERM, a grandchild left in the
group, a command that runs past its timeout, a binary that is not there."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from mtpwrap import proc
from mtpwrap.errors import EXIT_RUNTIME, EXIT_UNAVAILABLE, RuntimeFailure
from mtpwrap.front import loop as event_loop
from tests.helpers import wait_for

#: A leader that prints its grandchild's pid once the grandchild has said `ready`, then waits.
#: The grandchild ignores SIGTERM, so only a SIGKILL to the group ends it; `IGNORE=1` makes the
#: leader ignore SIGTERM too.
LEADER = r"""
import os, signal, subprocess, sys, time
gc = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); "
    "time.sleep(600)  # stays alive until the group is killed"],
    stdout=subprocess.PIPE, text=True)
if os.environ.get("IGNORE") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
assert gc.stdout.readline() == "ready\n"  # the grandchild has installed its handler
print(gc.pid, flush=True)
time.sleep(600)  # the leader stays alive until it is stopped
"""


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid: int, within: float = 5.0) -> bool:
    """True once process `pid` has ended (within `within` seconds)."""
    try:
        wait_for(f"process {pid} ending", lambda: not alive(pid), within, every=0.02)
    except TimeoutError:
        return False
    return True


def start_leader(ignore: bool) -> tuple[proc.Process, int]:
    env = {**os.environ, "IGNORE": "1" if ignore else "0"}
    p = proc.start([sys.executable, "-c", LEADER], env=env, stdout=proc.PIPE, text=True)
    assert p.popen.stdout is not None
    grandchild = int(p.popen.stdout.readline())
    assert os.getpgid(p.pid) == p.pid  # its own group ...
    assert os.getpgid(grandchild) == p.pid  # ... that the grandchild is in
    return p, grandchild


def test_stop_sweeps_a_grandchild_after_a_clean_exit() -> None:
    p, grandchild = start_leader(ignore=False)
    try:
        t0 = time.monotonic()
        assert p.stop(grace=5.0) == 0  # the leader took SIGTERM and left on its own
        assert time.monotonic() - t0 < 3.0
        assert gone(grandchild), "the grandchild ignores SIGTERM; only the sweep ends it"
    finally:
        p.kill()


def test_stop_kills_a_leader_that_ignores_sigterm(caplog: pytest.LogCaptureFixture) -> None:
    p, grandchild = start_leader(ignore=True)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="mtpwrap.proc"):
            rc = p.stop(grace=0.5)
        took = time.monotonic() - t0
        assert rc == -signal.SIGKILL
        assert 0.5 <= took < 3.0
        assert "ignored SIGTERM for 0.5s" in caplog.text
        assert gone(grandchild) and not alive(p.pid)
        assert p.stop(grace=0.5) == -signal.SIGKILL  # idempotent
    finally:
        p.kill()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_stop_async_is_the_same_policy(kind: str) -> None:
    async def scenario(ignore: bool, grace: float) -> tuple[int | None, int, float]:
        env = {**os.environ, "IGNORE": "1" if ignore else "0"}
        child = await proc.start_async([sys.executable, "-c", LEADER], env=env)
        assert child.stdout is not None
        grandchild = int(await child.stdout.readline())
        t0 = time.monotonic()
        rc = await proc.stop_async(child, grace)
        return rc, grandchild, time.monotonic() - t0

    rc, grandchild, took = event_loop.run(scenario(ignore=True, grace=0.5), kind=kind)
    assert rc == -signal.SIGKILL and 0.5 <= took < 3.0 and gone(grandchild)
    # a leader that takes SIGTERM is waited for, not killed, and not kept for the whole grace
    # (as `stop` above: a loaded machine may take more than a moment for its exit)
    rc, grandchild, took = event_loop.run(scenario(ignore=False, grace=5.0), kind=kind)
    assert rc == 0 and took < 3.0 and gone(grandchild)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_start_async_sets_the_mask_and_the_child_dies_with_its_parent(kind: str) -> None:
    """What the supervisor asks of llama-server's start, on either event loop `up` may run."""
    parent = (f"import sys; sys.path.insert(0, {str(Path(proc.__file__).parent.parent)!r})\n"
              "import asyncio\n"
              "from mtpwrap import proc\n"
              "from mtpwrap.front import loop\n"
              "async def main():\n"
              "    p = await proc.start_async(['sleep', '600'], umask=0o027)\n"
              "    print(p.pid, flush=True)\n"
              "    await asyncio.sleep(600)  # stays alive until the test kills it\n"
              f"loop.run(main(), kind={kind!r})\n")
    outer = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert outer.stdout is not None
        child = int(outer.stdout.readline())
        status = Path(f"/proc/{child}/status").read_text()
        assert "Umask:\t0027" in status, status
        assert os.getpgid(child) == child  # its own group, as with asyncio's start
        outer.kill()  # SIGKILL: no handler of the parent runs
        outer.wait()
        assert gone(child)
    finally:
        outer.kill()


def test_a_started_process_dies_with_its_parent() -> None:
    parent = (f"import sys; sys.path.insert(0, {str(Path(proc.__file__).parent.parent)!r})\n"
              "from mtpwrap import proc\n"
              "p = proc.start([sys.executable, '-c', 'import time; time.sleep(600)  # alive'])\n"
              "print(p.pid, flush=True)\n"
              "import time; time.sleep(600)  # both stay alive until the test kills them\n")
    outer = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert outer.stdout is not None
        child = int(outer.stdout.readline())
        assert alive(child)
        outer.kill()  # SIGKILL: no handler of the parent runs
        outer.wait()
        assert gone(child)
    finally:
        outer.kill()


def test_run_reads_the_code_and_both_streams() -> None:
    done = proc.run([sys.executable, "-c", "import sys; print('out'); "
                     "print('err', file=sys.stderr); sys.exit(3)"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    assert done.output == "out\nerr"
    with pytest.raises(proc.CommandFailed, match=r"ended with exit 3: err") as exc:
        proc.run([sys.executable, "-c", "import sys; print('err', file=sys.stderr); "
                  "sys.exit(3)"], timeout=30, check=True, what="the probe")
    assert exc.value.exit_code == EXIT_RUNTIME
    fed = proc.run([sys.executable, "-c", "print(input()[::-1])"], timeout=30, input="abc\n")
    assert fed.stdout == "cba\n"


def test_run_stops_the_group_at_its_timeout() -> None:
    # The shell's grandchild holds the output pipe; the timeout must end it too.
    script = "sleep 600 & echo $!; wait"
    t0 = time.monotonic()
    with pytest.raises(proc.CommandTimedOut, match=r"did not finish within 0.5 s") as exc:
        proc.run(["sh", "-c", script], timeout=0.5)
    assert time.monotonic() - t0 < 6.0
    assert isinstance(exc.value, RuntimeFailure)
    out = subprocess.run(["pgrep", "-f", "^sleep 600$"], capture_output=True, text=True)
    mine = [int(pid) for pid in out.stdout.split()
            if os.getpgid(int(pid)) == os.getpgid(0)]
    assert not mine  # nothing of it left in our own group either


def test_a_missing_binary_is_one_sentence(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-binary"
    with pytest.raises(proc.CommandMissing) as exc:
        proc.run([str(missing), "--version"], timeout=5)
    assert exc.value.exit_code == EXIT_UNAVAILABLE
    assert str(exc.value).startswith(f"cannot run {missing}: No such file or directory.")
    with pytest.raises(proc.CommandMissing):
        proc.start([str(missing)])
    with pytest.raises(proc.CommandMissing):
        proc.version(missing)


def test_version_reads_what_the_binary_prints() -> None:
    assert proc.version(sys.executable) == f"Python {sys.version.split()[0]}"


def test_free_loopback_port_is_bindable() -> None:
    port = proc.free_loopback_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_child_env_drops_what_a_child_must_not_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/x")
    monkeypatch.setenv("LLAMA_ARG_RPC", "10.0.0.1:50052")
    monkeypatch.setenv("MTPWRAP_API_KEYS", "k")
    env = proc.child_env({"LLAMA_API_KEY": "inner"})
    assert "NOTIFY_SOCKET" not in env and "LLAMA_ARG_RPC" not in env
    assert "MTPWRAP_API_KEYS" not in env and env["LLAMA_API_KEY"] == "inner"
    assert env["PATH"] == os.environ["PATH"]


def test_describe_returncode() -> None:
    assert proc.describe_returncode(0) == "exit 0"
    assert proc.describe_returncode(-9) == "signal 9 (SIGKILL)"
    assert proc.describe_returncode(None).startswith("no exit")


def test_start_server_reports_an_early_exit(tmp_path: Path) -> None:
    script = "print('fatal: no model'); raise SystemExit(2)"
    with pytest.raises(RuntimeFailure, match=r"exited with exit 2 while starting "
                                             r"\(fatal: no model; log "):
        proc.start_server([sys.executable, "-c", script], base_url="http://127.0.0.1:9",
                          log_path=tmp_path / "s.log", what="the stand-in", timeout=30)


def test_running_server_waits_for_listening_and_stops_the_group(tmp_path: Path) -> None:
    script = ("import time; print('server is listening on http://x', flush=True); "
              "time.sleep(600)")  # the server stays up until the block ends
    with proc.running_server([sys.executable, "-c", script], base_url="http://127.0.0.1:9",
                             ready="listening", log_path=tmp_path / "s.log", timeout=30) as srv:
        assert alive(srv.pid) and srv.proc.pid == srv.pid
        assert srv.last_line() == "server is listening on http://x"
    assert gone(srv.pid)


def test_a_temporary_log_goes_with_a_server_stopped_and_stays_with_one_that_died(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # up until a signal ends it (its stop, or the crash below)
    up = [sys.executable, "-c", "import signal; print('server is listening on http://x', "
          "flush=True); signal.pause()"]

    def logs() -> list[Path]:
        return sorted(tmp_path.glob("llama-server-*.log"))

    with proc.running_server(up, base_url="http://127.0.0.1:9", ready="listening",
                             timeout=30) as srv:
        assert logs() == [srv.log_path]
    assert logs() == []  # stopped by us: nothing left in /tmp

    srv = proc.start_server(up, base_url="http://127.0.0.1:9", ready="listening", timeout=30)
    srv.kill()  # a crash: the server is gone before anyone stops it
    srv.stop()
    assert logs() == [srv.log_path]  # it died on its own: its log is kept
    srv.log_path.unlink()

    with pytest.raises(RuntimeFailure, match=r"exited with exit 2 while starting"):
        proc.start_server([sys.executable, "-c", "raise SystemExit(2)"],
                          base_url="http://127.0.0.1:9", timeout=30)
    assert len(logs()) == 1  # named in the message, so kept
