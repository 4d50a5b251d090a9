"""Where llama-server listens: a UNIX socket only the service user can open, or loopback TCP
for a binary that cannot bind one. Pure: the socket's directory is made by
`mtpwrap.supervision.sockets`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities


#: the name of llama-server's socket in its directory (the directory alone is the lock)
SOCKET_NAME = "llama.sock"


@dataclass(frozen=True)
class Endpoint:
    """Where llama-server listens: a UNIX socket path (`--host <dir>/llama.sock`, no port), or
    a loopback TCP host and port; `why` is the sentence `doctor` and /healthz show."""

    socket: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    why: str = ""

    @property
    def transport(self) -> str:
        return "unix" if self.socket is not None else "tcp"

    @property
    def base_url(self) -> str:
        """The URL an HTTP client uses (over the socket the host part is only a Host header)."""
        if self.socket is not None:
            return "http://localhost"
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        if self.socket is not None:
            return f"unix socket {self.socket}"
        return f"loopback TCP {self.host}:{self.port if self.port is not None else '<port>'}"


def binds_unix_socket(caps: Capabilities) -> bool:
    """Whether this llama-server binds a UNIX socket when `--host` ends in `.sock`: upstream's
    help says "or UNIX socket paths ending in .sock", the fork's "bind to an UNIX socket if
    the address ends with .sock"."""
    option = caps.option("--host")
    text = option.help.lower() if option is not None else ""
    return ".sock" in text or "unix socket" in text


def listen_on(caps: Capabilities, socket: str | None, *, host: str = "127.0.0.1",
              port: int | None = None, socket_why: str = "") -> Endpoint:
    """The endpoint for this binary: the UNIX socket `socket` when the binary binds one, else
    loopback TCP (still behind the per-start internal key), each with its reason."""
    key = "behind the per-start internal key"
    if socket is None:
        return Endpoint(host=host, port=port,
                        why=f"loopback TCP, {key}" + (f" ({socket_why})" if socket_why else ""))
    if not binds_unix_socket(caps):
        return Endpoint(host=host, port=port, why=(
            f"loopback TCP, {key}: {caps.describe()} cannot bind a UNIX socket (its --help "
            "names no .sock path for --host), so any local user can reach the port"))
    return Endpoint(socket=socket, why=(
        "UNIX socket in a 0700 directory: only the service user can connect, and the "
        f"per-start internal key is a second lock{f' ({socket_why})' if socket_why else ''}"))


def host_and_port(endpoint: Endpoint | None, caps: Capabilities, host: str, port: int | None
                  ) -> tuple[str, int | None, str]:
    """`--host`'s value, `--port`'s (None: no `--port`) and the reason, as `launch.render`
    spells them: the endpoint's when given, else `host` and `port`."""
    if endpoint is None:
        return host, port, "llama-server is never exposed; the proxy is the public side"
    if endpoint.socket is None:
        return endpoint.host, endpoint.port, (
            endpoint.why or "llama-server is never exposed; the proxy is the public side")
    if not binds_unix_socket(caps):
        raise ConfigError(f"--host {endpoint.socket}: {caps.describe()} cannot bind a UNIX "
                          "socket; it listens on loopback TCP instead.")
    return endpoint.socket, None, endpoint.why
