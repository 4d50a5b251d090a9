"""Faults on the link between the front and the child (docs/reliability.md 4, 9–14, 29), shown
on demand by a fault-injecting upstream. The same promises are checked on the real llama-server in
test_proxy_real.py where the real binary can show them (disconnect, crash mid-stream).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.proc import free_loopback_port as free_port
from tests.fakes.fake_upstream import FakeUpstream, sse_events
from tests.fakes.front_harness import State, Upstream, serve_front
from tests.helpers import wait_for

KEY = "client-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
# One shared client: building one per request (an SSL context each) costs ~0.1 s of CPU, which
# on a small machine would hide the latencies these tests measure.
HTTP = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=64))


@pytest.fixture
def fake():
    f = FakeUpstream().start()
    yield f
    f.stop()


def cfg(**kw) -> ProxyConfig:
    base = dict(api_keys=(KEY,), keepalive_s=0.3, stream_stall_s=5.0, prefill_stall_s=10.0,
                queue_timeout_s=5.0)
    base.update(kw)
    return ProxyConfig(**base)


def metric(url: str, name: str, **labels: str) -> float:
    text = HTTP.get(url + "/metrics", headers=AUTH).text
    total = 0.0
    found = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    if not found:
        raise KeyError(name)
    return total


def counted(url: str, name: str, **labels: str) -> float:
    """`metric`, or 0 while the front has not shown it yet."""
    try:
        return metric(url, name, **labels)
    except KeyError:
        return 0.0


def post(url: str, body: dict, timeout: float = 30) -> httpx.Response:
    return HTTP.post(url + CHAT, json=body, headers=AUTH, timeout=timeout)


# --------------------------------------------------------------------------- 9: restarts


def test_requests_during_restart_wait_then_are_served_and_all_are_accounted(fake):
    fake.mode = "json"
    # the queue time is far longer than the test: the three wait until the child is ready,
    # however slowly a loaded machine sends the five
    with serve_front(fake.base_url, fake.api_key,
                     cfg(queue_size=3, max_concurrency=4, queue_timeout_s=60.0),
                     state=State.STARTING) as (srv, sup):
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(post, srv.url, {"messages": []}) for _ in range(5)]
            # the child is "restarting"; 3 wait, 2 are refused at once
            wait_for("3 queued and 2 refused",
                     lambda: srv.front.queued == 3 and sum(f.done() for f in futs) == 2, 30,
                     every=0.02)
            assert srv.front.queued == 3
            sup.set_state(State.READY, new_generation=True)
            codes = [f.result().status_code for f in futs]
            refused = [f.result() for f in futs if f.result().status_code != 200]
        assert sorted(codes) == [200, 200, 200, 503, 503]
        for r in refused:
            assert r.headers["retry-after"] == "5"
            assert "not ready" in r.json()["error"]["message"]
        # served + refused == sent, and the child saw exactly the served ones
        assert len(fake.seen) == codes.count(200)
        assert metric(srv.url, "mtpwrap_shed_total", reason="not_ready") == 2
        assert metric(srv.url, "mtpwrap_queue_depth") == 0


def test_queue_times_out_with_503_and_retry_after(fake):
    with serve_front(fake.base_url, fake.api_key, cfg(queue_timeout_s=0.5),
                     state=State.BACKOFF) as (srv, _sup):
        t = time.monotonic()
        r = post(srv.url, {"messages": []})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert 0.4 < time.monotonic() - t < 3
        assert metric(srv.url, "mtpwrap_shed_total", reason="queue_timeout") == 1
        assert fake.seen == []


def test_failed_child_is_answered_at_once(fake):
    with serve_front(fake.base_url, fake.api_key, cfg(queue_timeout_s=30),
                     state=State.FAILED) as (srv, sup):
        sup.reason = "crash loop: exit 1 five times in 60 s"
        t = time.monotonic()
        r = post(srv.url, {"messages": []})
        assert r.status_code == 503 and time.monotonic() - t < 2
        ready = httpx.get(srv.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["reason"].startswith("crash loop")


# --------------------------------------------------------------------------- 10: disconnects


def _stream_and_close(url: str, read_events: int) -> None:
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", url + CHAT, json={"stream": True, "messages": []}, headers=AUTH) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got >= read_events:
                    break
    # leaving both context managers closes the connection


def test_disconnect_mid_stream_cancels_upstream_within_a_second(fake):
    fake.mode, fake.cut_after = "stall_after", 3
    with serve_front(fake.base_url, fake.api_key, cfg()) as (srv, _):
        _stream_and_close(srv.url, 2)
        t = time.monotonic()
        closed = fake.wait_closed(0, 3)
        assert closed is not None and closed - t < 1.0
        wait_for("the cancel counted", lambda: counted(
            srv.url, "mtpwrap_cancelled_total", reason="client_disconnect") >= 1, 5)
        assert metric(srv.url, "mtpwrap_cancelled_total", reason="client_disconnect") == 1


def test_disconnect_before_first_token_cancels_upstream(fake):
    """A close looks like a half-close until something is sent: the front opens the stream at
    once (its head and a keep-alive comment, long before `keepalive_s`), and a client that
    closed for good answers them with the reset that tells the two apart."""
    fake.mode = "stall_before_headers"
    with serve_front(fake.base_url, fake.api_key, cfg(keepalive_s=15.0)) as (srv, _):
        s = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps({"stream": True, "messages": []}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        wait_for("the request reaching the upstream", lambda: bool(fake.seen), 5, every=0.01)
        s.close()
        t = time.monotonic()
        closed = fake.wait_closed(0, 3)
        assert closed is not None and closed - t < 1.0


# --------------------------------------------------------------------------- 11: retries


def test_no_retry_once_the_body_was_sent(fake):
    fake.mode = "close_without_response"
    with serve_front(fake.base_url, fake.api_key, cfg()) as (srv, _):
        r = post(srv.url, {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "unavailable_error"
        time.sleep(0.2)  # the thing under test: no retry comes in this time
        assert len(fake.seen) == 1
        assert metric(srv.url, "mtpwrap_upstream_errors_total", kind="disconnected") == 1


def test_refused_connect_is_retried_once(fake):
    fake.mode = "json"
    dead = f"http://127.0.0.1:{free_port()}"
    with serve_front(dead, fake.api_key, cfg()) as (srv, sup):
        sup.upstream_override.append(Upstream(fake.base_url, fake.api_key, 2))
        r = post(srv.url, {"messages": []})
        assert r.status_code == 200 and r.json()["ok"] is True
        assert len(fake.seen) == 1
        # a second refusal in a row is not retried again
        sup.upstream_override.append(Upstream(dead, fake.api_key, 3))
        r = post(srv.url, {"messages": []})
        assert r.status_code == 502
        assert metric(srv.url, "mtpwrap_upstream_errors_total", kind="connect") == 3


# --------------------------------------------------------------------------- 12: overload


def test_overload_is_shed_fast_and_accepted_requests_complete(fake):
    # the two forwarded are held by the fake until the test has seen the queue full, then
    # answer 1 s later each: the state below cannot be left while it is looked at
    fake.mode, fake.interval = "slow_json", 1.0
    release = fake.hold = threading.Event()
    with serve_front(fake.base_url, fake.api_key,
                     cfg(max_concurrency=2, queue_size=2, queue_timeout_s=60.0)) as (srv, _):
        def timed() -> tuple[int, float, str | None, float]:
            t = time.monotonic()
            r = post(srv.url, {"messages": []})
            end = time.monotonic()
            return r.status_code, end - t, r.headers.get("retry-after"), end

        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(timed) for _ in range(8)]

            def shed_and_queued() -> bool:
                shed = sum(1 for f in futs if f.done() and f.result()[0] == 429)
                return shed == 4 and srv.front.queued == 2 and srv.front.forwarding == 2

            try:  # two forwarded (held), two queued, four shed
                wait_for("4 shed, 2 queued and 2 forwarded", shed_and_queued, 30, every=0.02)
                depth = metric(srv.url, "mtpwrap_queue_depth")
            finally:
                released = time.monotonic()
                release.set()
            results = [f.result() for f in futs]
        shed = [r for r in results if r[0] == 429]
        ok = [r for r in results if r[0] == 200]
        assert len(shed) == 4 and len(ok) == 4
        assert all(d < 0.5 and ra for _, d, ra, _ in shed), results
        # accepted ones, once let go: two served at once (~1 s), two after queueing (~2 s)
        assert max(end - released for _, _, _, end in ok) < 3.5
        assert depth == 2
        assert metric(srv.url, "mtpwrap_shed_total", reason="overload") == 4
        assert sum(1 for s in fake.seen if s.path == CHAT) == 4


# --------------------------------------------------------------------------- 13: slow reader


def test_slow_reader_is_cut_and_upstream_cancelled(fake):
    fake.mode, fake.chunk_bytes = "endless", 16384
    with serve_front(fake.base_url, fake.api_key, cfg(write_timeout_s=1.0)) as (srv, _):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        body = json.dumps({"stream": True, "messages": []}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        try:
            # never read: the front's buffer fills, its write times out, the child is let go
            closed = fake.wait_closed(0, 15)
            assert closed is not None
            # counted by the request's handler once its worker has stopped, which may be just
            # after the fake saw the connection close
            wait_for("the cut counted", lambda: counted(
                srv.url, "mtpwrap_cancelled_total", reason="slow_reader") >= 1, 5)
            assert metric(srv.url, "mtpwrap_cancelled_total", reason="slow_reader") == 1
        finally:
            s.close()


# --------------------------------------------------------------------------- 14 / 1: cuts


@pytest.mark.parametrize("mode", ["truncate", "reset"])
def test_cut_stream_ends_with_an_error_event_never_done(fake, mode):
    fake.mode, fake.cut_after = mode, 3
    with serve_front(fake.base_url, fake.api_key, cfg()) as (srv, _):
        r = post(srv.url, {"stream": True, "messages": []})
        events = sse_events(r.content)
        assert r.status_code == 200
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["code"] == 502
        assert sum(1 for e in events if "tok" in e) == 3
        assert r.content.endswith(b"\n\n")
        assert metric(srv.url, "mtpwrap_upstream_errors_total", kind="disconnected") == 1


# ------------------------------------------------- 29: an error after the event-stream head


@pytest.mark.parametrize(("answer", "status"), [
    ((400, "application/json", b'{"error": "boom"}'), 400),
    ((200, "application/json", b'{"error": "boom"}'), 502),
    ((503, "text/event-stream", b'data: {"error": "boom"}\n\n'), 503),
])
def test_an_error_after_the_keepalive_head_ends_the_stream_and_is_recorded(
        fake, answer: tuple[int, str, bytes], status: int) -> None:
    """The front sent its own event-stream head (keep-alive during the prefill); llama-server
    then answers with an error whose `error` is a bare string: the client gets one terminal
    error event naming it and the stream ends; the metrics and the audit count the error, not
    the 200 of the head."""
    fake.mode, fake.interval, fake.late_error = "late_error", 0.8, answer
    with serve_front(fake.base_url, fake.api_key, cfg(keepalive_s=0.2)) as (srv, _):
        r = post(srv.url, {"stream": True, "messages": []}, timeout=10)
        assert r.status_code == 200 and r.content.startswith(b": keep-alive\n\n")
        events = sse_events(r.content)
        assert len(events) == 1 and "[DONE]" not in events
        assert json.loads(events[0])["error"] == {
            "code": status, "message": "boom",
            "type": "invalid_request_error" if status == 400 else "unavailable_error"}
        assert r.content.endswith(b"\n\n")
        kind = f"{status // 100}xx"
        wait_for("the audit's count", lambda: counted(
            srv.url, "mtpwrap_key_requests_total", status=kind) == 1, 5, every=0.05)
        assert metric(srv.url, "mtpwrap_requests_total", status=str(status)) == 1
        assert counted(srv.url, "mtpwrap_requests_total", status="200") == 0


# --------------------------------------------------------------------------- 4: stalls


def test_stall_after_first_token_ends_stream_and_is_reported(fake):
    fake.mode, fake.cut_after = "stall_after", 2
    with serve_front(fake.base_url, fake.api_key, cfg(stream_stall_s=1.0)) as (srv, sup):
        t = time.monotonic()
        r = post(srv.url, {"stream": True, "messages": []})
        took = time.monotonic() - t
        events = sse_events(r.content)
        assert 0.9 < took < 3
        assert json.loads(events[-1])["error"]["code"] == 504
        assert b": keep-alive\n\n" in r.content
        assert sup.stalls and sup.stalls[0][0] == 1
        closed = fake.wait_closed(0, 2)
        assert closed is not None


def test_long_prefill_has_its_own_budget_and_keeps_the_client_alive(fake):
    fake.mode = "stall_before_headers"
    with serve_front(fake.base_url, fake.api_key,
                     cfg(stream_stall_s=0.5, prefill_stall_s=2.5, keepalive_s=0.4)) as (srv, sup):
        t = time.monotonic()
        r = post(srv.url, {"stream": True, "messages": []})
        took = time.monotonic() - t
        assert took > 2.3, "the prefill was cut with the (shorter) stream budget"
        assert r.headers["content-type"] == "text/event-stream"
        assert r.content.count(b": keep-alive\n\n") >= 3
        assert json.loads(sse_events(r.content)[-1])["error"]["code"] == 504
        assert len(sup.stalls) == 1


@pytest.mark.parametrize("phase", ["read", "answer"])
def test_a_slot_that_steps_slower_than_the_status_page_polls_is_not_cut(fake, phase):
    """The prefill budget runs from llama-server's last step on the slot however many samplers
    look between steps: with the status page polled every 0.1 s and one step every 0.6 s (a
    loaded machine's batch), a 1 s budget cuts neither a streamed request's read of its prompt
    nor an unstreamed request's answer being generated; once the steps stop, the request is cut
    about one budget after the last."""
    stream = phase == "read"
    fake.mode, fake.slot_read, fake.slot_decoded = "stall_before_headers", 512, 0 if stream else 1
    with serve_front(fake.base_url, fake.api_key,
                     cfg(stream_stall_s=0.5, prefill_stall_s=1.0, keepalive_s=0.3)) as (srv, _):
        polling = True

        def poll() -> None:
            while polling:
                page = HTTP.get(srv.url + "/status.json", headers=AUTH)
                assert page.status_code == 200, page.text
                assert bool(page.json()["reads"]) == stream, page.text  # a read, or an answer
                time.sleep(0.1)

        with cf.ThreadPoolExecutor(2) as pool:
            poller = pool.submit(poll)
            answer = pool.submit(post, srv.url, {"stream": stream, "messages": []})
            try:
                for _ in range(6):  # one step every 0.6 s: 512 tokens read, or 4 generated
                    time.sleep(0.6)
                    assert not answer.done(), f"a slot that steps was cut ({phase})"
                    if stream:
                        fake.slot_read += 512
                    else:
                        fake.slot_decoded += 4
                last_step = time.monotonic()
                r = answer.result(30)
                after = time.monotonic() - last_step
            finally:
                polling = False
            poller.result(10)
        code = json.loads(sse_events(r.content)[-1])["error"]["code"] if stream else r.status_code
        assert code == 504, r.text
        assert 0.9 < after < 1.8, after  # one budget (1 s) and a look or two of the watch


# --------------------------------------------------------------------------- 6: drain


def test_drain_refuses_new_requests_and_waits_for_in_flight(fake):
    # the stream is held by the fake after its first events until the test lets it go: it is
    # in flight for as long as the checks below take
    fake.mode, fake.events, fake.interval = "sse", 20, 0.01
    release = fake.hold = threading.Event()
    fake.hold_after = 3
    with serve_front(fake.base_url, fake.api_key, cfg(stream_stall_s=60.0)) as (srv, _):
        with cf.ThreadPoolExecutor(2) as pool:
            inflight = pool.submit(post, srv.url, {"stream": True, "messages": []})
            try:
                wait_for("the stream forwarded", lambda: srv.front.forwarding == 1, 10,
                         every=0.02)
                drained = pool.submit(srv.call, lambda: srv.front.drain(25))
                wait_for("the drain begun", lambda: srv.front.draining, 10, every=0.02)
                r = post(srv.url, {"messages": []})
                assert r.status_code == 503 and r.headers["retry-after"]
                assert httpx.get(srv.url + "/readyz").status_code == 503
                assert not drained.done(), "the drain ended with a stream in flight"
            finally:
                release.set()
            done = inflight.result()
            drained.result()
        assert sse_events(done.content)[-1] == "[DONE]"
        assert srv.front.inflight == 0


# --------------------------------------------------------------------------- GPU telemetry


def test_gpu_readings_reach_metrics_and_healthz(fake, monkeypatch):
    """Recorded NVML answers of an H200 go through the front's NVML session into both pages."""
    from mtpwrap.decide import hardware
    from mtpwrap.decide.nvml_replay import RecordedNvml
    from tests.helpers import load_snapshot as load

    expected = hardware.NvmlSession(RecordedNvml(load("h200"))).readings()[0]
    monkeypatch.setattr(hardware, "_load_nvml", lambda: (RecordedNvml(load("h200")), None))
    with serve_front(fake.base_url, fake.api_key, cfg()) as (srv, _):
        assert metric(srv.url, "mtpwrap_gpu_memory_total_bytes", gpu="0") == \
            expected.memory_total
        assert metric(srv.url, "mtpwrap_gpu_temperature_celsius") == expected.temperature_c
        util = metric(srv.url, "mtpwrap_gpu_utilization_ratio")
        assert util == pytest.approx(expected.utilization_gpu / 100)
        gpu = HTTP.get(srv.url + "/healthz", headers=AUTH).json()["gpu"][0]
        assert gpu["memory_total_bytes"] == expected.memory_total
        assert gpu["temperature_c"] == expected.temperature_c


def test_no_gpu_module_or_no_gpu_is_not_an_error(fake, monkeypatch):
    from mtpwrap.decide import hardware

    monkeypatch.setattr(hardware, "_load_nvml",
                        lambda: (None, "the nvidia-ml-py package (pynvml) is not installed"))
    with serve_front(fake.base_url, fake.api_key, cfg()) as (srv, _):
        text = HTTP.get(srv.url + "/metrics", headers=AUTH).text
        assert "mtpwrap_requests_total" in text and "mtpwrap_gpu_memory" not in text
        assert "mtpwrap_gpu_reading_fresh 0.0" in text
        health = HTTP.get(srv.url + "/healthz", headers=AUTH).json()
        assert health["gpu"] == [] and health["gpu_read"]["state"] == "unavailable"
        assert "pynvml" in health["gpu_read"]["reason"]


def test_the_chunk_gap_histogram_reads_like_prometheus_clients_own():
    """The relay's per-chunk histogram (one bisect per chunk) exposes the same samples as a
    prometheus_client Histogram given the same observations, bucket edges included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from mtpwrap.front.metrics import _ITL_BUCKETS, GapHistogram

    gaps = [0.0, 0.0005, 0.0007, 0.01, 0.0100001, 0.3, 5, 7.5, 0.02, 0.02]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = GapHistogram("mtpwrap_inter_token_seconds", "gaps", _ITL_BUCKETS)
    ours.register(fast)
    ref = Histogram("mtpwrap_inter_token_seconds", "gaps", ["route"], buckets=_ITL_BUCKETS,
                    registry=theirs)
    for route in ("/v1/chat/completions", "/completion"):
        fast.labels(route).observe_many(gaps)
        for g in gaps:
            ref.labels(route).observe(g)

    def samples(reg):
        return sorted(line for line in generate_latest(reg).decode().splitlines()
                      if line and not line.startswith("#") and "_created" not in line)

    assert samples(ours) == samples(theirs)
    assert any('le="0.0005"' in s and s.endswith(" 2.0") for s in samples(ours))


# ------------------------------------------- every path through the relay ends once, recorded


#: the routes drawn: generations, routes that take a slot and never stream, one that counts
#: tokens and runs no model
_ROUTES = (CHAT, "/completion", "/v1/embeddings", "/v1/rerank", "/v1/messages/count_tokens")
#: the key the property's requests use: a token budget, so each reserves what it may cost
_METERED = f"{KEY}-metered"


def _recorded(url: str) -> dict[str, float]:
    """mtpwrap_requests_total of the drawn routes, by status."""
    text = HTTP.get(url + "/metrics", headers=AUTH).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "mtpwrap_requests_total" and s.labels.get("route") in _ROUTES:
                out[s.labels["status"]] = out.get(s.labels["status"], 0.0) + s.value
    return out


#: (the fake's mode, whether the client asks for a stream, after how many reads it closes)
_CASES = [(mode, stream, None)
          for mode in ("sse", "truncate", "reset", "json", "late_error", "cut_error",
                       "stall_after",
                       "stall_before_headers", "close_without_response")
          for stream in (True, False)] + [("endless", True, n) for n in (1, 2, 3)]


# a failure is shown as found: shrinking would replay whole runs of live requests
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(st.data())
def test_every_request_through_the_fault_relay_ends_once_with_the_status_the_client_saw(
        data: st.DataObject) -> None:
    """Faults of llama-server (a cut, a reset, a stall before and after the head, an error
    after the front's keep-alive head, an error whose body is cut, a close without an
    answer) and of the client (gone mid-stream), every one of them in orders drawn anew, on
    one front, each on a route drawn, its answer saying its counts or not: each request is
    recorded exactly once, with the status its client saw (the code of the error event that
    ended its stream, 499 for a client that left, a 5xx for a body left cut), and charged no
    less than llama-server computed: its counts where its whole answer said them, else never
    less than a prompt token and the token events its client got; nothing where llama-server
    made no answer or the route runs no model."""
    fake = FakeUpstream(events=3, interval=0.02, cut_after=1).start()
    try:
        config = cfg(keepalive_s=0.2, stream_stall_s=0.8, prefill_stall_s=0.8,
                     api_keys=(KEY, f"{_METERED} name=metered tokens_per_day=1000000000"))
        with serve_front(fake.base_url, fake.api_key, config) as (srv, _):
            order = data.draw(st.permutations(_CASES), label="order")
            made = len(order)
            for mode, stream, close_after in order:
                route = data.draw(st.sampled_from(_ROUTES), label="route")
                fake.usage = data.draw(st.sampled_from([None, {"prompt_tokens": 7,
                                                               "completion_tokens": 3}]))
                fake.mode = mode
                fake.interval = 0.5 if mode in ("late_error", "cut_error") else 0.02
                before = _recorded(srv.url)
                ended = counted(srv.url, "mtpwrap_key_requests_total", key="metered")
                spent = counted(srv.url, "mtpwrap_key_tokens_total", key="metered")
                got, cut = b"", False
                with HTTP.stream("POST", srv.url + route, timeout=10,
                                 headers={"authorization": f"Bearer {_METERED}"},
                                 json={"stream": stream, "messages": []}) as r:
                    try:
                        for i, chunk in enumerate(r.iter_raw(), 1):
                            got += chunk
                            if close_after is not None and i >= close_after:
                                break
                    except httpx.RemoteProtocolError:
                        cut = True
                    status = r.status_code
                    sse = r.headers.get("content-type", "").startswith("text/event-stream")
                events = sse_events(got) if sse and close_after is None else []
                last = json.loads(events[-1]) if events and events[-1] != "[DONE]" else {}
                if close_after is not None:
                    saw = {499}
                elif isinstance(last.get("error"), dict):
                    saw = {last["error"]["code"]}
                elif cut:
                    saw = {502, 504}
                else:
                    saw = {status}

                def recorded(before: dict[str, float] = before) -> bool:
                    return sum(_recorded(srv.url).values()) > sum(before.values())

                wait_for(f"{mode}: the request recorded", recorded, 10, every=0.05)
                after = _recorded(srv.url)
                assert sum(after.values()) == sum(before.values()) + 1, (mode, before, after)
                grew = {int(k) for k, v in after.items() if v != before.get(k, 0.0)}
                assert len(grew) == 1 and grew <= saw, (mode, stream, close_after, grew, saw)
                wait_for(f"{mode}: the request charged", lambda e=ended: counted(
                    srv.url, "mtpwrap_key_requests_total", key="metered") > e, 10, every=0.05)
                charged = counted(srv.url, "mtpwrap_key_tokens_total", key="metered") - spent
                received = sum('"delta":{"content"' in e for e in sse_events(got))
                case = (mode, stream, close_after, route, fake.usage, charged, received)
                if route == "/v1/messages/count_tokens" or mode not in (
                        "sse", "json", "truncate", "reset", "stall_after", "endless"):
                    assert charged == 0, case
                elif fake.usage and mode in ("sse", "json") and status == 200 and not cut:
                    assert charged == 10, case
                else:
                    assert charged >= 1 + (received if route == CHAT else 0), case
            # none recorded twice: a late second record of the last one would show here
            fake.mode = "json"
            assert post(srv.url, {"messages": []}).status_code == 200
            wait_for("the last request recorded",
                     lambda: sum(_recorded(srv.url).values()) >= made + 1, 10, every=0.05)
            assert sum(_recorded(srv.url).values()) == made + 1
    finally:
        fake.stop()


def test_a_prompt_is_counted_once_however_often_it_is_sampled(fake):
    """The status page, the queue and the stall check each ask how long the prompt in the slot
    is: llama-server's tokenizer is asked once per request, and a count that failed is
    remembered, not asked again at every sample (each ask tokenizes up to the whole context)."""
    fake.mode, fake.slot_read, fake.tokenizer_fails = "stall_before_headers", 512, True
    with serve_front(fake.base_url, fake.api_key,
                     cfg(prefill_stall_s=2.0, keepalive_s=0.3)) as (srv, _), \
            cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, srv.url, {"stream": True, "messages": [
            {"role": "user", "content": "a long document"}]})
        wait_for("the request forwarded",
                 lambda: any(s.path == "/v1/chat/completions" for s in fake.seen), 10)
        for _ in range(5):
            assert HTTP.get(srv.url + "/status.json", headers=AUTH).status_code == 200
        r = answer.result(30)  # cut by the stall budget: the audit charges its prompt too
    assert json.loads(sse_events(r.content)[-1])["error"]["code"] == 504
    asks = [s.path for s in fake.seen if s.path in ("/apply-template", "/tokenize")]
    assert asks == ["/apply-template"], asks


def test_a_keep_alive_comment_to_a_client_that_stopped_reading_is_cut_at_the_write_budget(
        fake):
    """A client that stopped reading once an answer filled its buffers: uvicorn's send of the
    next write waits for room that never comes. The keep-alive comment written while
    llama-server is quiet waits so too (the fault is that send, made to wait here); it has the
    write budget as any write has, so the request is cut as a slow reader and llama-server is
    let go, instead of the watch waiting on it for good with the send lock held."""
    import asyncio

    from mtpwrap.front.app import Front
    from tests.fakes.front_harness import FrontServer, SupervisorDouble

    fake.mode, fake.cut_after = "stall_after", 2  # two events, then quiet
    commented = threading.Event()
    sup = SupervisorDouble(fake.base_url, fake.api_key)

    def make() -> Front:
        front = Front(sup, cfg(keepalive_s=0.2, write_timeout_s=1.0, stream_stall_s=60,
                               prefill_stall_s=60), None)
        inner = front.app

        async def app(scope, receive, send):  # type: ignore[no-untyped-def]
            async def full(message):  # type: ignore[no-untyped-def]
                if message.get("body", b"").startswith(b": keep-alive"):
                    commented.set()
                    await asyncio.Event().wait()  # no room in the buffer, ever
                await send(message)
            await inner(scope, receive, full)

        front.app = app  # type: ignore[assignment]
        return front

    srv = FrontServer(make, free_port(), sup).start()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, srv.url, {"stream": True, "messages": []})
            assert commented.wait(10), "no keep-alive comment was written"
            assert fake.wait_closed(0, 10) is not None, "llama-server was never let go"
            wait_for("the cut counted", lambda: counted(
                srv.url, "mtpwrap_cancelled_total", reason="slow_reader") >= 1, 5)
            with contextlib.suppress(httpx.HTTPError):
                answer.result(10)
    finally:
        srv.stop()

