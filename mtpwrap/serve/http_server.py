"""The front's HTTP/1.1 connection layer: uvicorn with llhttp (httptools), plus the limits a
public listener needs before any request reaches the application.

Chosen once for both speed and safety: llhttp parses strictly (a request with both
`Content-Length` and `Transfer-Encoding`, RFC 9112 §6.1, is an error and the connection is
closed) and is the faster of uvicorn's two parsers. What uvicorn lacks, added here:

- a deadline for a complete request head (`header_timeout_s`, from the connection's start or
  from the first byte of the next request on a kept-alive connection): a silent socket or a
  half-sent head gets 408 and is closed; idle keep-alive ends after `idle_timeout_s`;
- at most `max_connections` open connections: one more is closed at once;
- at most `max_headers` request headers and `max_header_bytes` for the request line and headers
  together, counted as the bytes arrive (one large read or a byte at a time alike): 431, closed;
- errors in JSON, not uvicorn's text/plain.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    import uvicorn

    from mtpwrap.serve.replies import ASGIApp

_REASONS = {400: b"Bad Request", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    max_header_bytes: int
    max_headers: int
    #: called with "header_timeout", "connections", "header_size", "header_count" or "bad_request"
    on_refuse: Callable[[str], None] = lambda _kind: None


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; uvicorn turns it into a 400 path."""


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

    # --- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        crowded = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if crowded:
            self.limits.on_refuse("connections")
            transport.abort()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, "header_timeout",
                         f"The request head did not arrive within "
                         f"{self.limits.header_timeout_s:g} s.")

    # --- the request head ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if (self._in_head and self._head_bytes > self.limits.max_header_bytes
                and not self.transport.is_closing()):
            # Still no complete head after this many bytes: whatever follows, it is too large.
            self._refuse(431, "header_size", self._size_message())

    def on_message_begin(self) -> None:
        super().on_message_begin()
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
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._in_head = True  # the next request on this connection starts with its head
        self._head_bytes = 0

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
                               "lifespan": "off", "access_log": False}
    options.update(kwargs)  # a benchmark may compare another parser ("h11") here
    return uvicorn.Config(app, **options)
