"""The one way to talk to llama-server: an httpx client bound to where it listens (its UNIX
socket, or loopback TCP), with its internal key. The supervised child's probes, slot save and
restore, the metrics scrape, the build's smoke test and probes, the readiness wait of every
server `mtpwrap.proc` starts, the benchmarks and the tests all take their client from here, so
nothing else needs to know a port or a socket path. (The front's relay reads llama-server over
its own wire, `mtpwrap.supervision.wire`, with the same keep-alive expiry.)

Also the rule for a socket's path (`SUN_PATH_MAX`, `fits`) and a fresh private directory for
the socket of a temporary server (`private_socket_dir`).

Connections are kept and reused. cpp-httplib, llama-server's HTTP layer, closes a connection
that has been idle for `CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND` (5 s) — the very value of httpx's
default `keepalive_expiry`, so a request sent on a connection just under 5 s old can meet the
server's close and fail with "Server disconnected without sending a response" (and a
generation cannot be retried, as it may have been read). The client here lets an idle
connection go well before the server does (`KEEPALIVE_EXPIRY_S`); a connection the server has
closed before that is seen as readable-at-EOF by httpcore and not reused. llama-server also
closes a connection after every streamed answer, without `Connection: close`; the front's relay
asks for that close itself on a streamed request (see `mtpwrap.front.relay`).

httpx is imported inside the functions: `mtpwrap --help` does not pay for it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import httpx

#: an idle connection is dropped after this long, well inside cpp-httplib's 5 s
KEEPALIVE_EXPIRY_S = 2.0

#: bytes of a path in `struct sockaddr_un` on Linux (108 with the terminating NUL)
SUN_PATH_MAX = 107


class Upstream(Protocol):
    """Where a llama-server listens, as a supervisor reports it
    (`mtpwrap.supervision.state.Upstream`)."""

    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> str: ...
    @property
    def socket(self) -> str | None: ...


def fits(path: Path | str) -> bool:
    """Whether `path` is short enough to bind a UNIX socket at."""
    return len(os.fsencode(str(path))) <= SUN_PATH_MAX


def private_socket_dir(name: str) -> Path:
    """A fresh directory only this user can enter (mkdtemp makes it 0700), for a temporary
    llama-server's socket called `name`: under the temporary folder, or under /tmp when that
    folder's path leaves no room for the socket. The caller removes it."""
    base = tempfile.gettempdir()
    # mkdtemp's own part: "mtpwrap-" and eight random characters
    if not fits(Path(base) / ("mtpwrap-" + "x" * 8) / name):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="mtpwrap-", dir=base))


def _limits(max_connections: int | None, keepalive: bool) -> httpx.Limits:
    import httpx

    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_connections if keepalive else 0,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def async_client(socket: str | None, *, base_url: str = "", api_key: str | None = None,
                 timeout: httpx.Timeout | float | None = 5.0,
                 max_connections: int | None = None, keepalive: bool = True
                 ) -> httpx.AsyncClient:
    """An async client for the llama-server on UNIX socket `socket` (None: TCP, reached by
    the URLs' own host and port)."""
    import httpx

    limits = _limits(max_connections, keepalive)
    transport = httpx.AsyncHTTPTransport(uds=socket, limits=limits) if socket else None
    return httpx.AsyncClient(
        base_url=base_url, headers=_headers(api_key), timeout=timeout, limits=limits,
        transport=transport,
        trust_env=False,  # an HTTP_PROXY in the environment must never see this traffic
        follow_redirects=False)


def client(socket: str | None, *, base_url: str = "", api_key: str | None = None,
           timeout: httpx.Timeout | float | None = 5.0, max_connections: int | None = None,
           keepalive: bool = True) -> httpx.Client:
    """The blocking twin of `async_client` (benchmarks, tests, one-off probes)."""
    import httpx

    limits = _limits(max_connections, keepalive)
    transport = httpx.HTTPTransport(uds=socket, limits=limits) if socket else None
    return httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                        limits=limits, transport=transport, trust_env=False,
                        follow_redirects=False)


class UpstreamClients:
    """The front's pooled clients: one per place the child listens. Over a socket the place
    stays the same across restarts, so one pool serves the whole run; over TCP one client
    reaches every port by its URL."""

    def __init__(self, *, timeout: httpx.Timeout, max_connections: int,
                 keepalive: bool = True) -> None:
        self._timeout = timeout
        self._max = max_connections
        self._keepalive = keepalive
        self._clients: dict[str | None, httpx.AsyncClient] = {}

    def get(self, up: Upstream) -> httpx.AsyncClient:
        c = self._clients.get(up.socket)
        if c is None:
            c = self._clients[up.socket] = async_client(
                up.socket, timeout=self._timeout, max_connections=self._max,
                keepalive=self._keepalive)
        return c

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()
