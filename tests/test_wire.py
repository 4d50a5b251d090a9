"""The relay's wire (`mtpwrap.supervision.wire`) against small HTTP servers on real UNIX and TCP
sockets, each answering the way a test needs: chunked streams in pieces, kept and closed
connections, answers cut short, bytes that are not HTTP."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from mtpwrap import upstream
from mtpwrap.supervision import wire
from mtpwrap.supervision.state import Upstream
from mtpwrap.supervision.wire import BadResponse, ConnectFailed, Disconnected, WirePool
from tests.helpers import until

JSON = b'{"ok":true}'


class Server:
    """A UNIX-socket (or loopback TCP) server that counts its connections and keeps the
    requests it read; `answer(server, reader, writer)` serves one connection."""

    def __init__(self, answer: Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter],
                                        Awaitable[None]], tcp: bool = False) -> None:
        self.answer, self.tcp = answer, tcp
        self.accepted = 0
        self.ended = 0  # connections whose serving ended (the client closed, mostly)
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.path = str(upstream.private_socket_dir("s.sock") / "s.sock")
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Server:
        if self.tcp:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
        else:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._server is not None
        self._server.close()
        shutil.rmtree(Path(self.path).parent, ignore_errors=True)

    @property
    def upstream(self) -> Upstream:
        if self.tcp:
            return Upstream(f"http://127.0.0.1:{self.port}", "k", 1)
        return Upstream("http://llama", "k", 1, socket=self.path)

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request (head and Content-Length body); False at the connection's end."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        self.bodies.append(await reader.readexactly(length) if length else b"")
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self.answer(self, reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.ended += 1


def json_head(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(body))


async def keep_alive(srv: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with JSON, keeping it open."""
    while await srv.read_request(reader):
        writer.write(json_head(JSON) + JSON)
        await writer.drain()


def pool() -> WirePool:
    return WirePool(connect_timeout_s=2.0, write_timeout_s=2.0)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def get(p: WirePool, s: Server, path: str = "/v1/models", keep: bool = True) -> bytes:
    r = await p.request(s.upstream, "GET", path, [], b"", keep=keep)
    try:
        assert r.status == 200
        return await r.read()
    finally:
        await r.aclose()


def test_a_chunked_stream_arrives_whole_and_what_came_together_is_one_chunk() -> None:
    events = [b'data: {"i": %d}\n\n' % i for i in range(5)]
    release = asyncio.Event()

    async def stream(srv: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for ev in events[:2]:  # one at a time, each after the client has taken the last
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
            await release.wait()
            release.clear()
        # the rest in one write: one read takes all of it
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(ev), ev) for ev in events[2:])
                     + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    async def main() -> None:
        async with Server(stream) as s:
            p = pool()
            r = await p.request(s.upstream, "POST", "/v1/chat/completions",
                                [(b"content-type", b"application/json")], b'{"stream":true}',
                                keep=False)
            assert r.status == 200 and r.header(b"content-type") == b"text/event-stream"
            got = []
            async for chunk in r.chunks():
                got.append(chunk)
                release.set()
            await r.aclose()
            assert got[:2] == events[:2]
            assert got[2:] == [b"".join(events[2:])]
            assert s.bodies == [b'{"stream":true}']
            head = s.heads[0]
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: llama\r\n")
            assert b"content-length: 15\r\n" in head
            assert p.idle() == 0  # keep=False: the connection ended with the answer

    run(main())


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_kept_connections_serve_the_next_request(tcp: bool) -> None:
    async def main() -> None:
        async with Server(keep_alive, tcp=tcp) as s:
            p = pool()
            for _ in range(5):
                assert await get(p, s) == JSON
            assert s.accepted == 1 and p.idle() == 1
            if tcp:
                assert b"host: 127.0.0.1:%d\r\n" % s.port in s.heads[0]
            assert b"content-length" not in s.heads[0]  # a GET without a body
            await p.aclose()
            assert p.idle() == 0

    run(main())


def test_keep_false_and_connection_close_end_the_connection() -> None:
    async def closes(srv: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(json_head(JSON, b"connection: close\r\n") + JSON)
        await writer.drain()

    async def main() -> None:
        async with Server(keep_alive) as s:
            p = pool()
            for _ in range(3):
                assert await get(p, s, keep=False) == JSON
            assert s.accepted == 3 and p.idle() == 0
        async with Server(closes) as s:
            p = pool()
            for _ in range(3):
                assert await get(p, s) == JSON  # the server said close: never pooled
            assert s.accepted == 3 and p.idle() == 0

    run(main())


def test_a_connection_the_server_closed_while_idle_is_not_taken() -> None:
    async def once(srv: Server, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
        # keeps the connection by its headers, then closes it while the client holds it idle
        await srv.read_request(reader)
        writer.write(json_head(JSON) + JSON)
        await writer.drain()

    async def main() -> None:
        async with Server(once) as s:
            p = pool()
            for _ in range(4):
                assert await get(p, s) == JSON  # no failure: a fresh connection each time
                assert p.idle() == 1
                await until("the server's close reaching the pool", lambda: p.idle() == 0, 5.0)
            assert s.accepted == 4

    run(main())


def test_an_idle_connection_past_its_expiry_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "KEEPALIVE_EXPIRY_S", 0.2)

    async def main() -> None:
        async with Server(keep_alive) as s:
            p = pool()
            assert await get(p, s) == JSON
            assert await get(p, s) == JSON
            assert s.accepted == 1
            await until("the expiry", lambda: p.idle() == 0, 5.0)
            assert await get(p, s) == JSON
            assert s.accepted == 2

    run(main())


def test_a_bursts_connections_close_after_their_expiry_without_another_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "KEEPALIVE_EXPIRY_S", 0.3)

    async def main() -> None:
        async with Server(keep_alive) as s:
            p = WirePool(connect_timeout_s=2.0, write_timeout_s=2.0, max_idle=3)
            # six at once: six connections, of which no more than three are kept
            assert await asyncio.gather(*(get(p, s) for _ in range(6))) == [JSON] * 6
            assert s.accepted == 6 and p.idle() == 3
            await until("the three beyond max_idle closed", lambda: s.ended == 3, 5.0)
            # nothing more is asked: the sweep closes the kept ones once they expire
            await until("the kept connections expired", lambda: p.idle() == 0 and s.ended == 6,
                        5.0)
            assert await get(p, s) == JSON and s.accepted == 7  # and the pool still serves
            await p.aclose()

    run(main())


def test_an_answer_cut_short_is_disconnected_and_not_reused() -> None:
    async def cut(srv: Server, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()  # and the connection ends without the last chunk

    async def main() -> None:
        async with Server(cut) as s:
            p = pool()
            r = await p.request(s.upstream, "POST", "/completion", [], b"{}")
            got = []
            with pytest.raises(Disconnected) as err:
                async for chunk in r.chunks():
                    got.append(chunk)
            await r.aclose()
            assert got == [b"hello"] and err.value.kind == "disconnected"
            assert p.idle() == 0

    run(main())


def test_no_answer_at_all_is_disconnected() -> None:
    async def silent(srv: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)

    async def main() -> None:
        async with Server(silent) as s:
            with pytest.raises(Disconnected, match="without an answer"):
                await pool().request(s.upstream, "POST", "/completion", [], b"{}")

    run(main())


def test_bytes_that_are_not_http_are_a_bad_response() -> None:
    async def garbage(srv: Server, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Server(garbage) as s:
            with pytest.raises(BadResponse) as err:
                await pool().request(s.upstream, "GET", "/health", [], b"")
            assert err.value.kind == "protocol"

    run(main())


def test_a_missing_socket_or_closed_port_is_a_failed_connect(tmp_path: Path) -> None:
    async def main() -> None:
        gone = Upstream("http://llama", "k", 1, socket=str(tmp_path / "none.sock"))
        with pytest.raises(ConnectFailed, match="none.sock") as err:
            await pool().request(gone, "GET", "/health", [], b"")
        assert err.value.kind == "connect"
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await pool().request(Upstream(f"http://127.0.0.1:{port}", "k", 1), "GET",
                                 "/health", [], b"")

    run(main())


def test_a_head_answer_has_no_body_and_its_connection_ends() -> None:
    async def head(srv: Server, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
        while await srv.read_request(reader):
            writer.write(json_head(b"x" * 40))  # the length a GET would have, and no body
            await writer.drain()

    async def main() -> None:
        async with Server(head) as s:
            p = pool()
            r = await p.request(s.upstream, "HEAD", "/v1/models", [], b"")
            assert r.status == 200 and r.header(b"content-length") == b"40"
            assert await r.read() == b""
            await r.aclose()
            assert p.idle() == 0

    run(main())
