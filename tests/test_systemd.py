"""The generated unit passes systemd's own checker; sd_notify reaches a socket we own."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from mtpwrap import proc
from mtpwrap.proc import free_loopback_port as _free_port
from mtpwrap.supervision import systemd
from tests.helpers import REPO, cli_env, run_cli


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:  # Debian: the checker ships in the systemd package
        proc.run(["apt-get", "install", "-y", "-q", "systemd"], check=True, timeout=600)
        exe = shutil.which("systemd-analyze")
    assert exe, "systemd-analyze is needed (apt-get install systemd)"
    return exe


def _verify(text: str, tmp_path: Path) -> proc.Completed:
    _systemd_analyze()  # installed when missing
    return systemd.verify(text, tmp_path)


def test_generated_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    r = run_cli("service", "print", "--profile", "cpu-demo", "--drain-s", "45")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    result = _verify(text, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mtpwrap.service" not in result.stderr  # no complaint about our unit at all
    lines = set(text.splitlines())
    for needed in ("Type=notify", "NotifyAccess=main", "Restart=on-failure",
                   "RestartPreventExitStatus=78", "KillMode=mixed", "NoNewPrivileges=yes",
                   "ProtectSystem=strict", "PrivateTmp=yes", "EnvironmentFile=-/etc/mtpwrap/env",
                   "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=/dev/nvidia-uvm rw",
                   "DeviceAllow=char-nvidia* rw", "User=mtpwrap", "WatchdogSec=30",
                   # llama-server's socket directory: the service user's alone
                   "RuntimeDirectory=mtpwrap", "RuntimeDirectoryMode=0700"):
        assert needed in lines, needed
    stop = int(next(ln for ln in lines if ln.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop >= 45 + 10  # the drain budget plus llama-server's grace
    assert any(ln.startswith("ReadWritePaths=") for ln in lines)
    exec_start = next(ln for ln in lines if ln.startswith("ExecStart=")).split("=", 1)[1]
    assert exec_start.split()[:4] == [sys.executable, "-m", "mtpwrap", "up"]
    reload = next(ln for ln in lines if ln.startswith("ExecReload=")).split("=", 1)[1]
    assert reload.split() == [sys.executable, "-m", "mtpwrap", "reload"]


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # The checker really checks: the same unit with a bad value is refused.
    text = systemd.render_unit(systemd.UnitOptions(exec_start=[sys.executable]))
    bad = text.replace("KillMode=mixed", "KillMode=gently")
    result = _verify(bad, tmp_path)
    assert "mtpwrap.service:" in result.stderr and "kill mode" in result.stderr


def test_install_and_uninstall_into_a_directory(tmp_path: Path) -> None:
    unit_dir, etc = tmp_path / "units", tmp_path / "etc"
    unit_dir.mkdir()
    opts = systemd.UnitOptions(exec_start=systemd.default_exec_start(None, "cpu-demo"))
    written = systemd.install(opts, unit_dir=unit_dir, etc_dir=etc, create_user=False,
                              reload=False)
    assert (unit_dir / "mtpwrap.service").read_text() == systemd.render_unit(opts)
    assert (etc / "env") in written and "MTPWRAP_API_KEYS" in (etc / "env").read_text()
    (etc / "env").write_text("MTPWRAP_PORT=9000\n")
    systemd.install(opts, unit_dir=unit_dir, etc_dir=etc, create_user=False, reload=False)
    assert (etc / "env").read_text() == "MTPWRAP_PORT=9000\n"  # an operator's file is kept
    assert systemd.uninstall(unit_dir=unit_dir, reload=False) == unit_dir / "mtpwrap.service"
    assert not (unit_dir / "mtpwrap.service").exists()
    assert systemd.uninstall(unit_dir=unit_dir, reload=False) is None


def _listen(tmp_path: Path, abstract: bool) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"mtpwrap-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        return sock, "@" + name
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    return sock, path


@pytest.mark.parametrize("abstract", [True, False])
def test_notifier_reaches_path_and_abstract_sockets(tmp_path: Path, abstract: bool) -> None:
    sock, address = _listen(tmp_path, abstract)
    sock.settimeout(2)
    n = systemd.Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "3000000"})
    assert n.enabled and n.watchdog_interval() == 1.5
    assert n.ready("ready: demo")
    assert sock.recv(4096).decode().split("\n")[:2] == ["READY=1", "STATUS=ready: demo"]
    n.extend_timeout(2.5)
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
    sock.close()
    assert not systemd.Notifier({}).enabled
    assert not systemd.Notifier({}).watchdog()  # no systemd: nothing sent, nothing raised
    other = systemd.Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100",
                              "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval() is None  # the watchdog is meant for another process




@pytest.mark.slow
def test_notify_sequence_ready_status_watchdog_stopping(tmp_path: Path) -> None:
    """mtpwrap under a NOTIFY_SOCKET we own: EXTEND while loading, READY only once the model
    answers, STATUS on state changes, WATCHDOG=1 even while the child is dead, STOPPING=1."""
    sock, address = _listen(tmp_path, abstract=True)
    sock.settimeout(0.2)
    port = _free_port()
    env = cli_env(NOTIFY_SOCKET=address, WATCHDOG_USEC="400000", MTPWRAP_HOME=str(tmp_path / "h"),
                  FAKE_LLAMA_FAULTS="load_s=1.0", MTPWRAP_SUPERVISOR_BACKOFF_INITIAL_S="1.5",
                  MTPWRAP_SUPERVISOR_MONITOR_INTERVAL_S="0.1", MTPWRAP_DRAIN_S="2")
    t0 = time.monotonic()
    process = proc.start([sys.executable, "-m", "tests.fakes.serve_fake", str(port)],
                         env=env, cwd=REPO, stdout=proc.PIPE, stderr=proc.STDOUT, text=True)
    up = process.popen
    got: list[tuple[float, str]] = []

    def pump(until: float, stop_when: str | None = None) -> None:
        while time.monotonic() < until:
            try:
                msg = sock.recv(4096).decode()
            except TimeoutError:
                continue
            got.append((time.monotonic() - t0, msg))
            if stop_when and stop_when in msg:
                return

    try:
        pump(time.monotonic() + 20, "READY=1")
        ready_at = next(t for t, m in got if "READY=1" in m)
        assert ready_at >= 1.0  # the fake takes a second to load; READY waited for the answer
        assert any("EXTEND_TIMEOUT_USEC=" in m for t, m in got if t < ready_at)
        assert f"MAINPID={up.pid}" in next(m for t, m in got if "READY=1" in m)
        state = json.loads((tmp_path / "h" / "state" / "instance.json").read_text())
        assert state["pid"] == up.pid and state["state"] == "ready"

        os.kill(state["child_pid"], signal.SIGKILL)  # the child dies; mtpwrap must not
        mark = len(got)
        pump(time.monotonic() + 1.4)  # inside the 1.5 s backoff: no child at all
        during = [m for _t, m in got[mark:]]
        assert any(m.startswith("STATUS=backoff: llama-server exited: signal 9") for m in during)
        assert sum(m == "WATCHDOG=1" for m in during) >= 3  # pings go on without a child
        pump(time.monotonic() + 10, "STATUS=ready")

        up.send_signal(signal.SIGTERM)
        pump(time.monotonic() + 10, "STATUS=stopped")
        assert up.wait(10) == 0
        msgs = [m for _t, m in got]
        stopping = next(i for i, m in enumerate(msgs) if m.startswith("STOPPING=1"))
        assert "STATUS=draining" in msgs[stopping]
        assert stopping > msgs.index(next(m for m in msgs if "READY=1" in m))
        assert not (tmp_path / "h" / "state" / "instance.json").exists()
    finally:
        process.kill()
        out = up.communicate()[0] if up.stdout else ""
        sock.close()
    assert "Traceback" not in out, out


def test_shipped_unit_is_the_generated_one(tmp_path: Path) -> None:
    shipped = (REPO / "deploy" / "mtpwrap.service").read_text()
    opts = systemd.UnitOptions(exec_start=["/opt/mtpwrap/.venv/bin/mtpwrap", "up", "--config",
                                           "/etc/mtpwrap/mtpwrap.yaml"])
    assert shipped == systemd.render_unit(opts), (
        "regenerate it: mtpwrap service print --exec-start '/opt/mtpwrap/.venv/bin/mtpwrap up "
        "--config /etc/mtpwrap/mtpwrap.yaml' > deploy/mtpwrap.service")
    r = run_cli("service", "print", "--exec-start", shlex.join(opts.exec_start))
    assert r.returncode == 0 and r.stdout == shipped  # the command the message names


def test_shipped_example_config_loads(tmp_path: Path) -> None:
    from mtpwrap.config.settings import load_settings

    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    text = (REPO / "deploy" / "mtpwrap.yaml").read_text().replace("/etc/mtpwrap/api-keys",
                                                                   str(keys))
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text(text)
    s = load_settings({}, env={}, config=cfg)
    assert s.api_keys == ("k1",) and s.supervisor["wedge_s"] == 60.0 and s.proxy == {}


def test_service_install_command_writes_where_told(tmp_path: Path) -> None:
    units, etc = tmp_path / "units", tmp_path / "etc"
    units.mkdir()
    r = run_cli("service", "install", "--unit-dir", str(units), "--etc-dir", str(etc),
                "--no-user", "--profile", "4090-262k", "--drain-s", "60")
    assert r.returncode == 0, r.stderr
    text = (units / "mtpwrap.service").read_text()
    assert "--profile 4090-262k" in text and "TimeoutStopSec=85" in text
    assert (etc / "env").exists()
    assert _verify(text, tmp_path).stderr.count("mtpwrap.service:") == 0
    r = run_cli("service", "uninstall", "--unit-dir", str(units))
    assert r.returncode == 0 and not (units / "mtpwrap.service").exists()
    r = run_cli("service", "install", "--unit-dir", str(tmp_path / "none"), "--no-user")
    assert r.returncode == 78 and "no such directory" in r.stderr


class _Service:
    """`up`'s serve loop over the fake llama-server, with a NOTIFY_SOCKET reader we own."""

    def __init__(self, tmp_path: Path, faults: str, **env: str) -> None:
        self.sock, address = _listen(tmp_path, abstract=True)
        self.sock.settimeout(0.2)
        self.env = cli_env(NOTIFY_SOCKET=address, MTPWRAP_HOME=str(tmp_path / "h"),
                           FAKE_LLAMA_FAULTS=faults, MTPWRAP_DRAIN_S="2", **env)
        self.t0 = time.monotonic()
        self.log = tmp_path / "up.log"
        self.process = proc.start(
            [sys.executable, "-m", "tests.fakes.serve_fake", str(_free_port())], env=self.env,
            cwd=REPO, stdout=self.log.open("w"), stderr=proc.STDOUT)
        self.proc = self.process.popen  # signals go to mtpwrap alone, as systemd's KillMode=mixed
        self.got: list[tuple[float, str]] = []

    def pump(self, until: float, stop_when: str | None = None) -> None:
        """Read datagrams until the monotonic time `until` (or one that contains stop_when);
        returns early once mtpwrap has exited and nothing more arrives."""
        while time.monotonic() < until:
            try:
                msg = self.sock.recv(4096).decode()
            except TimeoutError:
                if self.proc.poll() is not None:
                    return
                continue
            self.got.append((time.monotonic() - self.t0, msg))
            if stop_when and stop_when in msg:
                return

    def first(self, text: str) -> float:
        return next(t for t, m in self.got if text in m)

    def close(self) -> str:
        self.process.kill()
        self.sock.close()
        return self.log.read_text()


# A child that dies of SIGSEGV on every start: three crashes within the window → failed.
CRASH_LOOP = {"MTPWRAP_SUPERVISOR_MAX_FAILURES": "3", "MTPWRAP_SUPERVISOR_FAILURE_WINDOW_S": "60",
              "MTPWRAP_SUPERVISOR_BACKOFF_INITIAL_S": "0.3"}


def test_crash_loop_under_systemd_stops_extending_and_exits_1(tmp_path: Path) -> None:
    svc = _Service(tmp_path, "segv=1", **CRASH_LOOP)
    try:
        svc.pump(time.monotonic() + 30, "STATUS=failed")
        failed_at = svc.first("STATUS=failed")
        assert "signal 11" in next(m for _t, m in svc.got if "STATUS=failed" in m)
        rc = svc.proc.wait(15)
        exited_at = time.monotonic() - svc.t0
        svc.pump(time.monotonic() + 1)
    finally:
        out = svc.close()
    assert rc == 1, out
    # within the crash-loop window (3 starts, 0.3 + 0.6 s of backoff) plus a margin
    assert failed_at < 20 and exited_at - failed_at < 8, (failed_at, exited_at)
    after = [m for t, m in svc.got if t >= failed_at]
    assert not any("EXTEND_TIMEOUT_USEC" in m for m in after), after
    assert not any("READY=1" in m for _t, m in svc.got)
    assert any("EXTEND_TIMEOUT_USEC" in m for t, m in svc.got if t < failed_at)  # it did load
    assert "exiting 1" in out and "Traceback" not in out


@pytest.mark.slow
def test_failed_without_exit_stops_extending_the_start_timeout(tmp_path: Path) -> None:
    """exit_on_failed: false keeps mtpwrap up and failed, but no longer extends systemd's
    start timeout: TimeoutStartSec acts on a unit that can never become ready."""
    svc = _Service(tmp_path, "segv=1", MTPWRAP_SUPERVISOR_EXIT_ON_FAILED="false", **CRASH_LOOP)
    try:
        svc.pump(time.monotonic() + 30, "STATUS=failed")
        failed_at = svc.first("STATUS=failed")
        svc.pump(time.monotonic() + 6.5)  # more than one extension period (5 s)
        assert svc.proc.poll() is None  # told to stay
        svc.proc.send_signal(signal.SIGTERM)
        rc = svc.proc.wait(15)
    finally:
        out = svc.close()
    after = [m for t, m in svc.got if t >= failed_at]
    assert not any("EXTEND_TIMEOUT_USEC" in m for m in after), after
    assert rc == 1, out  # it stopped while failed


@pytest.mark.slow
def test_ready_waits_for_a_generation_and_retries_are_not_logged_one_by_one(
        tmp_path: Path) -> None:
    """/health 200 but every completion fails: no READY=1, and the retries (several a second)
    give one warning, then one summary line at most every PROBE_REPORT_S."""
    from mtpwrap.supervision.supervisor import PROBE_REPORT_S

    svc = _Service(tmp_path, "generate_fail=1", MTPWRAP_SUPERVISOR_LOAD_STALL_S="60")
    watch = 2 * PROBE_REPORT_S + 1
    try:
        svc.pump(time.monotonic() + 30, "EXTEND_TIMEOUT_USEC")
        start = time.monotonic()
        svc.pump(start + watch)
        assert svc.proc.poll() is None
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(15)
    finally:
        out = svc.close()
    assert not any("READY=1" in m for _t, m in svc.got), svc.got
    first = [ln for ln in out.splitlines() if "readiness generation failed: HTTP 500" in ln]
    summaries = [ln for ln in out.splitlines() if "readiness generation failed" in ln
                 and "more times" in ln]
    assert len(first) == 1, out
    assert 1 <= len(summaries) <= watch // PROBE_REPORT_S + 1, summaries
    retried = sum(int(ln.split("failed ")[1].split()[0]) for ln in summaries)
    assert retried >= 10  # it did retry many times: the lines sum them up
