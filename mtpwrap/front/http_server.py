"""The front's HTTP/1.1 connection layer: uvicorn with llhttp (httptools), plus the limits a
public listener needs before any request reaches the application.

Chosen once for both speed and safety: llhttp parses strictly (a request with both
`Content-Length` and `Transfer-Encoding`, RFC 9112 §6.1, is an error and the connection is
closed) and is the faster of uvicorn's two parsers. The limits sit in a protocol of their own,
`FrontHttpProtocol`, given to uvicorn as its `http` class: it sees every byte first, reads it
with its own llhttp parser (httptools' public API), and hands what it accepts to uvicorn's
httptools protocol, which it holds and drives through `asyncio.Protocol`'s methods alone; what
that protocol writes passes through a transport of its own. An ASGI layer around the application
(`uvicorn_config`) tells the connection when each request's answer is done. What uvicorn lacks,
added here:

- a deadline for a complete request head (`header_timeout_s`, from the connection's start or
  from the first byte of the next request on a kept-alive connection): a silent socket or a
  half-sent head gets 408 and is closed; idle keep-alive ends after `idle_timeout_s`;
- a deadline for the body (`body_timeout_s` after the head, plus 1 s for every `body_min_rate`
  bytes that arrive): a client trickling its body gets 408 and is closed;
- what llhttp reads where the next parser would not (RFC 9112 §3, §3.2): a request line that is
  not `METHOD SP target SP HTTP/1.x` (two spaces, HTTP/0.9), an HTTP/1.1 request without a
  `Host` or any request with two: 400, closed — a request two parsers read differently is
  refused, never guessed at;
- a client's half-close after a complete request still gets its answer (uvicorn closes at EOF):
  the connection stays open until every answer it owes is written, then closes. Nothing the
  client did not ask for is sent: a client that closed for good, not half, answers the first
  bytes of its answer with a reset, which the front reads from the socket's error (no write) as
  the disconnect it is;
- a lingering close: when the front closes a connection whose client may still be sending
  (an answer before the body was read, a refused head), it shuts down its side, reads and
  drops what still comes for up to `linger_s` and `linger_bytes`, then closes — so the client
  reads the answer instead of a reset for the unread bytes, and an upload refused at its start
  is still not read to its end;
- at most `max_connections` open connections: one more is closed at once;
- at most `max_headers` request headers and `max_header_bytes` for the request line and headers
  together, counted as the bytes arrive (one large read or a byte at a time alike): 431, closed;
- errors in JSON, not uvicorn's text/plain.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mtpwrap.front.exchange import PEER_EOF, REFUSED

if TYPE_CHECKING:
    import uvicorn

    from mtpwrap.front.replies import ASGIApp, Receive, Scope, Send

_REASONS = {400: b"Bad Request", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}

#: RFC 9112 §3: method (a token) SP request-target SP HTTP-version, nothing more
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^\x00-\x20\x7f]+ HTTP/1\.[01]\r?")

#: after a write to a half-closed connection, when to read the socket's error (a reset there
#: is a client that closed for good)
_PROBES = (0.05, 0.5, 2.0)

_BAD_REQUEST = ("The request is not valid HTTP/1.1 (for example, Content-Length together with "
                "Transfer-Encoding, or a malformed header).")

#: the connection whose bytes are being handed on: a task started while they are (the
#: application's, for the request they complete) keeps it in its context
_connection: contextvars.ContextVar[FrontHttpProtocol | None] = contextvars.ContextVar(
    "mtpwrap_connection", default=None)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    max_header_bytes: int
    max_headers: int
    body_timeout_s: float = 10.0
    body_min_rate: int = 1024
    linger_s: float = 2.0
    linger_bytes: int = 4 * 2**20
    #: called with "header_timeout", "body_timeout", "connections", "header_size",
    #: "header_count" or "bad_request"
    on_refuse: Callable[[str], None] = lambda _kind: None


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    """Cancel a timer if there is one (its holder then forgets it)."""
    if timer is not None:
        timer.cancel()


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing (the refusal is kept beside it);
    llhttp's parser raises its own error for it."""


class _Transport(asyncio.Transport):
    """The socket transport as uvicorn's protocol sees it: the same, except that `close()` is
    the connection's (which lingers when the client may still be sending) and that what is
    written is seen (a half-closed connection reads its socket's error after it)."""

    def __init__(self, raw: asyncio.Transport, connection: FrontHttpProtocol) -> None:
        super().__init__()
        self.raw = raw
        self.connection = connection

    def close(self) -> None:
        self.connection.close_connection()

    def is_closing(self) -> bool:
        return self.connection.lingering or self.raw.is_closing()

    def abort(self) -> None:
        self.raw.abort()

    def write(self, data: Any) -> None:
        # Lingering, the sending side is shut: an answer still being written to a connection
        # that was refused (a bad request pipelined behind it) is dropped with it.
        connection = self.connection
        if not connection.lingering:
            self.raw.write(data)
            connection.wrote()

    def writelines(self, list_of_data: Any) -> None:
        connection = self.connection
        if not connection.lingering:
            self.raw.writelines(list_of_data)
            connection.wrote()

    def write_eof(self) -> None:
        self.raw.write_eof()

    def can_write_eof(self) -> bool:
        return self.raw.can_write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.raw.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.raw.get_protocol()


class FrontHttpProtocol(asyncio.Protocol):
    """One client connection: the limits above, then uvicorn's httptools protocol for what they
    let through. Bound to one front's limits by `protocol_class`, because uvicorn builds its
    protocol from the class alone."""

    limits: ClassVar[ConnectionLimits]
    #: this front's open connections (for `max_connections`)
    open: ClassVar[set[FrontHttpProtocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # uvicorn's arguments (its configuration, server state and loop) are its protocol's
        self.inner = HttpToolsProtocol(*args, **kwargs)
        self.loop: asyncio.AbstractEventLoop = kwargs.get("_loop") or asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        self.raw: asyncio.Transport | None = None
        self.transport: _Transport | None = None
        self._inner_open = False  # the inner protocol was told of the connection, not its end
        self._new_head()
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None
        # the request line as it arrives: "expect" (the next bytes start one), "reading" (from
        # the start of a chunk), "done" (checked), "unknown" (it began inside a chunk, after a
        # pipelined request)
        self._line_state = "expect"
        self._line = b""
        self._mid_request = False  # part of a request has arrived, not all of it
        self._body_open = False  # a head was read and its body has not all arrived
        self._body_deadline = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._wrote_since_head = False  # an answer has begun since the last request's head
        self._requests = 0  # complete requests read
        self._answered = 0  # requests whose application call has ended
        self.scope: Scope | None = None  # the scope of the request being answered
        self.half_closed = False
        self._probe_timer: asyncio.TimerHandle | None = None
        self._probe_step = 0
        self.lingering = False
        self._lingered = 0
        self._linger_timer: asyncio.TimerHandle | None = None

    # --- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports have asyncio.Transport's methods without being its subclass)
        self.raw = transport = cast(asyncio.Transport, transport)
        if len(self.open) >= self.limits.max_connections:
            self.limits.on_refuse("connections")
            transport.abort()
            return
        self.open.add(self)
        self.transport = _Transport(transport, self)
        self._inner_open = True
        self.inner.connection_made(self.transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.discard(self)
        self._disarm_head_timer()
        self._disarm_body_timer()
        _cancel(self._linger_timer)
        _cancel(self._probe_timer)
        self._lose_inner(exc)

    def _lose_inner(self, exc: Exception | None = None) -> None:
        """The inner protocol (and the application's request, as a disconnect) sees the end of
        the connection, once."""
        if self._inner_open:
            self._inner_open = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        """The client shut down its sending side: a half-close, or a full close that looks the
        same until something is sent. Complete requests whose answers are not all written keep
        the connection open for them (the connection closes after the last); anything else
        closes, and the application sees a disconnect."""
        if self.lingering or self._mid_request or self._answered >= self._requests:
            return None
        self.half_closed = True
        if self.scope is not None:
            # a stream owed may open now (its head and a keep-alive comment are what the client
            # asked for): a peer that closed for good answers them with a reset
            self.scope[PEER_EOF] = True
        return True

    def wrote(self) -> None:
        """Something was written: on a half-closed connection, read the socket's error soon."""
        self._wrote_since_head = True
        if self.half_closed and self._probe_timer is None:
            self._probe_step = 0
            self._probe_timer = self.loop.call_later(_PROBES[0], self._probe)

    def _probe(self) -> None:
        """After a write to a half-closed connection: a reset from the peer means it is gone."""
        self._probe_timer = None
        raw = self.raw
        assert raw is not None
        sock = raw.get_extra_info("socket")
        if raw.is_closing() or sock is None:
            return
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            raw.abort()
            return
        self._probe_step += 1
        if self._probe_step < len(_PROBES):
            self._probe_timer = self.loop.call_later(
                _PROBES[self._probe_step] - _PROBES[self._probe_step - 1], self._probe)

    def answered(self) -> None:
        """The application's call for one request of this connection has ended: its answer is
        written (or the connection is closing)."""
        self._answered += 1
        self.scope = None
        if self.half_closed:
            self.loop.call_soon(self._close_when_done)  # after whatever uvicorn writes then

    def _close_when_done(self) -> None:
        raw = self.raw
        if raw is not None and self._answered >= self._requests and not raw.is_closing():
            raw.close()  # the answers written are sent first

    def close_connection(self) -> None:
        """Close; when the client may still be sending (part of a request has arrived, not
        all of it), linger first."""
        raw = self.raw
        if raw is None or raw.is_closing() or self.lingering:
            return
        if not self._mid_request or self.half_closed:
            raw.close()
            return
        self.lingering = True
        self._lose_inner()  # the answer in progress, if any, cannot be sent now
        self._disarm_head_timer()
        self._disarm_body_timer()
        raw.resume_reading()
        if raw.can_write_eof():
            raw.write_eof()
        self._linger_timer = self.loop.call_later(self.limits.linger_s, raw.close)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        _cancel(self._head_timer)
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and self.raw is not None and not self.raw.is_closing():
            self._refuse(408, "header_timeout",
                         f"The request head did not arrive within "
                         f"{self.limits.header_timeout_s:g} s.")

    # --- the bytes -----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.lingering:  # read and dropped until the client closes or a limit is reached
            self._lingered += len(data)
            if self._lingered > self.limits.linger_bytes:
                assert self.raw is not None
                self.raw.close()
            return
        if self._line_state == "expect":
            self._line_state, self._line = "reading", b""
        if self._line_state == "reading" and not self._request_line(data):
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol switch (`ws="none"`): uvicorn answers it as HTTP
        except httptools.HttpParserError:  # (a callback's _Refused arrives wrapped in one)
            self._mid_request = True  # the rest of it may still be coming
            self._refuse(*(self._refusal or (400, "bad_request", _BAD_REQUEST)))
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            # Still no complete head after this many bytes: whatever follows, it is too large.
            self._refuse(431, "header_size", self._size_message())
            return
        token = _connection.set(self)
        try:
            self.inner.data_received(data)
        finally:
            _connection.reset(token)

    def _request_line(self, data: bytes) -> bool:
        """Collect the request line; False (and refused) when it is not RFC 9112's."""
        self._line = (self._line + data)[: self.limits.max_header_bytes]
        line = self._line
        while line.startswith(b"\r\n"):  # empty lines (CRLF, RFC 9112 §2.2) before it
            line = line[2:]
        end = line.find(b"\n")
        if end < 0:
            return True
        self._line_state = "done"
        if _REQUEST_LINE.fullmatch(line[:end]):
            return True
        self._mid_request = True  # the rest of it may still be coming
        self._refuse(400, "bad_request",
                     "The request line is not `METHOD SP target SP HTTP/1.1` (RFC 9112 §3): "
                     "one space between its three parts, HTTP/1.0 or HTTP/1.1.")
        return False

    # --- llhttp's callbacks: the request head --------------------------------------------
    def on_message_begin(self) -> None:
        if self._line_state == "expect":
            self._line_state = "unknown"  # it began inside a chunk: its start is not known
        self._mid_request = True
        self._new_head()
        self._arm_head_timer()

    def _new_head(self) -> None:
        """What a request's head is counted by, from its first byte."""
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._url = b""
        self._header_size = 0
        self._hosts = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (431, "header_count",
                             f"The request has more than {self.limits.max_headers} headers.")
            raise _Refused
        self._header_size += len(name) + len(value) + 4
        if name.lower() == b"host":
            self._hosts += 1

    def on_headers_complete(self) -> None:
        if len(self._url) + self._header_size > self.limits.max_header_bytes:
            self._refusal = (431, "header_size", self._size_message())
            raise _Refused
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            self._refusal = (400, "bad_request", "The request is not HTTP/1.0 or HTTP/1.1.")
            raise _Refused
        if self._hosts > 1 or (self._hosts == 0 and version == "1.1"):
            self._refusal = (400, "bad_request", "An HTTP/1.1 request has exactly one Host "
                             f"header (RFC 9112 §3.2); this one has {self._hosts}.")
            raise _Refused
        self._in_head = False
        self._disarm_head_timer()
        self._body_open = True
        self._wrote_since_head = False
        self._body_deadline = self.loop.time() + self.limits.body_timeout_s
        self._arm_body_timer()

    # --- the request body ----------------------------------------------------------------
    def _arm_body_timer(self) -> None:
        self._disarm_body_timer()
        self._body_timer = self.loop.call_at(self._body_deadline, self._body_timed_out)

    def _disarm_body_timer(self) -> None:
        _cancel(self._body_timer)
        self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        raw = self.raw
        if not self._body_open or raw is None or raw.is_closing():
            return
        if self.loop.time() < self._body_deadline:  # bytes came and moved it on
            self._arm_body_timer()
            return
        if self.scope is not None and self._answered == self._requests:
            # the request being answered is this one (not one pipelined before it): for the
            # application's audit line
            self.scope[REFUSED] = (408, "body_timeout")
        self._mid_request = self._body_open = False  # a slow sender is not lingered for
        if self._wrote_since_head:  # its answer has begun: only a close is left
            raw.close()
            self._lose_inner()  # the application sees a disconnect, not a half body
        else:  # the answer, then the same disconnect
            self._refuse(408, "body_timeout",
                         f"The request body did not arrive in time: "
                         f"{self.limits.body_timeout_s:g} s after the head plus 1 s per "
                         f"{self.limits.body_min_rate} bytes.")

    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / self.limits.body_min_rate

    def on_message_complete(self) -> None:
        self._mid_request = self._body_open = False
        self._in_head = True  # the next request on this connection starts with its head
        self._head_bytes = 0
        self._requests += 1
        self._disarm_body_timer()
        if self._line_state == "done":
            self._line_state = "expect"

    def _size_message(self) -> str:
        return (f"The request line and headers are larger than "
                f"{self.limits.max_header_bytes} bytes.")

    # --- answers without the application -------------------------------------------------
    def _refuse(self, status: int, kind: str, message: str) -> None:
        self._disarm_head_timer()
        self.limits.on_refuse(kind)
        body = json.dumps({"error": {"code": status, "message": message,
                                     "type": "invalid_request_error"}}).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-mtpwrap-answered-by: front\r\nconnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b"Error"), len(body)))
        raw = self.raw
        if raw is not None and not raw.is_closing() and not self.lingering:
            raw.write(head + body)
            self.close_connection()
        self._lose_inner()


def protocol_class(limits: ConnectionLimits) -> type[FrontHttpProtocol]:
    """A protocol class bound to one front's limits, for `uvicorn.Config(http=...)`."""
    return type("FrontHttpProtocol", (FrontHttpProtocol,), {"limits": limits, "open": set()})


def answers_told(app: ASGIApp) -> ASGIApp:
    """The application, telling the connection each request came on (when it is a
    `FrontHttpProtocol`'s) when its call has ended, and keeping the request's scope there."""

    async def told(scope: Scope, receive: Receive, send: Send) -> None:
        connection = _connection.get()
        if connection is None or scope["type"] != "http":
            await app(scope, receive, send)
            return
        connection.scope = scope
        try:
            await app(scope, receive, send)
        finally:
            connection.answered()

    return told


def uvicorn_config(app: ASGIApp, limits: ConnectionLimits, idle_timeout_s: float,
                   **kwargs: Any) -> uvicorn.Config:
    """The one uvicorn configuration of the front (runner and tests alike)."""
    import uvicorn

    options: dict[str, Any] = {"http": protocol_class(limits),
                               "timeout_keep_alive": idle_timeout_s, "log_config": None,
                               "lifespan": "off", "access_log": False,
                               # no protocol switch: with a websocket library installed,
                               # "auto" would hand an Upgrade to a protocol class that has
                               # none of the limits above
                               "ws": "none"}
    options.update(kwargs)  # a benchmark may compare another parser ("h11") here
    return uvicorn.Config(answers_told(app), **options)
