"""Every process mtpwrap starts, in one place.

- `start` / `start_async`: a process in its own process group (one `killpg` reaches whatever
  it starts), optionally made to die with mtpwrap (PR_SET_PDEATHSIG on Linux).
- `stop` / `stop_async`: the one stop policy — SIGTERM to the group, a bounded wait, SIGKILL
  to the group, and a SIGKILL sweep of the group even after a clean exit (a grandchild left
  behind would hold the GPU memory or the port the next start needs). One SIGTERM only:
  llama-server takes a second one as "exit now" with code 1. Every signal goes through
  `mtpwrap.pids` to the group the leader led, checked by the leader's identity (taken while
  it was unreaped, so still its own), never to a group id that may have been reused.
- `run`: a command run to completion with a timeout; rc, stdout and stderr, and one clear
  error for a missing binary, a timeout, or (with `check`) a failure.
- `version`: what a binary says to `--version`.
- `start_server` / `running_server`: a server (llama-server or a stand-in) started and waited
  for until it is ready.
- `free_loopback_port`, `child_env`, `describe_returncode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mtpwrap import upstream
from mtpwrap.errors import MissingToolError, MtpwrapError, RuntimeFailure
from mtpwrap.pids import Identity, identify, signal_group

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("mtpwrap.proc")

#: How long a process may take to vanish after SIGKILL before it is reported as stuck (a
#: process in uninterruptible sleep, e.g. inside a GPU driver call, ignores even SIGKILL).
KILL_WAIT_S = 15.0

#: Environment no child inherits: systemd talks to mtpwrap only (NotifyAccess=main), and the
#: public API keys of the front are none of the child's business.
_ENV_DROP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
             "LISTEN_FDNAMES", "MTPWRAP_API_KEYS")
_PR_SET_PDEATHSIG = 1

DEVNULL = subprocess.DEVNULL
PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
Stream = int | IO[Any] | None


class ProcError(MtpwrapError):
    """A command that could not be run, did not finish in time, or failed."""


class CommandMissing(ProcError, MissingToolError):
    """The binary is not there or cannot be executed."""


class CommandTimedOut(ProcError, RuntimeFailure):
    """The command ran past its timeout; it and its process group were stopped."""


class CommandFailed(ProcError, RuntimeFailure):
    """The command exited with a non-zero code (only raised with `check=True`)."""


# --------------------------------------------------------------------------- small facts


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a llama-server: this process's, less systemd's notification
    variables, mtpwrap's client keys and every LLAMA_ARG_* (llama-server reads those as flags,
    so one inherited from the service's environment would bypass the checked command line,
    e.g. LLAMA_ARG_LOG_VERBOSITY or LLAMA_ARG_RPC); then `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in _ENV_DROP and not k.startswith("LLAMA_ARG_")}
    env.update(extra or {})
    return env


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that was free a moment ago. A server may still lose a race for it;
    the supervisor sees the bind error in its output and restarts on a new port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_returncode(rc: int | None) -> str:
    """`exit 3` or `signal 9 (SIGKILL)`; None is a process `stop` could not end."""
    if rc is None:
        return "no exit (still there after SIGKILL)"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "unknown"
        return f"signal {-rc} ({name})"
    return f"exit {rc}"


def _child_setup(*, umask: int = -1, die_with_parent: bool = True) -> Callable[[], None] | None:
    """The preexec function of a started process: its file-creation mask (unless `umask` is
    -1) and, on Linux, death with mtpwrap even on SIGKILL; None when there is nothing to do.

    The mask is set here rather than through Popen's `umask=` because uvloop's subprocess_exec
    has no such argument; one function serves both starts. The libc handle is resolved here,
    in the parent: after fork() only async-signal-safe work is wise, so the child makes one
    umask, one prctl and one getppid call. PR_SET_PDEATHSIG fires when the *thread* that forked
    exits: start long-lived processes from a thread that lives as long as they should (the
    event loop's, or the main thread).
    """
    linux = sys.platform.startswith("linux")
    prctl = ctypes.CDLL(None, use_errno=True).prctl if die_with_parent and linux else None
    if prctl is None and umask == -1:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if umask != -1:
            os.umask(umask)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # mtpwrap may have died between fork() and prctl(): then nobody would signal us.
            if os.getppid() != parent:
                os._exit(1)

    return preexec


def _missing(argv0: str, exc: OSError) -> CommandMissing:
    return CommandMissing(f"cannot run {argv0}: {exc.strerror or exc}.",
                          hint="Check that it is installed and executable.")


# --------------------------------------------------------------------------- start and stop


class Process:
    """A process started by `start`: the leader of its own process group."""

    def __init__(self, popen: subprocess.Popen[Any], argv: Sequence[str], what: str) -> None:
        self.popen = popen
        self.argv = list(argv)
        self.what = what
        self.pid = popen.pid
        self.pgid = popen.pid  # start_new_session: the leader of its own session and group
        #: taken before anything can reap it, so it is this process's own
        self.leader = identify(popen.pid)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None when it is still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def send(self, sig: int) -> bool:
        """`sig` to the whole group (a crash or a wedge in a test)."""
        return bool(signal_group(self.leader, sig))

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        """`sig` to the whole group, then wait (bounded) for the leader to exit."""
        if self.popen.poll() is None:
            self.send(sig)
            return self.wait(KILL_WAIT_S)
        return self.popen.returncode

    def stop(self, grace: float) -> int | None:
        """The stop policy (see the module's docstring); the exit code, None when stuck."""
        return stop(self.popen, grace, what=self.what, leader=self.leader)


def start(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
          cwd: Path | str | None = None, stdin: Stream = DEVNULL, stdout: Stream = None,
          stderr: Stream = None, text: bool = False, umask: int = -1,
          die_with_parent: bool = True, what: str | None = None) -> Process:
    """Start `argv` in its own process group. `env` is the whole environment (None: this
    process's); pass `child_env(extra)` for a llama-server. A binary that cannot be executed
    raises CommandMissing."""
    args = [str(a) for a in argv]
    try:
        popen = subprocess.Popen(
            args, stdin=stdin, stdout=stdout, stderr=stderr, env=dict(env) if env else None,
            cwd=cwd, text=text, errors="replace" if text else None, start_new_session=True,
            preexec_fn=_child_setup(umask=umask, die_with_parent=die_with_parent))
    except OSError as exc:
        raise _missing(args[0], exc) from exc
    return Process(popen, args, what or Path(args[0]).name)


def stop(popen: subprocess.Popen[Any], grace: float, *, what: str = "process",
         leader: Identity | None = None) -> int | None:
    """SIGTERM to the group, up to `grace` seconds, SIGKILL to the group, and the sweep.
    The exit code; None when the leader outlived SIGKILL by KILL_WAIT_S (logged). `leader`:
    its identity from its start (else taken now, while Popen has not reaped it)."""
    pgid = popen.pid
    if leader is None and popen.returncode is None:
        leader = identify(pgid)
    if popen.poll() is None:
        signal_group(leader, signal.SIGTERM)
        try:
            popen.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("%s[%d] ignored SIGTERM for %.1fs; killing its process group",
                        what, pgid, grace)
            signal_group(leader, signal.SIGKILL)
            try:
                popen.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("%s[%d] is still there %.0fs after SIGKILL", what, pgid, KILL_WAIT_S)
                return None
    signal_group(leader, signal.SIGKILL)  # the sweep: whatever the leader left in its group
    return popen.returncode


async def start_async(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      stdout: Stream = PIPE, stderr: Stream = STDOUT, umask: int = -1,
                      die_with_parent: bool = True) -> asyncio.subprocess.Process:
    """`start` for the event loop (asyncio's or uvloop's): stdin from /dev/null, output to a
    pipe by default. OSError (no such binary) is the caller's to report."""
    return await asyncio.create_subprocess_exec(
        *[str(a) for a in argv], stdin=DEVNULL, stdout=stdout, stderr=stderr,
        env=dict(env) if env else None, start_new_session=True,
        preexec_fn=_child_setup(umask=umask, die_with_parent=die_with_parent))


async def stop_async(proc: asyncio.subprocess.Process, grace: float, *,
                     what: str = "process", leader: Identity | None = None) -> int | None:
    """`stop` for a process started by `start_async`: the same policy, awaited. `leader`: its
    identity from its start (else taken now, while the event loop has not reaped it)."""
    pgid = proc.pid
    if leader is None and proc.returncode is None:
        leader = identify(pgid)

    async def exited(timeout: float) -> bool:
        # `returncode`, not `wait()`: until 3.12, asyncio's wait() also waits for the output
        # pipe to close, which a grandchild holding it delays until the sweep.
        end = time.monotonic() + timeout
        while proc.returncode is None:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.02)
        return True

    if proc.returncode is None:
        signal_group(leader, signal.SIGTERM)
        if not await exited(grace):
            log.warning("%s[%d] ignored SIGTERM for %.1fs; killing its process group",
                        what, pgid, grace)
            signal_group(leader, signal.SIGKILL)
            if not await exited(KILL_WAIT_S):
                log.error("%s[%d] is still there %.0fs after SIGKILL", what, pgid, KILL_WAIT_S)
                return None
    signal_group(leader, signal.SIGKILL)  # the sweep
    return proc.returncode


# --------------------------------------------------------------------------- run and read


@dataclass(frozen=True)
class Completed:
    """A command that ran to its end."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout then stderr, stripped."""
        return (self.stdout + self.stderr).strip()

    def last_line(self) -> str:
        lines = (self.stderr or self.stdout).strip().splitlines()
        return lines[-1].strip()[-200:] if lines else ""


def run(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None, input: str | None = None, check: bool = False,
        merge_stderr: bool = False, what: str | None = None) -> Completed:
    """Run `argv` to completion (its own process group) and read what it printed.

    CommandMissing when it cannot be executed, CommandTimedOut after `timeout` seconds (the
    group is stopped by the one policy first), CommandFailed for a non-zero exit with `check`.
    """
    args = [str(a) for a in argv]
    name = what or " ".join([Path(args[0]).name, *args[1:2]])
    try:
        popen = subprocess.Popen(
            args, stdin=PIPE if input is not None else DEVNULL, stdout=PIPE,
            stderr=STDOUT if merge_stderr else PIPE, env=dict(env) if env else None, cwd=cwd,
            text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        raise _missing(args[0], exc) from exc
    try:
        out, err = popen.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(popen, 2.0, what=name)
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
            popen.communicate(timeout=2.0)
        raise CommandTimedOut(f"{name} did not finish within {timeout:g} s.") from None
    except BaseException:  # Ctrl-C: the command's group does not outlive the wait
        stop(popen, 2.0, what=name)
        raise
    done = Completed(tuple(args), popen.returncode, out or "", err or "")
    if check and done.returncode != 0:
        tail = done.last_line()
        raise CommandFailed(f"{name} ended with {describe_returncode(done.returncode)}"
                            + (f": {tail}" if tail else "."))
    return done


def version(binary: Path | str, *, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> str:
    """What `binary --version` prints (stdout and stderr, stripped). A binary that is missing,
    hangs or fails raises ProcError."""
    return run([str(binary), "--version"], timeout=timeout, env=env, check=True).output


# --------------------------------------------------------------------------- servers


@dataclass
class ServerProcess:
    """A server started by `start_server` for a measurement, a benchmark or a test: its own
    process group, output in `log_path`; `stop()` ends the whole group (idempotent)."""

    argv: list[str]
    base_url: str
    process: Process
    log_path: Path
    #: the UNIX socket it listens on (None: loopback TCP at `base_url`)
    socket: str | None = None
    #: run once the server has stopped (e.g. removing its socket's directory)
    after_stop: list[Callable[[], None]] = field(default_factory=list)
    #: `log_path` is a temporary file of start_server's: removed when `stop()` ends a server
    #: that was still running; kept (and named) when it died on its own or never got ready
    temp_log: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def proc(self) -> subprocess.Popen[Any]:
        return self.process.popen

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def last_line(self) -> str:
        lines = [ln for ln in self.log_text().splitlines() if ln.strip()]
        return lines[-1].strip()[-200:] if lines else "no output"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """A signal to the whole group (a crash or a wedge in a test), then wait for the exit."""
        self.process.kill(sig)

    def stop(self, grace: float = 15.0) -> int | None:
        ended_here = self.process.poll() is None
        rc = self.process.stop(grace)
        while self.after_stop:
            self.after_stop.pop(0)()
        if self.temp_log and ended_here:
            self.log_path.unlink(missing_ok=True)
        return rc

    def client(self, *, timeout: httpx.Timeout | float | None = 30.0,
               api_key: str | None = None, keepalive: bool = True) -> httpx.Client:
        """The one upstream client (`mtpwrap.upstream.client`), bound to where it listens;
        paths are relative to `base_url`."""
        return upstream.client(self.socket, base_url=self.base_url, api_key=api_key,
                               timeout=timeout, keepalive=keepalive)


def start_server(argv: Sequence[str], *, base_url: str, socket: str | None = None,
                 env: Mapping[str, str] | None = None, log_path: Path | None = None,
                 ready: str = "health", api_key: str | None = None, timeout: float = 300.0,
                 what: str = "llama-server", poll_s: float = 0.1) -> ServerProcess:
    """Start llama-server (or a stand-in; `env` added to `child_env()`) and wait until it is
    ready: `ready="health"` waits for GET /health 200, `"listening"` for its "listening on"
    line (enough when nothing will be asked of it). A server that exits or is not ready in
    time is stopped and reported with its last output line (RuntimeFailure). `socket`: the
    UNIX socket it was told to listen on (None: loopback TCP at `base_url`); the wait asks
    through the one upstream client bound to it."""
    temp_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with log_path.open("wb") as out:
        process = start(argv, env=child_env(env), stdout=out, stderr=STDOUT, what=what)
    srv = ServerProcess(list(process.argv), base_url, process, log_path, socket)
    deadline = time.monotonic() + timeout
    try:
        with srv.client(timeout=2.0, api_key=api_key, keepalive=False) as client:
            while True:
                rc = process.poll()
                if rc is not None:
                    raise RuntimeFailure(f"{what} exited with {describe_returncode(rc)} while "
                                         f"starting ({srv.last_line()}; log {log_path}).")
                if (ready == "listening" and "listening on" in srv.log_text()) or \
                        (ready != "listening" and healthy(client)):
                    srv.temp_log = temp_log
                    return srv
                if time.monotonic() > deadline:
                    raise RuntimeFailure(f"{what} was not ready after {timeout:.0f} s "
                                         f"({srv.last_line()}; log {log_path}).")
                time.sleep(poll_s)
    except BaseException:
        srv.stop(grace=5.0)
        raise


def healthy(client: httpx.Client) -> bool:
    """llama-server's GET /health answered 200 within 2 s (False: not yet, or not at all)."""
    import httpx

    try:
        return client.get("/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_server(argv: Sequence[str], **kwargs: Any) -> Iterator[ServerProcess]:
    """`start_server` as a context manager: the server is stopped however the block ends."""
    srv = start_server(argv, **kwargs)
    try:
        yield srv
    finally:
        srv.stop()
