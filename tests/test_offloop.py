"""Nothing that can block runs on the serving event loop: a hung NVML (a stand-in library that
stalls on demand), the state file, the socket probe, the audit trail's writes (a sink that
stalls on demand: a real disk cannot). `docs/reliability.md` 33-34, 43."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mtpwrap import proc
from mtpwrap.proc import free_loopback_port
from tests.helpers import REPO, cli_env, wait_for, wait_ready

STALLING_NVML = REPO / "tests" / "fakes" / "stalling_nvml"
WATCHDOG_USEC = 300_000  # a ping every 0.15 s


class _Watchdog:
    """A NOTIFY_SOCKET of our own, read in a thread: when each WATCHDOG=1 arrived."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"mtpwrap-offloop-{os.getpid()}-{time.monotonic_ns()}"
        self.sock.bind("\0" + name)
        self.sock.settimeout(0.2)
        self.address = "@" + name
        self.pings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.sock.recv(4096).decode()
            except (TimeoutError, OSError):
                continue
            if "WATCHDOG=1" in msg:
                self.pings.append(time.monotonic())

    def longest_gap(self, start: float, end: float) -> float:
        marks = [start, *(t for t in self.pings if start <= t <= end), end]
        return max(b - a for a, b in zip(marks, marks[1:], strict=False))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def _gpu_read(base: str) -> dict:
    r = httpx.get(base + "/healthz", timeout=3)  # a hung NVML must not hang /healthz
    assert r.status_code == 200
    return r.json()


def test_a_hung_nvml_stops_neither_streams_nor_livez_nor_the_watchdog(tmp_path: Path) -> None:
    """While NVML hangs: a stream is served to its end, /livez answers at once, WATCHDOG=1
    keeps its pace, and /healthz, /status.json and /metrics answer within their timeout with
    the GPU read marked stale; NVML is initialised once for all the reads."""
    stall, inits = tmp_path / "nvml-stall", tmp_path / "nvml-inits"
    dog = _Watchdog()
    port = free_loopback_port()
    env = cli_env(NOTIFY_SOCKET=dog.address, WATCHDOG_USEC=str(WATCHDOG_USEC),
                  MTPWRAP_HOME=str(tmp_path / "h"), MTPWRAP_DRAIN_S="2",
                  FAKE_LLAMA_FAULTS="token_delay_s=0.02", FAKE_NVML_STALL=str(stall),
                  FAKE_NVML_INITS=str(inits))
    env["PYTHONPATH"] = str(STALLING_NVML) + os.pathsep + env["PYTHONPATH"]
    log = tmp_path / "up.log"
    process = proc.start([sys.executable, "-m", "tests.fakes.serve_fake", str(port)], env=env,
                         cwd=REPO, stdout=log.open("w"), stderr=proc.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process.popen, log.read_text, timeout=60)
        health = _gpu_read(base)
        assert health["gpu_read"]["state"] == "fresh", health["gpu_read"]
        assert [g["name"] for g in health["gpu"]] == ["Stand-in GPU"]

        stall.touch()  # NVML hangs from here on
        t_stall = time.monotonic()
        wait_for("/healthz saying the GPU read is stale",
                 lambda: _gpu_read(base)["gpu_read"]["state"] == "stale", 20)
        health = _gpu_read(base)
        assert "NVML has not answered" in health["gpu_read"]["reason"]
        assert health["gpu"][0]["name"] == "Stand-in GPU"  # the last readings, marked stale

        t0 = time.monotonic()
        assert httpx.get(base + "/livez", timeout=3).status_code == 200
        livez_s = time.monotonic() - t0
        page = httpx.get(base + "/status.json", timeout=3).json()
        assert page["gpu_read"]["state"] == "stale"
        metrics = httpx.get(base + "/metrics", timeout=3).text
        assert "mtpwrap_gpu_reading_fresh 0.0" in metrics
        assert "mtpwrap_gpu_memory_total_bytes" not in metrics  # no stale value as a gauge

        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 40}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                          timeout=10) as r:
            assert r.status_code == 200
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 5
        t_end = time.monotonic()
        assert stall.exists()  # all of the above ran while NVML hung
        gap = dog.longest_gap(t_stall, t_end)
        assert gap < 1.5, f"the watchdog went {gap:.2f}s without a ping while NVML hung"
        assert livez_s < 1.0, livez_s

        stall.unlink()  # the driver answers again
        wait_for("the GPU read fresh again",
                 lambda: _gpu_read(base)["gpu_read"]["state"] == "fresh", 20)
        assert inits.read_text().splitlines() == ["init"]  # NVML initialised once
    finally:
        stall.unlink(missing_ok=True)
        process.kill()
        dog.close()
    out = log.read_text()
    assert "Traceback" not in out, out


def test_the_state_file_follows_the_state_written_off_the_loop(tmp_path: Path) -> None:
    """The instance file is rewritten by a writer thread, the latest state winning."""
    from mtpwrap.supervision.writer import LatestWriter

    written: list[dict] = []
    gate = threading.Event()

    def slow_write(data: dict) -> None:
        gate.wait(10)  # a disk that takes its time
        written.append(data)

    w = LatestWriter(slow_write, name="test-writer")
    t0 = time.monotonic()
    for i in range(50):
        w.submit({"n": i})
    assert time.monotonic() - t0 < 0.5  # submitting never waits for the disk
    gate.set()
    w.close(timeout=10)
    assert written[-1] == {"n": 49} and len(written) <= 3
    path = tmp_path / "x.json"
    w2 = LatestWriter(lambda d: path.write_text(json.dumps(d)), name="test-writer-2")
    w2.submit({"a": 1})
    w2.close(timeout=10)
    assert json.loads(path.read_text()) == {"a": 1}


# --------------------------------------------------------------------------- the audit writer


class _StalledSink:
    """An audit sink whose writes wait on a gate: a disk or journald that stopped answering."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.records: list[dict] = []
        self.waiting = threading.Event()

    def write(self, record: dict) -> None:
        self.waiting.set()
        self.gate.wait(60)
        self.records.append(record)

    def close(self) -> None:
        pass


def _trail(sink: object, queue_lines: int) -> object:
    from mtpwrap.front.audit import Trail
    from mtpwrap.front.budgets import Budgets
    from mtpwrap.front.metrics import FrontMetrics

    metrics = FrontMetrics(lambda: None, dict)  # type: ignore[arg-type,return-value]
    return Trail(sink, metrics, Budgets(None), lambda: "m.gguf",  # type: ignore[arg-type]
                 queue_lines=queue_lines)


def _ticket(n: int) -> object:
    from mtpwrap.front.audit import Ticket

    t = Ticket(method="POST", route="/v1/chat/completions", client="127.0.0.1")
    t.status, t.bytes_out = 200, n
    return t


def test_audit_lines_are_written_in_order_and_none_is_lost_silently(
        caplog: pytest.LogCaptureFixture) -> None:
    """The loop only queues a line; the writer thread writes them in order; a line that finds
    the queue full goes whole to the service log and is counted, as is one left at close."""
    from mtpwrap.front.audit import Trail

    sink = _StalledSink()
    trail = _trail(sink, queue_lines=3)
    assert isinstance(trail, Trail)
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="mtpwrap.audit"):
        trail.end(_ticket(0))  # type: ignore[arg-type]
        assert sink.waiting.wait(5)  # the writer holds it, in a write that does not return
        for n in range(1, 6):
            trail.end(_ticket(n))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.5  # ending a request never waits for the sink
    # one line in the (stalled) write, three queued, two found the queue full
    unwritten = trail.metrics.audit_unwritten.labels("queue_full")._value.get()
    assert unwritten == 2
    kept = [r.getMessage() for r in caplog.records if "not written to the trail" in r.getMessage()]
    assert len(kept) == 2 and all('"bytes_out":' in m for m in kept)
    assert json.loads(kept[0].split("kept here: ", 1)[1])["bytes_out"] == 4
    assert _queued(trail) == 4
    sink.gate.set()
    assert trail.writer.flush(10)
    assert [r["bytes_out"] for r in sink.records] == [0, 1, 2, 3]
    trail.end(_ticket(9))  # type: ignore[arg-type]
    trail.close()  # writes what is queued before it returns
    assert [r["bytes_out"] for r in sink.records] == [0, 1, 2, 3, 9]


def _queued(trail: object) -> float:
    """The mtpwrap_audit_queue_lines gauge."""
    gauge = trail.metrics.audit_queue  # type: ignore[attr-defined]
    return float(gauge.collect()[0].samples[0].value)


def test_a_shutdown_with_a_stalled_disk_keeps_the_unwritten_lines_in_the_log(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpwrap.front import audit

    monkeypatch.setattr(audit, "CLOSE_S", 0.3)
    sink = _StalledSink()
    trail = _trail(sink, queue_lines=100)
    with caplog.at_level("ERROR", logger="mtpwrap.audit"):
        trail.end(_ticket(0))  # type: ignore[attr-defined]
        assert sink.waiting.wait(5)
        for n in (1, 2):
            trail.end(_ticket(n))  # type: ignore[attr-defined]
        t0 = time.monotonic()
        trail.close()  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < 3
    kept = [json.loads(r.getMessage().split("kept here: ", 1)[1]) for r in caplog.records
            if "(shutdown)" in r.getMessage()]
    assert [r["bytes_out"] for r in kept] == [1, 2]  # the first was in the stalled write
    sink.gate.set()


@pytest.mark.integration
def test_a_stalled_audit_disk_stops_neither_streams_nor_livez(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    """The real llama-server behind a front whose audit sink stalls: streams are served to
    their end and /livez answers at once while every line waits; the lines come out in order
    once the sink answers again."""
    from mtpwrap.config.objects import ProxyConfig
    from tests.fakes.front_harness import LlamaChild, serve_front

    child = LlamaChild(llama_server_bin, demo_model, free_loopback_port(), "internal-key-0123",
                       log_path=tmp_path / "llama.log").start(timeout=300)
    sink = _StalledSink()
    key = "client-key-0123456789"
    try:
        with serve_front(child.base_url, child.api_key, ProxyConfig(api_keys=(key,))) as (
                srv, _sup), httpx.Client(base_url=srv.url, timeout=60, headers={
                    "authorization": f"Bearer {key}"}) as c:
            srv.front.trail.sink = sink
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "max_tokens": 12}
            ended = []
            for _ in range(3):
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                ended.append(events[-1])
                assert sink.waiting.wait(10) and not sink.gate.is_set()
                t0 = time.monotonic()
                assert c.get("/livez").status_code == 200
                assert time.monotonic() - t0 < 1.0
            assert ended == ["data: [DONE]"] * 3
            trail = srv.front.trail
            wait_for("the three lines queued", lambda: trail.writer.pending == 3, 10)
            queued = c.get("/metrics").text
            assert "mtpwrap_audit_queue_lines 3.0" in queued, queued[:2000]
            assert sink.records == []  # all of the above while no line could be written
            sink.gate.set()
            wait_for("the queued lines written", lambda: len(sink.records) == 4, 10)
            assert [r["route"] for r in sink.records[:3]] == ["/v1/chat/completions"] * 3
            assert all(r["completion_tokens"] for r in sink.records[:3])
    finally:
        sink.gate.set()
        child.kill()


def test_todays_totals_are_read_by_the_writer_not_the_loop_and_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The day's audit file may hold 100,000 lines: the trail reads it in its writer thread,
    first, before any line of its own run is written, so the status page's totals hold the
    earlier runs' lines once and this run's once."""
    from mtpwrap.front import audit

    sink = audit.FileSink(tmp_path, retention_days=2)
    earlier = _trail(sink, queue_lines=10)
    for n in range(3):
        earlier.end(_ticket(n))  # type: ignore[attr-defined]
    earlier.close()  # type: ignore[attr-defined]
    readers: list[str] = []
    read = audit.read_records

    def reading(*args: object, **kwargs: object) -> object:
        readers.append(threading.current_thread().name)
        gate.wait(5)  # a large file: still being read when this run's first request ends
        return read(*args, **kwargs)  # type: ignore[arg-type]

    gate = threading.Event()
    monkeypatch.setattr(audit, "read_records", reading)
    trail = _trail(audit.FileSink(tmp_path, retention_days=2), queue_lines=10)
    trail.end(_ticket(9))  # type: ignore[attr-defined]
    gate.set()
    assert trail.writer.flush(10)  # type: ignore[attr-defined]
    assert readers == ["mtpwrap-audit"]  # never the thread that made the trail
    assert trail.usage_today()[0]["requests"] == 4  # type: ignore[attr-defined]
    trail.close()  # type: ignore[attr-defined]
