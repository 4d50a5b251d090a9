"""The relay's wire to llama-server: HTTP/1.1 over asyncio streams, answers parsed by llhttp
(httptools, the parser uvicorn serves the front with), idle connections kept per place.

Why not the httpx client of `mtpwrap.upstream` for the relay: every relayed chunk went
through httpx → httpcore → h11 → anyio (a cancel scope, a timeout and several context managers
per read), which cost the front about three times the CPU per chunk of this path on the same
machine (docs/measurements/2026-12-01-relay-wire.md). Here one chunk is one `read` of the
stream, one `feed_data` into llhttp and the body handed over as it came; what arrived together
is handed over together, so a busy machine writes fewer, larger chunks. Everything that is not
the relay (probes, slots, the metrics scrape) keeps the httpx client.

Where: the place is llama-server's UNIX socket when it has one, else the host and port of its
loopback URL. The Host header is the URL's.

Reuse: an answer that llama-server lets live (llhttp's `should_keep_alive`: HTTP/1.1, no
`Connection: close`) and that was read to its end goes back to the pool, most recent first.
A kept connection is dropped after `KEEPALIVE_EXPIRY_S` idle, well inside cpp-httplib's own
5 s, and one the server has closed meanwhile (end of stream seen) is never taken. Expiry is
kept by a sweep the event loop runs while any connection is idle, so a burst's connections are
closed soon after it rather than at the next request; and no more than `max_idle` are kept per
place (llama-server serves only as many at once as it has slots). A streamed
request says `Connection: close` (see `mtpwrap.front.relay`), so its connection ends with it.

Faults are `UpstreamError`s with a `kind` for the front's metrics: `connect` (nothing was sent:
the one error that may be retried), `write_timeout`, `disconnected` (the connection ended
before the answer did), `protocol` (llhttp could not read the answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httptools

from mtpwrap.upstream import KEEPALIVE_EXPIRY_S

if TYPE_CHECKING:
    from mtpwrap.supervision.state import Upstream

#: how much one read takes from the socket at most
READ_SIZE = 64 * 1024


class UpstreamError(Exception):
    """A failure talking to llama-server; `kind` labels it in the front's metrics."""

    kind = "error"


class ConnectFailed(UpstreamError):
    """No connection: nothing of the request reached llama-server."""

    kind = "connect"


class WriteTimedOut(UpstreamError):
    kind = "write_timeout"


class Disconnected(UpstreamError):
    kind = "disconnected"


class BadResponse(UpstreamError):
    kind = "protocol"


class _Answer:
    """llhttp's callbacks for one response: status, headers, body pieces, the end."""

    __slots__ = ("parser", "headers", "head_done", "body", "complete", "keep_alive")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.body: list[bytes] = []
        self.complete = False
        #: the server lets the connection live (asked while llhttp still knows the message)
        self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    @property
    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class _Place:
    """Where one llama-server listens, and the Host header its URL gives."""

    socket: str | None
    host: str
    port: int
    authority: bytes

    @classmethod
    def of(cls, up: Upstream) -> _Place:
        url = urlsplit(up.base_url)
        return cls(up.socket, url.hostname or "localhost", url.port or 80,
                   (url.netloc or "localhost").encode("latin-1"))


class WireResponse:
    """One answer: `status` and `headers` (names lower-case) once the head is read, then the
    body through `chunks()` (or `read()`); `aclose()` returns the connection or closes it."""

    def __init__(self, pool: WirePool, place: _Place, conn: _Connection, answer: _Answer,
                 keep: bool) -> None:
        self._pool, self._place, self._conn = pool, place, conn
        self._answer, self._keep = answer, keep
        self.status = answer.parser.get_status_code()
        self.headers = answer.headers
        self._done = False
        self._closed = False

    def header(self, name: bytes) -> bytes:
        return next((v for k, v in self.headers if k == name), b"")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body (transfer coding removed) as it arrives: what one read brought, joined."""
        answer, body, reader = self._answer, self._answer.body, self._conn.reader
        while True:
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                yield data
                continue
            if answer.complete:
                break
            await _read_into(reader, answer, "before its answer ended")
        self._done = True

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if self._done and self._keep and self._answer.keep_alive and conn.usable:
            self._pool.put(self._place, conn)
        else:
            conn.close()


async def _read_into(reader: asyncio.StreamReader, answer: _Answer, when: str) -> None:
    """One read of the socket, fed to llhttp; an error or the connection's end says `when`."""
    try:
        data = await reader.read(READ_SIZE)
    except OSError as err:
        raise Disconnected(f"the connection broke {when} ({err})") from err
    if not data:
        raise Disconnected(f"llama-server closed the connection {when}")
    try:
        answer.parser.feed_data(data)
    except httptools.HttpParserError as err:
        raise BadResponse(f"llama-server's answer is not valid HTTP/1.1 ({err})") from err


@dataclass
class WirePool:
    """Connections to each place llama-server listens, for the front's relay."""

    connect_timeout_s: float
    write_timeout_s: float
    #: idle connections kept per place at most; the oldest beyond it are closed
    max_idle: int = 8
    _idle: dict[_Place, list[_Connection]] = field(default_factory=dict)
    _sweep: asyncio.TimerHandle | None = None

    async def request(self, up: Upstream, method: str, target: str,
                      headers: list[tuple[bytes, bytes]], body: bytes, *,
                      keep: bool = True) -> WireResponse:
        """Send one request and read the head of its answer. `keep`: the connection may serve
        another request afterwards (the request then must not say `Connection: close`)."""
        place = _Place.of(up)
        conn = self._take(place) or await self._connect(place)
        try:
            return await self._exchange(place, conn, method, target, headers, body, keep)
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, place: _Place, conn: _Connection, method: str, target: str,
                        headers: list[tuple[bytes, bytes]], body: bytes,
                        keep: bool) -> WireResponse:
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("latin-1"),
                                                     target.encode("latin-1"), place.authority)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in headers]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        conn.writer.write(b"".join(head) + body)
        try:
            await asyncio.wait_for(conn.writer.drain(), self.write_timeout_s)
        except asyncio.TimeoutError as err:
            raise WriteTimedOut(f"llama-server took no request bytes for "
                                f"{self.write_timeout_s:g} s") from err
        except OSError as err:
            raise Disconnected(f"the connection broke while the request was sent ({err})"
                               ) from err
        answer = _Answer()
        while not answer.head_done:
            await _read_into(conn.reader, answer, "without an answer")
        if method == "HEAD":  # llhttp does not know the request: no body follows a HEAD
            answer.complete, keep = True, False
        return WireResponse(self, place, conn, answer, keep)

    async def _connect(self, place: _Place) -> _Connection:
        try:
            if place.socket is not None:
                opening = asyncio.open_unix_connection(place.socket, limit=READ_SIZE)
            else:
                opening = asyncio.open_connection(place.host, place.port, limit=READ_SIZE)
            reader, writer = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as err:
            where = place.socket or f"{place.host}:{place.port}"
            raise ConnectFailed(f"cannot connect to llama-server at {where} "
                                f"({type(err).__name__}: {err})") from err
        return _Connection(reader, writer)

    def _take(self, place: _Place) -> _Connection | None:
        idle = self._idle.get(place)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn
            conn.close()
        return None

    def put(self, place: _Place, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(place, [])
        idle.append(conn)
        self._expire(conn.idle_since)
        while len(idle) > self.max_idle:
            idle.pop(0).close()
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(KEEPALIVE_EXPIRY_S,
                                                                self._swept)

    def _expire(self, now: float) -> None:
        """Close the connections idle past their time or ended by the server (oldest first)."""
        for idle in self._idle.values():
            while idle and (now - idle[0].idle_since >= KEEPALIVE_EXPIRY_S
                            or not idle[0].usable):
                idle.pop(0).close()

    def _swept(self) -> None:
        self._sweep = None
        self._expire(time.monotonic())
        oldest = min((v[0].idle_since for v in self._idle.values() if v), default=None)
        if oldest is not None:
            wait = max(0.05, oldest + KEEPALIVE_EXPIRY_S - time.monotonic())
            self._sweep = asyncio.get_running_loop().call_later(wait, self._swept)

    def idle(self) -> int:
        """Connections kept for reuse now (not those the server has ended meanwhile)."""
        return sum(conn.usable for conns in self._idle.values() for conn in conns)

    async def aclose(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
