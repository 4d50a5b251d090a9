"""An HTTP upstream that misbehaves on demand, for faults the real llama-server cannot show:
a reset or a cut in the middle of a stream, a stall before or after the first event, an endless
fast stream (for slow-reader tests), a close right after reading the request, an error of any
shape after a long wait.

It is a raw asyncio socket server on purpose: the faults live below HTTP (RST, half-written
chunks), which no HTTP framework lets a handler produce. It runs in its own thread and records
every request and every time its peer (the front) closed a connection.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import wait_for


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    closed_at: float | None = None   # when the peer closed this connection (time.monotonic)


#: the modes that answer with an event stream (`hold` waits after its head)
_STREAMS = frozenset({"sse", "truncate", "reset", "stall_after", "endless"})


@dataclass
class FakeUpstream:
    """Behaviour is chosen by `mode` (set by the test) for every request that follows."""

    mode: str = "sse"
    events: int = 5
    interval: float = 0.01
    cut_after: int = 2
    chunk_bytes: int = 200
    #: mode "late_error": after `interval` seconds, this status, content type and body
    late_error: tuple[int, str, bytes] = (400, "application/json", b'{"error": "boom"}')
    #: the tokens of a prompt slot 0 has read so far and of its answer generated, as `/slots`
    #: says (`slot_read` None: no slot working)
    slot_read: int | None = None
    slot_decoded: int = 0
    #: while an Event not yet set: every answer to a POST waits for it (the test pins "the
    #: request is still in flight" as long as it needs, then sets it) — a stream after its head
    #: and `hold_after` events, any other answer before its first byte
    hold: threading.Event | None = None
    hold_after: int = 0
    #: llama-server's tokenizer (`/apply-template`, `/tokenize`) answers 500
    tokenizer_fails: bool = False
    #: llama-server's counts (`{"prompt_tokens": …, "completion_tokens": …}`), said by a whole
    #: answer (mode "json") and by a stream's last event; None: answers say none
    usage: dict[str, int] | None = None
    api_key: str = "internal-key-0123456789"
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-upstream", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeUpstream:
        self._thread.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(shutdown()))
        self._thread.join(5)

    def wait_closed(self, index: int, timeout: float) -> float | None:
        """When (time.monotonic) request `index`'s connection was closed by the front; None
        if it was not within `timeout` seconds."""
        def closed() -> bool:
            return len(self.seen) > index and self.seen[index].closed_at is not None

        try:
            wait_for(f"request {index}'s connection closed", closed, timeout, every=0.01)
        except TimeoutError:
            return None
        return self.seen[index].closed_at

    # ------------------------------------------------------------------ server

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            self.port = self._server.sockets[0].getsockname()[1]

        loop.run_until_complete(boot())
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            if self._server is not None:
                self._server.close()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        prefix = b""
        try:
            while True:
                head = prefix + await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                seen = Seen(method, path, headers, body, time.monotonic())
                self.seen.append(seen)
                watcher = asyncio.ensure_future(self._watch_eof(reader, seen))
                try:
                    keep = await self._respond(writer, seen)
                finally:
                    watcher.cancel()
                    # The watcher may have read the first byte of the next request.
                    prefix = (await asyncio.gather(watcher, return_exceptions=True))[0]
                    if not isinstance(prefix, bytes):
                        prefix = b""
                if not keep or (seen.closed_at is not None):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            if not writer.is_closing():
                writer.close()

    async def _watch_eof(self, reader: asyncio.StreamReader, seen: Seen) -> bytes:
        try:
            data = await reader.read(1)
        except ConnectionError:
            data = b""
        if not data:
            seen.closed_at = time.monotonic()
        return data

    async def _held(self, seen: Seen) -> None:
        """Wait while `hold` is an Event not yet set (a POST's answer); no longer once the
        front let go."""
        while self.hold is not None and not self.hold.is_set() and seen.method == "POST" \
                and seen.closed_at is None:
            await asyncio.sleep(0.01)  # a look at the test's event, not a pace

    def _event(self, i: int) -> bytes:
        payload = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                   "model": "fake", "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                                 "finish_reason": None}]}
        pad = max(0, self.chunk_bytes - 120)
        if pad:
            payload["pad"] = "x" * pad
        # compact, as llama-server writes its events
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    @staticmethod
    async def _whole(w: asyncio.StreamWriter, status: bytes, ctype: bytes, body: bytes,
                     extra: bytes = b"") -> bool:
        """One whole answer with its Content-Length; True: the connection may go on."""
        w.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\n%sContent-Length: %d\r\n\r\n%s"
                % (status, ctype, extra, len(body), body))
        await w.drain()
        return True

    async def _respond(self, w: asyncio.StreamWriter, seen: Seen) -> bool:
        mode = self.mode
        if seen.headers.get("authorization") != f"Bearer {self.api_key}":
            body = (b'{"error":{"code":401,"message":"Invalid API Key",'
                    b'"type":"authentication_error"}}')
            return await self._whole(w, b"401 Unauthorized", b"application/json", body)
        if seen.path == "/metrics":
            # llama-server's exposition format, as its --metrics flag serves it
            body = (b"# HELP llamacpp:tokens_predicted_total Number of generation tokens.\n"
                    b"# TYPE llamacpp:tokens_predicted_total counter\n"
                    b"llamacpp:tokens_predicted_total 300\n"
                    b"# HELP llamacpp:tokens_predicted_seconds_total Generation time.\n"
                    b"# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
                    b"llamacpp:tokens_predicted_seconds_total 2\n"
                    b"# HELP llamacpp:requests_processing Requests processing.\n"
                    b"# TYPE llamacpp:requests_processing gauge\n"
                    b"llamacpp:requests_processing 0\n")
            return await self._whole(w, b"200 OK", b"text/plain; version=0.0.4", body)
        if seen.path == "/slots":
            # llama-server's metrics form: slot 0 working (`slot_read` tokens of its prompt
            # read, `slot_decoded` of its answer generated), or no slot working (a request that
            # waits is not being read)
            read = self.slot_read
            slots = [] if read is None else [{
                "id": 0, "id_task": 7, "is_processing": True, "n_prompt_tokens": read,
                "n_prompt_tokens_processed": read, "n_prompt_tokens_cache": 0,
                "next_token": [{"n_decoded": self.slot_decoded}]}]
            body = json.dumps(slots).encode()
            return await self._whole(w, b"200 OK", b"application/json", body)
        if seen.path in ("/apply-template", "/tokenize") and self.tokenizer_fails:
            return await self._whole(w, b"500 Internal Server Error", b"application/json",
                                     b'{"error": {"code": 500, "message": "tokenizer"}}')
        if seen.path in ("/apply-template", "/tokenize"):
            # llama-server's tokenizer, asked by the front to charge a cut request's prompt
            body = (b'{"prompt": "fake prompt"}' if seen.path == "/apply-template"
                    else b'{"tokens": [1, 2, 3]}')
            return await self._whole(w, b"200 OK", b"application/json", body)
        if mode not in _STREAMS:
            await self._held(seen)
        if mode == "close_without_response":
            w.close()
            return False
        if mode == "stall_before_headers":
            await asyncio.sleep(3600)  # the fault: an upstream that never answers
            return False
        if mode == "json":
            answer: dict[str, Any] = {"ok": True, "path": seen.path}
            body = json.dumps(answer | ({"usage": self.usage} if self.usage else {})).encode()
            return await self._whole(w, b"200 OK", b"application/json", body,
                                     b"Access-Control-Allow-Origin: *\r\n")
        if mode == "late_error":
            await asyncio.sleep(self.interval)  # the front has sent its event-stream head
            status, ctype, body = self.late_error
            return await self._whole(w, b"%d Fault" % status, ctype.encode(), body)
        if mode == "cut_error":
            await asyncio.sleep(self.interval)  # the front may have sent its event-stream head
            w.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 200\r\n\r\n{\"error\": {\"mess")
            await w.drain()
            w.close()  # the fault: the error's body cut short
            return False
        if mode == "slow_json":
            await asyncio.sleep(self.interval)  # the fault: a slow answer
            body = b'{"ok": true}'
            return await self._whole(w, b"200 OK", b"application/json", body)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nAccess-Control-Allow-Origin: *\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        i = 0
        while True:
            if mode in ("truncate", "reset", "stall_after") and i == self.cut_after:
                if mode == "truncate":
                    # Half an event, then a plain close: no terminating chunk.
                    w.write(self._chunk(b'data: {"choices": [{"delta": {"cont'))
                    await w.drain()
                    w.close()
                elif mode == "reset":
                    sock = w.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    w.transport.abort()
                else:
                    await asyncio.sleep(3600)  # the fault: a stream that stalls
                return False
            if mode != "endless" and i >= self.events:
                break
            if i == self.hold_after:
                await self._held(seen)
            if seen.closed_at is not None:  # the front let go: a cancel, as llama-server takes it
                return False
            w.write(self._chunk(self._event(i)))
            await w.drain()
            i += 1
            if mode != "endless" and self.interval:
                await asyncio.sleep(self.interval)  # the fake's pace between events
            else:
                await asyncio.sleep(0)  # drain() does not yield while the reader keeps up
        if self.usage:
            w.write(self._chunk(b'data: {"choices":[],"usage":%s}\n\n'
                                % json.dumps(self.usage).encode()))
        w.write(self._chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await w.drain()
        return True


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments skipped)."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:].decode())
    return out


def describe(seen: list[Seen]) -> list[dict[str, Any]]:
    return [{"method": s.method, "path": s.path} for s in seen]
