"""Raw HTTP/1.1 for the campaign: requests mutated from a seed set, judged by two parsers.

Each mutated request is read by h11 and by httptools (llhttp, the parser the front runs). Where
both read the same complete request, the front may answer it as it likes, short of a 5xx; where
both refuse it, the front must refuse it too (a 4xx, or a close without an answer); where they
disagree — one reads a request the other refuses, or they read different ones — the front must
refuse it: a proxy that reads a request differently from the next hop is how requests are
smuggled.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass

import h11
import httptools

#: the valid requests mutations start from ({key} is the API key's place)
SEEDS = (
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Api-Key: {key}\r\n\r\n",
    b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
    b"Content-Type: application/json\r\nContent-Length: 17\r\n\r\n{\"content\": \"Hi\"}",
    b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n11\r\n{\"content\": \"Hi\"}\r\n0\r\n\r\n",
    b"POST /detokenize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
    b"Content-Length: 15\r\n\r\n{\"tokens\": [1]}",
    b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
)

#: whole-token replacements that parsers are known to read differently
_SWAPS = (
    (b"Content-Length: ", b"Content-Length:  "), (b"Content-Length: ", b"Content-Length : "),
    (b"Content-Length: ", b"Content-Length: +"), (b"Content-Length: ", b"Content-Length: 0"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: xchunked"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked, identity"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding:\tchunked"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: x"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked\r\nContent-Length: 5"),
    (b"\r\n\r\n", b"\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n"),
    (b"\r\n\r\n", b"\r\n X-Folded: yes\r\n\r\n"), (b"\r\n", b"\n"), (b"\r\n", b"\r"),
    (b"HTTP/1.1", b"HTTP/1.0"), (b"HTTP/1.1", b"HTTP/2.0"), (b"HTTP/1.1", b"HTTP/1.10"),
    (b"HTTP/1.1", b"http/1.1"), (b"HTTP/1.1", b""), (b"GET ", b"get "), (b"POST ", b"P\x00ST "),
    (b" /", b" http://127.0.0.1/"), (b" /", b"  /"), (b" /", b" *"), (b"Host: ", b"Host:"),
    (b"Host: 127.0.0.1\r\n", b""), (b"Host: 127.0.0.1", b"Host: 127.0.0.1\r\nHost: x"),
    (b"11\r\n", b"11;ext=1\r\n"), (b"11\r\n", b"0x11\r\n"), (b"11\r\n", b"ffffffffffffffff1\r\n"),
    (b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n"), (b"0\r\n\r\n", b"0\r\n"),
    (b"Bearer ", b"Bearer \xff"), (b": ", b":\x00 "),
)


def mutate(rng: random.Random, seed: bytes) -> tuple[bytes, str]:
    """One mutation of `seed` (one to three changes), and what was done."""
    data = seed
    done = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        op = rng.randrange(6)
        if op <= 1:
            old, new = rng.choice(_SWAPS)
            if old in data:
                data = data.replace(old, new, 1)
                done.append(f"swap {old[:16]!r}->{new[:16]!r}")
                continue
        i = rng.randrange(len(data) + 1)
        if op == 2:
            b = bytes([rng.choice((0, 9, 10, 13, 32, 34, 58, 127, 128, 255, rng.randrange(256)))])
            data = data[:i] + b + data[i:]
            done.append(f"insert {b!r}@{i}")
        elif op == 3 and data:
            data = data[:i] + data[i + 1:]
            done.append(f"delete @{i}")
        elif op == 4 and i < len(data):
            data = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
            done.append(f"flip @{i}")
        else:
            data = data + data  # two requests back to back (pipelined)
            done.append("pipelined twice")
    return data, "; ".join(done) or "unchanged"


@dataclass(frozen=True)
class Reading:
    """What one parser made of the bytes: "ok" with the requests, "bad", or "incomplete"."""

    outcome: str
    requests: tuple[tuple[bytes, bytes, bytes], ...] = ()  # (method, target, body)


def read_h11(data: bytes) -> Reading:
    conn = h11.Connection(h11.SERVER)
    out: list[tuple[bytes, bytes, bytes]] = []
    try:
        conn.receive_data(data)
        method = target = b""
        body = b""
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                if conn.their_state is h11.DONE and conn.our_state is h11.SEND_RESPONSE:
                    # answer it, to read the next one
                    conn.send(h11.Response(status_code=204, headers=[]))
                    conn.send(h11.EndOfMessage())
                    if conn.our_state is not h11.DONE:
                        return Reading("ok", tuple(out))
                    conn.start_next_cycle()
                    continue
                if conn.their_state is h11.IDLE and out:
                    return Reading("ok", tuple(out))
                return Reading("incomplete" if ev is h11.NEED_DATA else "ok", tuple(out))
            if isinstance(ev, h11.Request):
                method, target, body = ev.method, ev.target, b""
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                out.append((method, target, body))
            elif isinstance(ev, h11.ConnectionClosed):
                return Reading("ok", tuple(out))
    except h11.RemoteProtocolError:
        return Reading("bad", tuple(out))
    except h11.LocalProtocolError:  # e.g. a request h11 cannot answer (HTTP/1.0 pipelining)
        return Reading("ok" if out else "bad", tuple(out))


class _Collect:
    """httptools' callbacks (it looks them up once, when the parser is made)."""

    def __init__(self) -> None:
        self.out: list[tuple[bytes, bytes, bytes]] = []
        self.url = b""
        self.body = b""
        self.parser: httptools.HttpRequestParser | None = None

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.out.append((self.parser.get_method(), self.url, self.body))


def read_httptools(data: bytes) -> Reading:
    c = _Collect()
    p = c.parser = httptools.HttpRequestParser(c)
    try:
        p.feed_data(data)
    except (httptools.HttpParserUpgrade, httptools.HttpParserError):
        return Reading("bad", tuple(c.out))
    if not c.out:
        return Reading("incomplete")
    return Reading("ok", tuple(c.out))


def judge(data: bytes) -> tuple[str, int]:
    """"agree-ok", "agree-bad", "incomplete" or "disagree" (the two parsers read the bytes
    differently), and how many requests at the start both read alike (a pipelined request
    after them may be the bad one)."""
    a, b = read_h11(data), read_httptools(data)
    same = 0
    for ra, rb in zip(a.requests, b.requests, strict=False):
        if ra != rb:
            break
        same += 1
    if a.outcome == b.outcome == "ok":
        return ("agree-ok" if a.requests == b.requests else "disagree"), same
    if a.outcome == b.outcome == "bad":
        return "agree-bad", same
    if "ok" not in (a.outcome, b.outcome):  # incomplete for one, incomplete or bad for other
        return "incomplete", same
    return "disagree", same


@dataclass(frozen=True)
class Answer:
    statuses: tuple[int, ...]  # the status of each response read, in order
    closed: bool               # the front closed the connection
    raw: bytes


def send_raw(host: str, port: int, data: bytes, wait_s: float, expect: int = 1) -> Answer:
    """Send `data` on a new connection; read until the front closes, `expect` answers have
    come (and 50 ms more passed), or `wait_s` passes."""
    s = socket.create_connection((host, port), timeout=5)
    raw = b""
    closed = False
    try:
        s.sendall(data)
        s.settimeout(0.05)
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                if len(_status_lines(raw)) >= expect:
                    break
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
            if not chunk:
                closed = True
                break
            raw += chunk
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    finally:
        s.close()
    statuses = tuple(int(m) for m in _status_lines(raw))
    return Answer(statuses, closed, raw)


def _status_lines(raw: bytes) -> list[bytes]:
    out = []
    for line in raw.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 ") and line[9:12].isdigit():
            out.append(line[9:12])
    return out


def raw_verdict(kind: str, same: int, ans: Answer) -> str | None:
    """The failure class of the front's answer to bytes the parsers judged `kind`, of which
    the first `same` requests both parsers read alike."""
    if any(s >= 500 and s != 503 for s in ans.statuses):
        return f"{kind}: a {max(ans.statuses)} answer"
    if b"Traceback" in ans.raw:
        return f"{kind}: a traceback"
    if kind in ("agree-bad", "disagree"):
        accepted = [s for s in ans.statuses[same:] if s < 400]
        if accepted:
            return f"{kind}: answered {accepted[0]} to a request the parsers do not agree on"
    return None
