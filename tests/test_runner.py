"""The whole `up` service (supervisor + HTTP front + signals) over the fake llama-server.

These go through the public port, so they hold for whichever front is installed.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO, cli_env, wait_for, wait_ready


def dead(pid: int) -> bool:
    """True once process `pid` is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, tmp_path: Path, faults: str, **env: str) -> None:
        self.port = _free_port()
        self.home = tmp_path / "home"
        self.env = cli_env(MTPWRAP_HOME=str(self.home), FAKE_LLAMA_FAULTS=faults,
                           MTPWRAP_SUPERVISOR_BACKOFF_INITIAL_S="0.3",
                           MTPWRAP_SUPERVISOR_MONITOR_INTERVAL_S="0.1", **env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.serve_fake",
                                      str(self.port)], env=self.env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def readyz(self) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.base}/readyz", timeout=2)
        except httpx.HTTPError:
            return None

    def wait_ready(self, timeout: float = 20) -> None:
        wait_ready(self.base, self.proc, self.output, timeout)

    def state(self) -> dict:
        return json.loads((self.home / "state" / "instance.json").read_text())

    def state_once(self, state: str, timeout: float = 10) -> dict:
        """The state file once it says `state`: a thread writes it after the state changes,
        so /readyz may say so first."""
        def says() -> bool:
            try:
                return self.state()["state"] == state
            except (FileNotFoundError, ValueError):
                return False

        wait_for(f"the state file saying {state}", says, timeout)
        return self.state()

    def output(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=10)[0] or ""


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    faults, env = request.param
    s = Served(tmp_path, faults.replace("{tmp}", str(tmp_path)), **env)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def sse(base: str, n: int, out: list[str]) -> None:
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": n,
                            "stream": True}) as r:
        out.append(f"status {r.status_code}")
        try:
            for line in r.iter_lines():
                if line:
                    out.append(line)
        except httpx.HTTPError as exc:
            out.append(f"transport error {type(exc).__name__}")


@pytest.mark.parametrize("served", [("crash_after_chunks=3,counter={tmp}/n,fault_starts=1,"
                                      "later_hold={tmp}/go", {})], indirect=True)
def test_crash_mid_stream_ends_in_an_error_event_then_recovers(served: Served,
                                                               tmp_path: Path) -> None:
    served.wait_ready()
    got: list[str] = []
    sse(served.base, 20, got)
    assert got[0] == "status 200"
    data = [ln for ln in got if ln.startswith("data:")]
    assert len(data) >= 3
    assert "[DONE]" not in got[-1]  # never a truncated stream that looks complete
    assert "error" in got[-1]  # a terminal error event (or a transport error) ends it
    # the new child is held loading until the test lets it go: "until it answers" is pinned
    wait_for("the new child started", lambda: (tmp_path / "n").read_text() == "2", 20)
    r = served.readyz()
    assert r is not None and r.status_code == 503  # until the new child answers
    (tmp_path / "go").touch()
    served.wait_ready()
    r = httpx.post(f"{served.base}/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert served.state_once("ready")["restarts"] == 1


@pytest.mark.parametrize("served", [("token_delay_s=0.02,stream_hold={tmp}/go",
                                      {"MTPWRAP_DRAIN_S": "30"})], indirect=True)
def test_sigterm_drains_in_flight_streams_then_stops(served: Served, tmp_path: Path) -> None:
    served.wait_ready()
    st = served.state_once("ready")
    child = st["child_pid"]
    # The file names mtpwrap and its child by identity: this boot, their start times.
    from mtpwrap import pids

    assert st["boot_id"] == pids.boot_id() and st["written"] <= pids.ticks_now()
    assert pids.alive(pids.Identity(served.proc.pid, st["pid_start"]))
    assert pids.alive(pids.Identity(child, st["child_start"])) and st["child_pgid"] == child
    got: list[str] = []
    t = threading.Thread(target=sse, args=(served.base, 20, got))
    t.start()
    wait_for("the stream under way", lambda: any(ln.startswith("data:") for ln in got), 10)
    served.proc.send_signal(signal.SIGTERM)

    def not_ready() -> bool:
        r = served.readyz()
        return r is not None and r.status_code == 503

    wait_for("readiness dropping", not_ready, 5, every=0.02)  # at once, while the stream runs
    late = httpx.post(f"{served.base}/v1/chat/completions", timeout=5,
                      json={"messages": [], "max_tokens": 2})
    assert late.status_code == 503 and "retry-after" in late.headers
    # the stream is held after its first token until now: it was in flight all along
    assert t.is_alive() and got[-1] != "data: [DONE]"
    (tmp_path / "go").touch()
    t.join(20)
    assert got[0] == "status 200" and got[-1] == "data: [DONE]"  # finished whole
    assert served.proc.wait(20) == 0
    assert dead(child)


@pytest.mark.parametrize("served", [("exit=3", {"MTPWRAP_SUPERVISOR_MAX_FAILURES": "3",
                                                "MTPWRAP_SUPERVISOR_BACKOFF_MAX_S": "0.5"})],
                         indirect=True)
def test_crash_loop_shows_failed_with_reason_on_readyz(served: Served) -> None:
    def failed() -> bool:
        r = served.readyz()
        return r is not None and "failed" in r.text

    wait_for("/readyz saying failed", failed, 20)
    r = served.readyz()
    assert r is not None and r.status_code == 503
    assert "exit 3" in r.text
    served.state_once("failed")
    assert served.proc.poll() is None  # mtpwrap stays up to report it
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.base}/metrics", timeout=5).text
    states = {smp.labels["state"]: smp.value
              for fam in text_string_to_metric_families(text)
              if fam.name == "mtpwrap_supervisor_state" for smp in fam.samples}
    assert states["failed"] == 1.0 and states["ready"] == 0.0
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(20) == 1  # stopped while failed: systemd records a failure


def test_leftover_grandchild_of_a_killed_instance_is_reaped(tmp_path: Path) -> None:
    """mtpwrap SIGKILLed: the child dies with it, its orphaned grandchild is killed by the
    next start (it could hold the GPU memory that start needs)."""
    from mtpwrap.supervision import instance

    fake = REPO / "tests" / "fakes" / "fake_llama_server.py"
    script = (f"import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, {str(fake)!r}, '--port', '0', "
              f"'--fault', 'grandchild=1'], start_new_session=True, stdout=subprocess.PIPE, "
              f"text=True)\n"
              f"for line in p.stdout:\n"
              f"    if 'grandchild pid' in line:\n"
              f"        print(p.pid, line.split()[-1], flush=True); break\n"
              f"time.sleep(60)\n")  # the parent stays alive until the test kills it
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child, grandchild = (int(x) for x in parent.stdout.readline().split())
        import os

        from mtpwrap import pids

        # What the instance file records while both live: boot, start times, when written.
        mine, its = pids.identify(parent.pid), pids.identify(child)
        assert mine is not None and its is not None
        data = {"pid": parent.pid, "pid_start": mine.start,
                "child_pgid": child, "child_start": its.start,
                "boot_id": pids.boot_id(), "written": pids.ticks_now(),
                "binary": sys.executable}
        os.kill(child, signal.SIGKILL)  # what PR_SET_PDEATHSIG does when mtpwrap dies
        parent.kill()
        parent.wait()
        wait_for("the child dead", lambda: dead(child), 5, every=0.02)
        assert Path(f"/proc/{grandchild}").exists()  # an orphan, still running
        assert instance.reap_leftovers(data) == [grandchild]
        wait_for("the grandchild dead", lambda: dead(grandchild), 5, every=0.02)
        # A live group whose leader is not the recorded one is never touched (a group of its
        # own: the test's group may have lost its leader, and then nothing tells it from one
        # left behind)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
        try:
            assert instance.reap_leftovers({**data, "child_pgid": other.pid,
                                            "child_start": 1}) == []
            assert other.poll() is None
        finally:
            other.kill()
            other.wait()
    finally:
        parent.kill()


@pytest.mark.parametrize("served", [(
    "grow_mb_per_s=40,token_delay_s=0.02,counter={tmp}/n,fault_starts=1",
    {"MTPWRAP_SUPERVISOR_RSS_LIMIT_MB": "90", "MTPWRAP_SUPERVISOR_MEMORY_INTERVAL_S": "0.2"},
)], indirect=True)
@pytest.mark.slow
def test_memory_growth_recycles_with_no_failed_requests(served: Served) -> None:
    served.wait_ready()
    st0 = served.state_once("ready")
    # On a busy machine the first recycle can come before this read; then the pid proves nothing
    first_child = st0["child_pid"] if st0["restarts"] == 0 else None
    statuses: list[int] = []
    end = time.monotonic() + 30
    with httpx.Client(timeout=30) as c:
        while time.monotonic() < end:
            r = c.post(f"{served.base}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
            statuses.append(r.status_code)
            st = served.state()
            if st["restarts"] >= 1 and st["state"] == "ready" and len(statuses) > 5:
                break
    st = served.state()
    assert st["restarts"] == 1 and st["child_pid"] not in (first_child, None)
    assert st["last_exit"] == "exit 0"  # stopped politely after draining, not killed
    assert statuses and set(statuses) == {200}, statuses  # held during the recycle, then served
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(20) == 0
    assert "recycling llama-server: memory" in served.output()


@pytest.mark.parametrize("served", [("load_s=3,progress_s=0.2,hold_until={tmp}/go", {
    "MTPWRAP_SUPERVISOR_LOAD_STALL_S": "1"})], indirect=True)
def test_slow_load_is_live_but_not_ready(served: Served, tmp_path: Path) -> None:
    """Loading takes three times the stall budget, with progress: live, not ready, no restart.
    (The load goes on until the test has seen it not ready, however late the front listens.)"""
    seen_loading = False

    def ready() -> bool:
        """Live all along; 503 while loading, then 200."""
        nonlocal seen_loading
        try:
            live = httpx.get(f"{served.base}/livez", timeout=2)
        except httpx.HTTPError:
            return False  # not listening yet
        r = served.readyz()
        assert live.status_code == 200
        if r is not None and r.status_code == 200:
            return True
        assert r is not None and r.status_code == 503
        seen_loading = True
        (tmp_path / "go").touch()
        return False

    wait_for("ready after the slow load", ready, 30, every=0.05)
    assert seen_loading
    assert served.state()["restarts"] == 0


@pytest.fixture
def stall_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text("proxy:\n  stream_stall_s: 1.0\n  keepalive_s: 0.5\n")
    return cfg


@pytest.mark.slow
def test_wedged_stream_ends_in_an_error_and_the_child_is_replaced(tmp_path: Path,
                                                                  stall_config: Path) -> None:
    """/health stays 200 while no token comes: the front ends the stream after its stall
    budget and reports it; the supervisor sees no decode progress and replaces the child.
    The global token watchdog is off here, so the replacement comes from the report."""
    s = Served(tmp_path, f"wedge_after_chunks=2,counter={tmp_path}/n,fault_starts=1",
               MTPWRAP_CONFIG=str(stall_config), MTPWRAP_SUPERVISOR_WEDGE_S="0")
    try:
        s.wait_ready()
        got: list[str] = []
        t0 = time.monotonic()
        sse(s.base, 20, got)
        took = time.monotonic() - t0
        assert got[0] == "status 200"
        assert "[DONE]" not in got[-1] and "error" in got[-1]
        assert 1.0 <= took < 10
        wait_for("the child replaced", lambda: s.state().get("restarts", 0) >= 1, 15)
        st = s.state()
        assert st["restarts"] == 1
        s.wait_ready()
        r = httpx.post(f"{s.base}/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0
        assert "stopped producing tokens" in s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_llama_arg_variables_never_reach_llama_server(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server reads LLAMA_ARG_* as flags: one in the service's environment would get past
    the checked command line (verbose logging, --rpc). The child does not inherit them."""
    from mtpwrap.proc import running_server

    monkeypatch.setenv("LLAMA_ARG_LOG_VERBOSITY", "5")
    monkeypatch.setenv("LLAMA_ARG_RPC", "10.0.0.5:50052")
    monkeypatch.setenv("MTPWRAP_TEST_KEEP", "kept")
    script = ("import os, sys, time\n"
              "print(sorted(k for k in os.environ if k.startswith(('LLAMA_ARG_', 'MTPWRAP_TEST'))),"
              " 'listening on', flush=True)\n"
              "time.sleep(30)\n")  # the stand-in stays up until the block ends
    with running_server([sys.executable, "-c", script], base_url="http://127.0.0.1:9",
                        ready="listening", timeout=30, env={"LLAMA_API_KEY": "k"},
                        log_path=tmp_path / "child.log") as srv:
        seen = srv.log_text()
    assert "['MTPWRAP_TEST_KEEP'] listening on" in seen
