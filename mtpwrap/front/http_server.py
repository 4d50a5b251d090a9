"""The front's HTTP/1.1 connection layer: uvicorn with llhttp (httptools), plus the limits a
public listener needs before any request reaches the application.

Chosen once for both speed and safety: llhttp parses strictly (a request with both
`Content-Length` and `Transfer-Encoding`, RFC 9112 §6.1, is an error and the connection is
closed) and is the faster of uvicorn's two parsers. What uvicorn lacks, added here:

- a deadline for a complete request head (`header_timeout_s`, from the connection's start or
  from the first byte of the next request on a kept-alive connection): a silent socket or a
  half-sent head gets 408 and is closed; idle keep-alive ends after `idle_timeout_s`;
- a deadline for the body (`body_timeout_s` after the head, plus 1 s for every `body_min_rate`
  bytes that arrive): a client trickling its body gets 408 and is closed;
- what llhttp reads where the next parser would not (RFC 9112 §3, §3.2): a request line that is
  not `METHOD SP target SP HTTP/1.x` (two spaces, HTTP/0.9), an HTTP/1.1 request without a
  `Host` or any request with two: 400, closed — a request two parsers read differently is
  refused, never guessed at;
- a client's half-close after a complete request still gets its answer when the answer has not
  begun (uvicorn closes at EOF; a stream already begun ends, as for a disconnect);
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
import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    import uvicorn

    from mtpwrap.front.replies import ASGIApp

_REASONS = {400: b"Bad Request", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}

#: RFC 9112 §3: method (a token) SP request-target SP HTTP-version, nothing more
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^\x00-\x20\x7f]+ HTTP/1\.[01]\r?")


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
    """Raised inside a parser callback to stop parsing; uvicorn turns it into a 400 path."""


class _Transport(asyncio.Transport):
    """The socket transport as uvicorn sees it: the same, except that `close()` is the
    protocol's (which lingers when the client may still be sending)."""

    def __init__(self, raw: asyncio.Transport, protocol: LimitedHttpToolsProtocol) -> None:
        super().__init__()
        self.raw = raw
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self.raw.is_closing()

    def abort(self) -> None:
        self.raw.abort()

    def write(self, data: Any) -> None:
        # Lingering, the sending side is shut: an answer still being written to a connection
        # that was refused (a bad request pipelined behind it) is dropped with it.
        if not self._protocol.lingering:
            self.raw.write(data)

    def writelines(self, list_of_data: Any) -> None:
        if not self._protocol.lingering:
            self.raw.writelines(list_of_data)

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


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above. Subclassed per front (see
    `protocol_class`) because uvicorn builds its protocol from the class alone."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
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
        self._half_closed = False
        self.lingering = False
        self._lingered = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._raw: asyncio.Transport  # the socket's own transport (uvicorn holds the wrapper)

    # --- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        crowded = len(self.connections) >= self.limits.max_connections
        self._raw = transport
        super().connection_made(_Transport(transport, self))
        if crowded:
            self.limits.on_refuse("connections")
            transport.abort()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        _cancel(self._linger_timer)
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client shut down its sending side: a half-close, or a full close that looks the
        same until something is sent. A complete HTTP/1.1 request whose answer has not begun
        keeps the connection open for it; a `100 Continue` (which every HTTP/1.1 client skips)
        is sent at once, and a peer that had closed for good answers it with a reset, which
        `_probe` reads as the disconnect it is. Anything else closes."""
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete and not self.pipeline
        if self.lingering or not answering or self._mid_request:
            return None
        assert cycle is not None
        if cycle.response_started or self.scope.get("http_version") == "1.0":
            # Nothing can be sent now to tell a close from a half-close (a stream's head is out;
            # HTTP/1.0 takes no interim answer): a disconnect, so the generation stops at once.
            return None
        self._raw.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        for delay in (0.05, 0.5, 2.0):
            self.loop.call_later(delay, self._probe)
        self._half_closed = True
        return True

    def _probe(self) -> None:
        """After a half-close: a reset from the peer means it is gone."""
        raw = self._raw
        sock = raw.get_extra_info("socket")
        if raw.is_closing() or sock is None:
            return
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            raw.abort()

    def close_connection(self) -> None:
        """Close; when the client may still be sending (part of a request has arrived, not
        all of it), linger first."""
        raw = self._raw
        if raw.is_closing() or self.lingering:
            return
        if not self._mid_request or self._half_closed:
            raw.close()
            return
        self.lingering = True
        if self.cycle is not None and not self.cycle.response_complete:
            self._disconnect_cycle()  # its answer cannot be sent now
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
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, "header_timeout",
                         f"The request head did not arrive within "
                         f"{self.limits.header_timeout_s:g} s.")

    # --- the request head ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.lingering:  # read and dropped until the client closes or a limit is reached
            self._lingered += len(data)
            if self._lingered > self.limits.linger_bytes:
                self._raw.close()
            return
        if self._line_state == "expect":
            self._line_state, self._line = "reading", b""
        if self._line_state == "reading" and not self._request_line(data):
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if (self._in_head and self._head_bytes > self.limits.max_header_bytes
                and not self.transport.is_closing()):
            # Still no complete head after this many bytes: whatever follows, it is too large.
            self._refuse(431, "header_size", self._size_message())

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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._line_state == "expect":
            self._line_state = "unknown"  # it began inside a chunk: its start is not known
        self._mid_request = True
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (431, "header_count",
                             f"The request has more than {self.limits.max_headers} headers.")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refusal = (431, "header_size", self._size_message())
            raise _Refused
        version = self.parser.get_http_version()
        hosts = sum(1 for name, _ in self.headers if name == b"host")
        if version not in ("1.0", "1.1"):
            self._refusal = (400, "bad_request", "The request is not HTTP/1.0 or HTTP/1.1.")
            raise _Refused
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            self._refusal = (400, "bad_request", "An HTTP/1.1 request has exactly one Host "
                             f"header (RFC 9112 §3.2); this one has {hosts}.")
            raise _Refused
        self._in_head = False
        self._disarm_head_timer()
        self._body_open = True
        self._body_deadline = self.loop.time() + self.limits.body_timeout_s
        self._arm_body_timer()
        super().on_headers_complete()

    # --- the request body ----------------------------------------------------------------
    def _arm_body_timer(self) -> None:
        self._disarm_body_timer()
        self._body_timer = self.loop.call_at(self._body_deadline, self._body_timed_out)

    def _disarm_body_timer(self) -> None:
        _cancel(self._body_timer)
        self._body_timer = None

    def _disconnect_cycle(self) -> None:
        """The application's request sees a disconnect (as uvicorn's connection_lost does)."""
        assert self.cycle is not None
        self.cycle.disconnected = True
        self.cycle.message_event.set()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._body_open or self.transport.is_closing():
            return
        if self.loop.time() < self._body_deadline:  # bytes came and moved it on
            self._arm_body_timer()
            return
        cycle = self.cycle
        if cycle is not None:  # the application sees a disconnect, not a half body
            scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
            scope["mtpwrap.refused"] = (408, "body_timeout")  # for its audit line
            self._disconnect_cycle()
        self._mid_request = self._body_open = False  # a slow sender is not lingered for
        if cycle is not None and cycle.response_started:
            self.transport.close()
            return
        self._refuse(408, "body_timeout",
                     f"The request body did not arrive in time: {self.limits.body_timeout_s:g} s "
                     f"after the head plus 1 s per {self.limits.body_min_rate} bytes.")

    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / self.limits.body_min_rate
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._mid_request = self._body_open = False
        self._disarm_body_timer()
        if self._line_state == "done":
            self._line_state = "expect"
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._in_head = True  # the next request on this connection starts with its head
        self._head_bytes = 0
        if self._half_closed and not self.pipeline and not self.transport.is_closing():
            self.transport.close()  # nothing more can come

    def _size_message(self) -> str:
        return (f"The request line and headers are larger than "
                f"{self.limits.max_header_bytes} bytes.")

    # --- answers without the application -------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        # uvicorn's path for a request it cannot parse; a refusal raised above lands here too.
        if self._refusal is not None:
            status, kind, message = self._refusal
        else:
            status, kind, message = 400, "bad_request", (
                "The request is not valid HTTP/1.1 (for example, Content-Length together with "
                "Transfer-Encoding, or a malformed header).")
        self._refuse(status, kind, message)

    def _refuse(self, status: int, kind: str, message: str) -> None:
        self._disarm_head_timer()
        self.limits.on_refuse(kind)
        body = json.dumps({"error": {"code": status, "message": message,
                                     "type": "invalid_request_error"}}).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-mtpwrap-answered-by: front\r\nconnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b"Error"), len(body)))
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class bound to one front's limits, for `uvicorn.Config(http=...)`."""
    return type("FrontHttpProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


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
    return uvicorn.Config(app, **options)
