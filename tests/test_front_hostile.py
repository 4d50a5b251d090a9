"""The front under hostile input: every request below is one anyone can send.

The first part runs the front over a recording fake upstream (what reached the child, what was
read of a socket); the second sends every case to a real `mtpwrap up --profile cpu-demo` with
API keys and the real llama-server, then checks that the instance is still ready, its memory and
file descriptors bounded and its log free of tracebacks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpwrap.config.objects import ProxyConfig
from tests.fakes.fake_upstream import FakeUpstream
from tests.fakes.front_harness import serve_front
from tests.helpers import wait_for

KEY = "client-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    f = FakeUpstream(mode="json").start()
    yield f
    f.stop()


def _cfg(**kw: object) -> ProxyConfig:
    base: dict[str, object] = {"api_keys": (KEY,), "header_timeout_s": 1.0, "idle_timeout_s": 2.0,
                               "max_predict": 256}
    base.update(kw)
    return ProxyConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def front(fake: FakeUpstream) -> Iterator[object]:
    from mtpwrap.front.info import ServeInfo

    with serve_front(fake.base_url, fake.api_key, _cfg(), ServeInfo(n_vocab=1000)) as (srv,
                                                                                     _sup):
        yield srv


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_all(s: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `timeout` passes (False)."""
    s.settimeout(timeout)
    data = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            chunk = s.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return data, True
    except TimeoutError:
        pass
    return data, False


def _status(raw: bytes) -> int:
    m = re.match(rb"HTTP/1\.1 (\d{3})", raw)
    assert m, raw[:200]
    return int(m.group(1))


def _json_of(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


# --------------------------------------------------------------------------- 1: bodies


DEEP = b"[" * 1000 + b"]" * 1000
CASES_400 = [
    # tools and tool calls llama-server cannot read: a 500 there
    ("/v1/chat/completions", b'{"messages": [], "tools": {"a": 1}}',
     "tools must be an array, got a JSON object"),
    ("/v1/chat/completions", b'{"messages": [], "tools": [{"type": "custom", "custom": {}}]}',
     'tools[0].type must be "function" (the only tool type llama-server has), got'
     ' "custom".'),
    ("/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{}]}]}',
     "messages[0].tool_calls[0].type must be"),
    # a reasoning format llama.cpp does not name: its runtime error, a 500 (found by make fuzz)
    ("/apply-template", '{"messages": [], "reasoning_format": "\U000f703d"}'.encode(),
     "reasoning_format must be one of none, auto, deepseek, deepseek-legacy, got"),
    ("/v1/chat/completions", b'{"messages": [], "reasoning_format": null}',
     "reasoning_format must be one of none, auto, deepseek, deepseek-legacy, got a JSON null"),
    ("/completion", b'{"prompt": "x", "n": ' + DEEP + b"}", "nested more than"),
    ("/completion", b'{"prompt": "x", "n_probs": NaN}', "NaN"),
    ("/completion", b'{"prompt": "x", "n_probs": Infinity}', "Infinity"),
    ("/completion", b'{"prompt": "x", "n_probs": 1e400}', "finite"),
    ("/completion", b'{"prompt": "x", "n_discard": NaN}', "NaN"),
    ("/completion", b'{"prompt": "x", "seed": ' + b"9" * 4301 + b"}", "4301 digits"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 49152}', "logprobs must be 0..100"),
    ("/v1/chat/completions", b'{"messages": [], "logprobs": true, "top_logprobs": 49152}',
     "top_logprobs must be 0..100"),
    ("/v1/chat/completions", b'{"messages": [], "n": 4}', "n must be 1..1"),
    ("/v1/chat/completions", b'{"messages": [], "max_completion_tokens": 100000}',
     "max_completion_tokens must be 0..256"),
    ("/completion", b'{"prompt": "x", "n_predict": -5}', "n_predict must be 0..256"),
    ("/completion", b'{"prompt": "x", "n_predict": -1}', "n_predict must be 0..256"),
    # Python's json reads these, llama-server's parser does not (or reads them differently)
    ("/completion", b'{"prompt": "x", "n_probs": 1, "n_probs": 100000}', "twice"),
    ("/completion", b'{"prompt": "x \\ud800 y"}', "lone UTF-16 surrogate"),
    ("/completion", b'{"prompt": ["\\udc00"]}', "lone UTF-16 surrogate"),
    ("/completion", '{"prompt": "x"}'.encode("utf-16-le"), "not valid JSON"),
    ("/completion", '{"prompt": "x"}'.encode("utf-16"), "not valid UTF-8"),
    ("/completion", b'{"prompt": "x", "seed": -' + b"1" * 400 + b"}", "400 digits"),
    # a body llama-server reads as one object, and answers a 500 for anything else
    ("/tokenize", b"", "the body is empty"),
    ("/v1/messages", b'"x"', "got a JSON string"),
    ("/v1/chat/completions", b"[]", "got a JSON array"),
    ("/detokenize", b"null", "got a JSON null"),
    # token ids outside the vocabulary (the front knows its size from the model's header)
    ("/detokenize", b'{"tokens": [1, 4294967295]}', "outside this model's vocabulary"),
    ("/detokenize", b'{"tokens": [-1]}', "outside this model's vocabulary"),
    ("/v1/completions", b'{"prompt": [-1]}', "outside this model's vocabulary"),
    ("/completion", b'{"prompt": [[1, 2], [100000]]}', "outside this model's vocabulary"),
    ("/completion", b'{"prompt": "x", "logit_bias": {"100000": 1}}', "logit_bias"),
    ("/completion", b'{"prompt": "x", "logit_bias": [[500000, 1]]}', "logit_bias"),
    # what crashes llama-server's grammar parser (llama.cpp issue #26600)
    ("/completion", b'{"prompt": "x", "grammar": "root ::= ' + b"(" * 300 + b'\\"a\\"'
     + b")" * 300 + b'"}', "grammar nests 300 groups deep"),
]


@pytest.mark.parametrize("path,body,needle", CASES_400,
                         ids=[f"{p}-{n[:18]}" for p, _b, n in CASES_400])
def test_bodies_the_front_cannot_accept_get_a_json_400(fake: FakeUpstream, front: object,
                                                       path: str, body: bytes,
                                                       needle: str) -> None:
    r = httpx.post(front.url + path, content=body,  # type: ignore[attr-defined]
                   headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert fake.seen == []


def test_what_the_front_accepts_passes_byte_for_byte(fake: FakeUpstream, front: object) -> None:
    bodies = [b'{"tokens": [0, 999]}', b'{"prompt": "x \\ud83d\\ude00", "logit_bias": {"hi": 1}}',
              b'{"prompt": "x", "grammar": "root ::= (((\\"(\\"))) [(]"}',
              b'\xef\xbb\xbf{"prompt": [1, 2, "x"], "unknown_field": {"a": [1e300]}}']
    for body in bodies:
        r = httpx.post(front.url + "/completion", content=body,  # type: ignore[attr-defined]
                       headers={**AUTH, "content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-mtpwrap-answered-by"] == "llama-server"
    # a function tool and a call of one; Anthropic's tools, which have no type
    chat = [("/v1/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{"id":'
             b' "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],'
             b' "tools": [{"type": "function", "function": {"name": "f"}}]}'),
            ("/v1/messages", b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user",'
             b' "content": "hi"}], "tools": [{"name": "f", "input_schema": {}}]}')]
    for path, body in chat:
        r = httpx.post(front.url + path, content=body,  # type: ignore[attr-defined]
                       headers={**AUTH, "content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text
    assert [seen.body for seen in fake.seen] == bodies + [b for _, b in chat]


def test_every_answer_says_who_made_it(fake: FakeUpstream, front: object) -> None:
    url = front.url  # type: ignore[attr-defined]
    made_by_front = [
        httpx.get(url + "/livez"), httpx.get(url + "/readyz"),
        httpx.get(url + "/healthz", headers=AUTH), httpx.get(url + "/metrics", headers=AUTH),
        httpx.get(url + "/nowhere", headers=AUTH), httpx.get(url + "/v1/models"),
        httpx.post(url + "/completion", headers=AUTH, content=b"{"),
        httpx.get(url + "/slots", headers=AUTH),
    ]
    for r in made_by_front:
        assert r.headers["x-mtpwrap-answered-by"] == "front", (r.request.url, r.status_code)
    s = _connect(url)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n")
    data, _closed = _read_all(s, 5)
    s.close()
    assert _status(data) == 431 and b"x-mtpwrap-answered-by: front" in data
    r = httpx.get(url + "/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.headers["x-mtpwrap-answered-by"] == "llama-server"


def test_a_key_that_is_not_ascii_is_refused_not_crashed(front: object) -> None:
    # (hmac.compare_digest raises TypeError on a str that is not ASCII: keys are bytes)
    for key, status in (("ключ-0123456789", 401), ("k\udcff", 401), ("\x7f", 400)):
        r = httpx.get(front.url + "/v1/models",  # type: ignore[attr-defined]
                      headers=[(b"authorization", b"Bearer " + key.encode("utf-8",
                                                                            "surrogateescape"))])
        assert r.status_code == status and r.headers["x-mtpwrap-answered-by"] == "front"


def test_limits_hold_whatever_the_content_type_claims(fake: FakeUpstream, front: object) -> None:
    for ctype in ("multipart/mixed; boundary=x", "text/plain", "application/x-www-form-urlencoded",
                  ""):
        r = httpx.post(front.url + "/completion",  # type: ignore[attr-defined]
                       content=b'{"n_predict": 16, "n_probs": 49152}',
                       headers={**AUTH, "content-type": ctype}, timeout=30)
        assert r.status_code == 400 and "n_probs must be 0..100" in r.text, ctype
    assert fake.seen == []


def test_anthropic_path_gets_an_anthropic_shaped_error(fake: FakeUpstream, front: object) -> None:
    r = httpx.post(front.url + "/v1/messages", content=b'{"max_tokens": NaN}',  # type: ignore
                   headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert "NaN" in doc["error"]["message"]


def test_only_what_llama_server_needs_is_forwarded(fake: FakeUpstream, front: object) -> None:
    headers = {**AUTH, "content-type": "application/json", "x-forwarded-for": "10.0.0.1",
               "cookie": "a=b", "x-custom": "1", "user-agent": "probe/1"}
    r = httpx.post(front.url + "/v1/chat/completions", json={"messages": []},  # type: ignore
                   headers=headers, timeout=30)
    assert r.status_code == 200
    sent = fake.seen[-1].headers
    assert sent["content-type"] == "application/json" and sent["user-agent"] == "probe/1"
    for name in ("x-forwarded-for", "cookie", "x-custom"):
        assert name not in sent


# --------------------------------------------------------------------------- 3-5, 8: connections


def test_a_silent_socket_and_a_half_sent_head_are_closed(front: object) -> None:
    silent = _connect(front.url)  # type: ignore[attr-defined]
    half = _connect(front.url)  # type: ignore[attr-defined]
    half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    t0 = time.monotonic()
    data, closed = _read_all(half, 5)
    assert closed and time.monotonic() - t0 < 3
    assert _status(data) == 408 and "did not arrive within 1 s" in _json_of(data)["error"][
        "message"]
    _data, closed = _read_all(silent, 3)
    assert closed
    silent.close()
    half.close()


def test_idle_keep_alive_ends(front: object) -> None:
    s = _connect(front.url)  # type: ignore[attr-defined]
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data, closed = _read_all(s, 4)
    assert _status(data) == 200 and closed  # the 2 s idle timeout, not the 4 s wait
    s.close()


def test_a_keyless_upload_is_refused_without_reading_it(fake: FakeUpstream,
                                                        front: object) -> None:
    s = _connect(front.url)  # type: ignore[attr-defined]
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: 209715200\r\n\r\n")
    data, _closed = _read_all(s, 2)
    assert _status(data) == 401 and b"connection: close" in data.lower()
    sent = 0
    chunk = b"x" * 65536
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        while sent < 200 * 2**20 and time.monotonic() - t0 < 20:
            s.sendall(chunk)
            sent += len(chunk)
    assert sent < 32 * 2**20, f"the front read {sent} bytes of a refused upload"
    s.close()
    assert fake.seen == []


def test_content_length_with_transfer_encoding_is_400_and_closed(front: object) -> None:
    s = _connect(front.url)  # type: ignore[attr-defined]
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 4\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    data, closed = _read_all(s, 3)
    assert _status(data) == 400 and closed
    assert data.split(b"\r\n\r\n", 1)[1].startswith(b'{"error"')
    s.close()


@pytest.mark.parametrize("how", ["one write", "byte by byte"])
def test_too_many_or_too_large_headers_get_431_however_they_arrive(front: object,
                                                                   how: str) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(100))
    large = b"X-Large: " + b"a" * 40000 + b"\r\n"
    for extra, needle in ((many, b"more than 64 headers"), (large, b"larger than 32768 bytes")):
        s = _connect(front.url)  # type: ignore[attr-defined]
        head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + b"\r\n"
        try:
            if how == "one write":
                s.sendall(head)
            else:
                for i in range(0, len(head), 97):
                    s.sendall(head[i:i + 97])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before everything was sent: the answer is already there
        data, closed = _read_all(s, 3)
        assert _status(data) == 431 and needle in data and closed, data[:300]
        s.close()


def test_connections_beyond_the_limit_are_closed(fake: FakeUpstream) -> None:
    with serve_front(fake.base_url, fake.api_key, _cfg(max_connections=4,
                                                       header_timeout_s=5.0)) as (srv, _):
        held = [_connect(srv.url) for _ in range(4)]
        wait_for("the 4 connections accepted", lambda: srv.connections == 4, 5, every=0.02)
        extra = _connect(srv.url)
        _data, closed = _read_all(extra, 2)
        assert closed
        for s in held:
            s.close()
        extra.close()
        wait_for("the closes seen", lambda: srv.connections == 0, 5, every=0.02)
        assert httpx.get(srv.url + "/livez", timeout=5).status_code == 200


@pytest.mark.parametrize("head,needle", [
    (b"GET  /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"one space between"),
    (b"GET /livezHTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"one space between"),
    (b"GET /livez HTTP/0.9\r\nHost: 127.0.0.1\r\n\r\n", b"one space between"),
    (b"\nGET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"one space between"),
    (b"GET /livez HTTP/1.1\r\n\r\n", b"exactly one Host header (RFC 9112 \\u00a73.2); this one has"
     b" 0"),
    (b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: x\r\n\r\n", b"this one has 2"),
    (b"GET /livez HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", b"this one has 2"),
])
@pytest.mark.parametrize("how", ["one write", "byte by byte"])
def test_what_another_parser_reads_differently_is_refused(front: object, head: bytes,
                                                          needle: bytes, how: str) -> None:
    """llhttp reads these; h11 (and RFC 9112) do not: the front refuses them, whole or in
    bytes, rather than guess which request was meant."""
    s = _connect(front.url)  # type: ignore[attr-defined]
    try:
        if how == "one write":
            s.sendall(head)
        else:
            for b in head:
                s.sendall(bytes([b]))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before everything was sent
    data, closed = _read_all(s, 3)
    s.close()
    assert _status(data) == 400 and needle in data and closed, data[:300]
    assert b"x-mtpwrap-answered-by: front" in data


def test_what_both_parsers_read_alike_is_served(front: object) -> None:
    """HTTP/1.0 without Host, empty lines before a request, pipelined and kept-alive requests:
    read as before (a request line inside a pipelined chunk is llhttp's alone to read)."""
    for head in (b"GET /livez HTTP/1.0\r\n\r\n", b"\r\nGET /livez HTTP/1.1\r\nHost: a\r\n\r\n"):
        s = _connect(front.url)  # type: ignore[attr-defined]
        s.sendall(head + (b"" if b"1.0" in head else b"GET /livez HTTP/1.1\r\nHost: a\r\n"
                          b"Connection: close\r\n\r\n"))
        data, closed = _read_all(s, 5)
        s.close()
        assert closed and data.count(b"HTTP/1.") == (1 if b"1.0" in head else 2), data
        assert b"200 OK" in data and b" 400 " not in data
    # kept alive: the second request's line is checked as the first was
    s = _connect(front.url)  # type: ignore[attr-defined]
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: a\r\n\r\n")
    s.settimeout(5)
    first = s.recv(65536)
    s.sendall(b"GET  /livez HTTP/1.1\r\nHost: a\r\n\r\n")
    data, closed = _read_all(s, 3)
    s.close()
    assert _status(first) == 200 and _status(data) == 400 and closed


def test_a_body_trickled_below_the_minimum_rate_gets_408(fake: FakeUpstream) -> None:
    """Slowloris on the body: 1 s after the head plus 1 s per 1,000 bytes, then 408 and closed;
    a body that keeps up with the rate is read to its end however long it takes."""
    cfg = _cfg(body_timeout_s=1.0, body_min_rate=1000)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n")
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
        slow = _connect(srv.url)
        slow.sendall(head % 100_000 + b"{")
        t0 = time.monotonic()
        data, closed = b"", False
        while not data and time.monotonic() - t0 < 10:  # 10 bytes a second
            try:
                slow.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            data, closed = _read_all(slow, 0.1)
        if not closed:
            more, closed = _read_all(slow, 3)
            data += more
        took = time.monotonic() - t0
        slow.close()
        assert _status(data) == 408 and closed, data[:300]
        assert b"did not arrive in time: 1 s after the head plus 1 s per 1000 bytes" in data
        assert took < 4, took
        assert fake.seen == []
        # 3,000 bytes a second for about 2.5 s: past the first second, never below the rate
        body = b'{"messages": [{"role": "user", "content": "' + b"x" * 7400 + b'"}]}'
        ok = _connect(srv.url)
        ok.sendall(head % len(body))
        for i in range(0, len(body), 300):
            ok.sendall(body[i:i + 300])
            time.sleep(0.1)  # the client's own pace, not a synchronisation
        ok.settimeout(10)
        answer = ok.recv(65536)
        ok.close()
        assert _status(answer) == 200, answer[:300]


def _half_closed_exchange(url: str, request: bytes) -> tuple[bytes, bool]:
    """Send `request`, shut down the sending side (SHUT_WR) and read until the front closes."""
    s = _connect(url)
    s.sendall(request)
    s.shutdown(socket.SHUT_WR)
    try:
        return _read_all(s, 5)
    finally:
        s.close()


def test_a_client_that_half_closes_after_its_request_gets_the_answer() -> None:
    """shutdown(SHUT_WR) after a complete request: the answer comes, then the close, and
    nothing the client did not ask for (no interim `100 Continue`) — for HTTP/1.1 and 1.0, a
    plain answer that is slow to come and a stream, one request or two pipelined."""
    slow = FakeUpstream(mode="slow_json", interval=0.3).start()
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    post = (b"POST /v1/chat/completions HTTP/1.%d\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\nContent-Length: %d\r\nContent-Type: application/json\r\n"
            b"\r\n%s")
    try:
        with serve_front(slow.base_url, slow.api_key, _cfg()) as (srv, _):
            for version in (1, 0):
                data, closed = _half_closed_exchange(srv.url, post % (version, len(body), body))
                assert b"100 Continue" not in data, data[:200]
                assert _status(data) == 200 and data.endswith(b'{"ok": true}') and closed, data
                assert data.count(b"HTTP/1.1 ") == 1, data
            # two pipelined: both answered, in order, then the close
            data, closed = _half_closed_exchange(
                srv.url, post % (1, len(body), body) + post % (1, len(body), body))
            assert b"100 Continue" not in data and closed, data[:200]
            assert data.count(b"HTTP/1.1 200 OK") == 2 and data.endswith(b'{"ok": true}'), data
            assert len(slow.seen) == 4
            # half a request and then EOF: closed without an answer, nothing forwarded
            data, closed = _half_closed_exchange(
                srv.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 99\r\n\r\n{")
            assert closed and data == b"" and len(slow.seen) == 4
            # none of them is left open on the front's side
            wait_for("the connections closed", lambda: srv.connections == 0, 5, every=0.02)
    finally:
        slow.stop()
    streams = FakeUpstream(mode="sse", events=5, interval=0.1).start()
    try:
        with serve_front(streams.base_url, streams.api_key, _cfg()) as (srv, _):
            chat = b'{"messages": [], "stream": true}'
            data, closed = _half_closed_exchange(srv.url, post % (1, len(chat), chat))
            assert b"100 Continue" not in data and closed, data[:200]
            assert _status(data) == 200 and b"data: [DONE]" in data, data
    finally:
        streams.stop()


def test_a_bad_request_pipelined_behind_one_in_progress_closes_cleanly(
        front: object, caplog: pytest.LogCaptureFixture) -> None:
    """The first request is still being answered (here: refused for its missing key) when the
    second, unreadable, is parsed: the front answers 400 and closes; the first's answer is
    dropped with the connection, and nothing fails inside the front."""
    for first in (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                  b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                  + KEY.encode() + b"\r\n\r\n"):
        s = _connect(front.url)  # type: ignore[attr-defined]
        s.sendall(first + b"GET /livez HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        data, closed = _read_all(s, 5)
        s.close()
        assert b" 400 Bad Request" in data and closed, data[:300]
    assert httpx.get(front.url + "/livez", timeout=5).status_code == 200  # type: ignore
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_an_answer_sent_before_the_body_was_read_is_not_lost_to_a_reset(
        fake: FakeUpstream) -> None:
    """The front answers 413 to a 3 MiB body at its head and closes: without a lingering close
    the unread bytes make the kernel reset the connection, and the client, which reads only
    after it has sent everything (as most do), gets ECONNRESET on its send instead of the 413.
    (A small send buffer keeps the body from fitting in the kernel's buffers at once.)"""
    with serve_front(fake.base_url, fake.api_key, _cfg(max_body_bytes=2**20)) as (srv, _):
        host, port = srv.url.removeprefix("http://").split(":")
        for _ in range(3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
            s.settimeout(10)
            s.connect((host, int(port)))
            body = b"{" + b" " * (3 * 2**20) + b"}"
            try:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d"
                          b"\r\nContent-Type: application/json\r\n\r\n%s" % (len(body), body))
                data, closed = _read_all(s, 5)
            except (BrokenPipeError, ConnectionResetError) as e:
                pytest.fail(f"the connection was reset before the answer was read: {e!r}")
            finally:
                s.close()
            assert _status(data) == 413 and closed, data[:300]
    assert fake.seen == []


def test_probes_answer_any_host_and_the_rest_does_not(front: object) -> None:
    for path in ("/livez", "/readyz"):
        r = httpx.get(front.url + path, headers={"host": "10.1.2.3:8080"}, timeout=5)  # type: ignore
        assert r.status_code == 200, path
    r = httpx.get(front.url + "/v1/models", headers={**AUTH, "host": "10.1.2.3:8080"},  # type: ignore
                  timeout=5)
    assert r.status_code == 421


# --------------------------------------------------------------------------- 6, 7: load, drain


@pytest.mark.slow
def test_the_front_sends_no_more_than_the_slots_and_queues_the_rest() -> None:
    # the streams are held by the fake after their head until all eight have arrived: two
    # forwarded and six queued is a state the front cannot leave while the test looks
    release = threading.Event()
    slow = FakeUpstream(mode="sse", events=20, interval=0.05, hold=release).start()
    try:
        with serve_front(slow.base_url, slow.api_key,
                         _cfg(max_concurrency=2, queue_size=8, queue_timeout_s=120.0)) as (srv,
                                                                                          _):
            def stream() -> int:
                with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                                  json={"messages": [], "stream": True}, timeout=60) as r:
                    r.read()
                    return r.status_code
            with cf.ThreadPoolExecutor(8) as pool:
                futs = [pool.submit(stream) for _ in range(8)]
                peak = {"active": 0, "queued": 0}

                def sampled_until_done() -> bool:
                    peak["active"] = max(peak["active"], srv.front.forwarding)
                    peak["queued"] = max(peak["queued"], srv.front.queued)
                    # requests that do not take a slot are not stuck behind the streams
                    assert httpx.get(srv.url + "/v1/models", headers=AUTH,
                                     timeout=1).status_code == 200
                    return all(f.done() for f in futs)

                try:
                    wait_for("2 forwarded and 6 queued", lambda: srv.front.forwarding == 2
                             and srv.front.queued == 6, 30, every=0.01)
                    assert not sampled_until_done()  # sampled while held: none can be done
                finally:
                    release.set()
                wait_for("the 8 streams done", sampled_until_done, 60, every=0.01)
                assert [f.result() for f in futs] == [200] * 8
            assert peak["active"] == 2 and peak["queued"] == 6
            metrics = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=5).text
            waited = {s.name: s.value for f in text_string_to_metric_families(metrics)
                      for s in f.samples}["mtpwrap_queue_wait_seconds_count"]
            assert waited >= 6  # 8 streams on 2 slots: 6 waited in the front's queue
    finally:
        slow.stop()


def test_a_drain_that_runs_out_stops_open_streams_with_a_shutdown_event() -> None:
    endless = FakeUpstream(mode="sse", events=100000, interval=0.05).start()
    try:
        with serve_front(endless.base_url, endless.api_key, _cfg()) as (srv, _):
            got: list[bytes] = []

            def stream() -> None:
                with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH,
                                  json={"messages": [], "stream": True}, timeout=30) as r:
                    for chunk in r.iter_raw():
                        got.append(chunk)
            with cf.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(stream)
                wait_for("the stream flowing", lambda: bool(got), 10, every=0.02)
                t0 = time.monotonic()
                srv.call(lambda: srv.front.drain(1.0))
                took = time.monotonic() - t0
                fut.result(10)
            tail = b"".join(got).rstrip().rsplit(b"\n\n", 1)[-1]
            event = json.loads(tail.removeprefix(b"data: "))
            assert event["error"]["code"] == 503 and "shutting down" in event["error"]["message"]
            assert took < 2.5
            # the upstream connection is closed too
            wait_for("the upstream closed", lambda: all(s.closed_at is not None
                                                        for s in endless.seen), 5, every=0.02)
    finally:
        endless.stop()


# --------------------------------------------------------------------------- the real thing


@pytest.mark.integration
class TestAgainstTheRealServer:
    """Every case above, sent to `mtpwrap up` and the real llama-server."""

    @pytest.fixture(scope="class")
    @classmethod
    def inst(cls, tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
             demo_model: Path) -> Iterator[object]:
        from mtpwrap.proc import free_loopback_port
        from tests.helpers import Instance

        home = tmp_path_factory.mktemp("hostile")
        cfg = home / "mtpwrap.yaml"
        cfg.write_text("proxy:\n  header_timeout_s: 2\n  idle_timeout_s: 3\n"
                       "  max_predict: 256\n  max_connections: 256\n"
                       "  queue_timeout_s: 180\n")  # a busy 2-core machine is slow
        inst = Instance(home / "home", free_loopback_port(), llama_server_bin, demo_model,
                        MTPWRAP_API_KEYS=KEY, MTPWRAP_CONFIG=str(cfg))
        try:
            inst.wait_ready()
            yield inst
        finally:
            inst.close()

    def _rss_fds(self, pid: int) -> tuple[int, int]:
        p = psutil.Process(pid)
        return p.memory_info().rss, p.num_fds()

    def test_every_hostile_case_then_still_ready_and_bounded(self, inst: object) -> None:
        base = inst.base  # type: ignore[attr-defined]
        pid = inst.proc.pid  # type: ignore[attr-defined]
        child = inst.status()[1]["child_pid"]  # type: ignore[attr-defined]
        # warm up, then measure
        httpx.post(base + "/completion", headers=AUTH, json={"prompt": "Hi", "n_predict": 2},
                   timeout=60)
        rss0, fds0 = self._rss_fds(pid)
        child_rss0 = psutil.Process(child).memory_info().rss
        silent: list[socket.socket] = []
        for _round in range(3):
            for path, body, needle in CASES_400:
                r = httpx.post(base + path, content=body, timeout=60,
                               headers={**AUTH, "content-type": "application/json"})
                assert r.status_code == 400 and needle in r.json()["error"]["message"], path
            r = httpx.post(base + "/completion", content=b'{"n_predict": 16, "n_probs": 49152}',
                           headers={**AUTH, "content-type": "multipart/mixed; boundary=x"},
                           timeout=60)
            assert r.status_code == 400
            silent += [_connect(base) for _ in range(50)]  # connect and say nothing
            s = _connect(base)
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
            data, closed = _read_all(s, 5)
            assert _status(data) == 400 and closed
            s.close()
            s = _connect(base)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      + b"".join(b"X-H%d: v\r\n" % i for i in range(100)) + b"\r\n")
            data, closed = _read_all(s, 5)
            assert _status(data) == 431 and closed
            s.close()
        for s in silent:  # each closed by the 2 s head deadline
            _data, closed = _read_all(s, 5)
            assert closed
            s.close()
        assert httpx.get(base + "/readyz", timeout=5).status_code == 200
        r = httpx.post(base + "/completion", headers=AUTH, json={"prompt": "Hi", "n_predict": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] > 0
        rss1, fds1 = self._rss_fds(pid)
        assert fds1 <= fds0 + 8, (fds0, fds1)
        assert rss1 < rss0 + 64 * 2**20, (rss0, rss1)
        assert psutil.Process(child).memory_info().rss < child_rss0 + 128 * 2**20

    def test_eight_streams_on_two_slots_never_wait_inside_llama_server(self,
                                                                       inst: object) -> None:
        base = inst.base  # type: ignore[attr-defined]

        async def run() -> tuple[list[int], float | None]:
            peak: float | None = None
            async with httpx.AsyncClient(timeout=300) as client:
                async def one() -> int:
                    async with client.stream(
                            "POST", base + "/v1/chat/completions", headers=AUTH,
                            json={"messages": [{"role": "user", "content": "Count to twenty."}],
                                  "max_tokens": 24, "stream": True}) as r:
                        await r.aread()
                        return r.status_code
                tasks = [asyncio.ensure_future(one()) for _ in range(8)]
                while not all(t.done() for t in tasks):
                    text = (await client.get(base + "/metrics", headers=AUTH)).text
                    m = re.search(r"^mtpwrap_backend_requests_deferred(?:\{[^}]*\})? (\S+)$",
                                  text, re.M)
                    if m:
                        peak = max(peak or 0.0, float(m.group(1)))
                    await asyncio.wait(tasks, timeout=0.05)  # the next sample, or all done
                return [t.result() for t in tasks], peak
        codes, deferred = asyncio.run(run())
        assert codes == [200] * 8
        assert deferred == 0.0  # read from llama-server's own page (None: never seen)

    def test_no_traceback_in_the_log(self, inst: object) -> None:
        # last in the class: everything above has been sent by now
        inst.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        assert inst.proc.wait(60) == 0  # type: ignore[attr-defined]
        out = inst.output()  # type: ignore[attr-defined]
        assert "Traceback" not in out and "Internal Server Error" not in out
        assert "internal error" not in out


@pytest.mark.integration
def test_drain_grace_leaves_rotation_before_refusing(tmp_path: Path, llama_server_bin: Path,
                                                     demo_model: Path, free_port: int) -> None:
    from tests.helpers import Instance

    # the grace is a timer of mtpwrap's (nothing outside can hold it): long enough that the
    # checks below, made while it runs, fit in it on a loaded machine
    grace = 6.0
    inst = Instance(tmp_path / "home", free_port, llama_server_bin, demo_model,
                    MTPWRAP_DRAIN_GRACE_S=f"{grace:g}", MTPWRAP_DRAIN_S="2")
    try:
        inst.wait_ready()
        os.kill(inst.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        wait_for("readiness dropping",
                 lambda: httpx.get(inst.base + "/readyz", timeout=5).status_code != 200, 10,
                 every=0.05)
        assert httpx.get(inst.base + "/readyz", timeout=5).json()["status"] == "draining"
        # out of rotation, still serving: a request that arrives now is answered
        r = httpx.post(inst.base + "/completion", json={"prompt": "Hi", "n_predict": 2},
                       timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < grace
        assert inst.proc.wait(60) == 0
        assert time.monotonic() - t0 >= grace
    finally:
        inst.close()


@pytest.mark.integration
def test_stop_past_the_drain_budget_names_the_shutdown(tmp_path: Path, llama_server_bin: Path,
                                                       demo_model: Path, free_port: int) -> None:
    from tests.helpers import Instance

    inst = Instance(tmp_path / "home", free_port, llama_server_bin, demo_model,
                    MTPWRAP_DRAIN_S="2")
    try:
        inst.wait_ready()
        got: list[bytes] = []

        def stream() -> None:
            with httpx.stream("POST", inst.base + "/completion", timeout=120,
                              json={"prompt": "Once upon a time", "n_predict": 100000,
                                    "stream": True, "ignore_eos": True}) as r:
                for chunk in r.iter_raw():
                    got.append(chunk)
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(stream)
            wait_for("the stream started", lambda: bool(got), 30, every=0.05)
            t0 = time.monotonic()
            os.kill(inst.proc.pid, signal.SIGTERM)
            assert inst.proc.wait(60) == 0
            took = time.monotonic() - t0
            fut.result(10)
        tail = b"".join(got).rstrip().rsplit(b"\n\n", 1)[-1]
        event = json.loads(tail.removeprefix(b"data: "))
        assert event["error"]["code"] == 503 and "shutting down" in event["error"]["message"]
        assert "RemoteProtocolError" not in event["error"]["message"]
        assert took < 2 + 10 + 3  # drain_s + the child's stop grace + slack
    finally:
        inst.close()


def test_a_websocket_upgrade_is_answered_as_http_and_never_switches(front: object) -> None:
    """An Upgrade to a websocket gets the front's HTTP answer on every path (wsproto is
    installed here, so uvicorn's "auto" would switch protocol past the connection limits):
    never a 101, and nothing is forwarded as a websocket (`docs/reliability.md` 35)."""
    upgrade = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
    for path, status in ((b"/livez", 200), (b"/v1/models", 401)):
        s = _connect(front.url)  # type: ignore[attr-defined]
        s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + upgrade + b"\r\n")
        s.settimeout(5)
        data = s.recv(65536)
        s.close()
        assert _status(data) == status, data[:300]


def test_the_guard_lets_nothing_but_http_through() -> None:
    """A websocket scope that reaches the guard (any server, any configuration) is closed
    before it is accepted; the app behind it never sees it."""
    from mtpwrap.front.guard import AccessGuard

    reached: list[dict] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        reached.append(scope)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    guard = AccessGuard(app, lambda: None, None, None)  # type: ignore[arg-type]
    scope = {"type": "websocket", "path": "/v1/models", "headers": [], "query_string": b""}
    asyncio.run(guard(scope, receive, send))
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
