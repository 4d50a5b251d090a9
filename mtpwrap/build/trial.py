"""Where a temporary llama-server listens — the smoke test of a build, the draft-depth probe,
the buffer measurement, a benchmark's server: on a UNIX socket in a fresh directory only this
user can enter when the binary's --help says it can bind one (`decide.endpoint.listen_on`),
else on a free loopback TCP port. Requests reach it through the one upstream client
(`mtpwrap.upstream`, `ServerProcess.client()`); the directory is removed once it stopped."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap import proc, upstream
from mtpwrap.decide import launch
from mtpwrap.decide.endpoint import SOCKET_NAME, Endpoint, binds_unix_socket, listen_on

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.launch import LaunchConfig


@contextlib.contextmanager
def endpoint(caps: Capabilities) -> Iterator[Endpoint]:
    """A socket in a fresh 0700 directory for a binary that binds one, else a free loopback
    port, with `listen_on`'s reason; the directory is removed afterwards."""
    folder = upstream.private_socket_dir(SOCKET_NAME)
    try:
        yield listen_on(caps, str(folder / SOCKET_NAME),
                        port=None if binds_unix_socket(caps) else proc.free_loopback_port())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def start(cl: LaunchConfig, caps: Capabilities, *, binary: Path | str,
          extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
          **server: Any) -> proc.ServerProcess:
    """Render `cl` for `binary` listening where `endpoint` says, start it and wait until it is
    ready (`proc.start_server`; `server` are its options: ready, timeout, what, log_path,
    api_key). The launch's own environment is passed, `env` over it; the socket's directory
    is removed when the server is stopped."""
    stack = contextlib.ExitStack()
    ep = stack.enter_context(endpoint(caps))
    try:
        spec = launch.render(cl, caps, binary=binary, endpoint=ep, extra=extra)
        srv = proc.start_server(spec.argv, base_url=ep.base_url, socket=ep.socket,
                                env={**spec.env, **(env or {})}, **server)
    except BaseException:
        stack.close()
        raise
    srv.after_stop.append(stack.close)
    return srv


@contextlib.contextmanager
def running(cl: LaunchConfig, caps: Capabilities, **kwargs: Any) -> Iterator[proc.ServerProcess]:
    """`start` as a context manager: the server is stopped and its directory removed however
    the block ends."""
    srv = start(cl, caps, **kwargs)
    try:
        yield srv
    finally:
        srv.stop()
