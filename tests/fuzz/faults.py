"""An untrusted upstream: a TCP relay between the front and the real llama-server that injects
one fault at a time into llama-server's answers, and the scenarios the campaign and CI run
through it.

Faults (each strikes after `after` bytes of an answer have passed): latency before every chunk,
a bandwidth limit, a cut (both sides closed), a reset (RST to the front), a stall of `value`
seconds, a slow close (forwarding stops, the close comes `value` s later), a garbage HTTP head
in place of the real one, and a Content-Length longer than the body (then a close). A request
from the front takes the fault that is set when its first bytes pass the relay.

Properties of every answer (`check`): no 5xx but 502/504, and those only while a fault is set;
a 200 stream ends with `data: [DONE]` or an error event; a 200 plain body is complete JSON or
the connection was cut (the client's HTTP layer says so), never a well-framed truncated body.
After a scenario (the fault cleared) the next request is answered 200, and when all are done
llama-server is processing nothing and the front holds no more upstream connections than its
slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from mtpwrap.proc import free_loopback_port
from tests.helpers import wait_for

KINDS = ("none", "latency", "bandwidth", "cut", "reset", "stall", "slow_close",
         "garbage_head", "bad_length")
#: faults that leave every answer intact (a 502/504 under them is a failure)
BENIGN = ("none", "latency", "bandwidth")
#: the rig's budget for a stream without progress: a stall fault is shorter or longer than it
#: (the wait for the first token stays long, so that a loaded machine's slow prefill is no 504).
#: The campaign's; the CI test gives `rig` a shorter one
STREAM_STALL_S = 6.0


@dataclass(frozen=True)
class Fault:
    kind: str = "none"
    after: int = 0       # bytes of the answer forwarded before the fault strikes
    value: float = 0.0   # seconds (latency, stall, slow close) or bytes per second (bandwidth)

    def __str__(self) -> str:
        return f"{self.kind}(after={self.after}, value={self.value:g})"


class FaultRelay:
    """Listens on a loopback port and forwards to `upstream_port`, applying `fault`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_loopback_port()
        self.fault = Fault()
        self.open = 0  # connections from the front now open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultRelay:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault relay did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
            self._ready.set()
            async with server:
                await self._stop.wait()
        asyncio.run(main())

    async def _connection(self, front_r: asyncio.StreamReader,
                          front_w: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            self.open -= 1
            front_w.close()
            return
        state: dict[str, object] = {"fault": self.fault, "sent": 0, "new": True}

        async def requests() -> None:  # the front -> llama-server, untouched
            while data := await front_r.read(65536):
                if state["new"]:
                    state.update(fault=self.fault, sent=0, new=False)
                up_w.write(data)
                await up_w.drain()
            with contextlib.suppress(OSError):
                up_w.write_eof()

        async def answers() -> None:  # llama-server -> the front, with the fault
            while data := await up_r.read(65536):
                state["new"] = True  # the front's next bytes start its next request
                if not await self._forward(data, state, front_w):
                    return
            front_w.close()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(answers())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if not tasks[1].done():  # the front closed: let the answer finish, briefly
                await asyncio.wait([tasks[1]], timeout=5)
        finally:
            for t in tasks:
                t.cancel()
            for w in (front_w, up_w):
                with contextlib.suppress(Exception):
                    w.close()
            self.open -= 1

    async def _forward(self, data: bytes, state: dict[str, object],
                       w: asyncio.StreamWriter) -> bool:
        """Forward one chunk under the connection's fault; False: the connection is done."""
        f = state["fault"]
        assert isinstance(f, Fault)
        sent = state["sent"]
        assert isinstance(sent, int)
        state["sent"] = sent + len(data)
        if f.kind == "latency":
            await asyncio.sleep(f.value)  # the fault: latency on every chunk
        elif f.kind == "bandwidth":
            for i in range(0, len(data), 256):
                w.write(data[i:i + 256])
                await w.drain()
                await asyncio.sleep(256 / f.value)  # the fault: a narrow link
            return True
        elif f.kind == "garbage_head" and sent == 0:
            w.write(b"HTTP/1.1 2OO NOT\r\nContent-Lxngth: x\r\n\x00\r\n\r\n" + data[:40])
            await w.drain()
            w.close()
            return False
        elif f.kind == "bad_length" and sent == 0 and b"\r\n\r\n" in data:
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            for i, line in enumerate(lines):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    lines[i] = b"Content-Length: %d" % (int(value) + 100)
            w.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            await w.drain()
            await asyncio.sleep(f.value)  # the fault: the promised bytes never come
            w.close()
            return False
        elif f.kind in ("cut", "reset", "stall", "slow_close") and sent + len(data) > f.after:
            keep = max(0, f.after - sent)
            w.write(data[:keep])
            await w.drain()
            if f.kind == "stall":
                await asyncio.sleep(f.value)  # the fault: a stall mid-stream
                w.write(data[keep:])
                await w.drain()
                state["fault"] = Fault()  # it struck once
                return True
            if f.kind == "slow_close":
                await asyncio.sleep(f.value)  # the fault: a pause before the close
            sock = w.get_extra_info("socket")
            if f.kind == "reset" and sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.close()
            return False
        w.write(data)
        await w.drain()
        return True


# --------------------------------------------------------------------------- scenarios

#: (route, stream, body) the scenarios send: 8 tokens at most
REQUESTS = (
    ("/v1/chat/completions", True, {"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 8, "stream": True}),
    ("/v1/chat/completions", False, {"messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 8}),
    ("/completion", True, {"prompt": "Once upon a time", "n_predict": 8, "stream": True}),
    ("/completion", False, {"prompt": "Once upon a time", "n_predict": 8}),
    ("/tokenize", False, {"content": "Hello there"}),
)


def random_fault(rng: random.Random, stall_s: float = STREAM_STALL_S) -> Fault:
    """A fault drawn from `rng`; a stall is 0.3 s or 1 s longer than the stream budget
    `stall_s`."""
    kind = rng.choice(KINDS)
    after = rng.choice((0, 1, 17, 60, 200, 400, 1000, 5000))
    value = {"latency": rng.choice((0.01, 0.1, 0.4)), "bandwidth": rng.choice((2000.0, 20000.0)),
             "stall": rng.choice((0.3, stall_s + 1)), "slow_close": rng.choice((0.1, 1.0)),
             "bad_length": rng.choice((0.0, 0.5))}.get(kind, 0.0)
    return Fault(kind, after, value)


def ask(client: httpx.Client, route: str, stream: bool, body: dict) -> tuple[int | None, str]:
    """Send one request; (status, what came): "complete", "error-event", "cut" (the client's
    HTTP layer saw the connection end early), "truncated" (framed complete, content not), or
    "no answer"."""
    try:
        if stream:
            with client.stream("POST", route, json=body) as r:
                text = b"".join(r.iter_bytes()).decode("utf-8", "replace")
                events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
                if r.status_code != 200:
                    return r.status_code, "complete"
                if events and events[-1] == "[DONE]":
                    return 200, "complete"
                if events and events[-1].startswith('{"error"'):
                    return 200, "error-event"
                if events and json.loads(events[-1]).get("stop") is True:
                    return 200, "complete"  # llama-server's native stream ends so
                return 200, "truncated"
        r = client.post(route, json=body)
    except (httpx.RemoteProtocolError, httpx.ReadError) as err:
        return None, f"cut: {type(err).__name__}"
    except httpx.HTTPError as err:
        return None, f"no answer: {type(err).__name__}"
    try:
        json.loads(r.content)
    except ValueError:
        return r.status_code, "truncated"
    return r.status_code, "complete"


def check(fault: Fault, status: int | None, what: str) -> str | None:
    """The class of a broken promise, or None."""
    if status is None:
        if what.startswith("cut") and fault.kind not in BENIGN:
            return None
        return f"{what} under {fault.kind}"
    if status >= 500 and status not in (502, 504):
        return f"{status} under {fault.kind}"
    if status in (502, 504) and fault.kind in BENIGN:
        return f"{status} without a fault ({fault.kind})"
    if what == "truncated":
        return f"a {status} answer framed complete but truncated under {fault.kind}"
    if fault.kind in BENIGN and status != 200:
        return f"{status} without a fault ({fault.kind})"
    return None


def scenario(client: httpx.Client, relay: FaultRelay, rng: random.Random,
             stall_s: float = STREAM_STALL_S) -> list[str]:
    """One fault, one to three requests under it, then the fault cleared and one plain request
    that must be answered 200 (the front recovered). Returns the broken promises."""
    fault = random_fault(rng, stall_s)
    relay.fault = fault
    bad = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        route, stream, body = rng.choice(REQUESTS)
        status, what = ask(client, route, stream, body)
        if (why := check(fault, status, what)) is not None:
            bad.append(f"{why} [{route}{' stream' if stream else ''}, {fault}]")
    relay.fault = Fault()
    route, stream, body = rng.choice(REQUESTS)
    status, what = ask(client, route, stream, body)
    if status != 200 or what != "complete":
        bad.append(f"not recovered after {fault.kind}: {status} {what} [{route}]")
    return bad


INTERNAL = "fault-internal-key-0123"
KEY = "fault-client-key-0123"


@contextlib.contextmanager
def rig(binary: Path, model: Path, work: Path, stall_s: float = STREAM_STALL_S
        ) -> Iterator[Rig]:
    """The real llama-server, the relay in front of it and the front (in this process) over
    the relay, with stall budgets short enough for a scenario to see them (`stall_s` for a
    stream without progress after its first chunk)."""
    from mtpwrap.config.objects import ProxyConfig
    from tests.fakes.front_harness import LlamaChild, serve_front

    work.mkdir(parents=True, exist_ok=True)
    child = LlamaChild(binary, model, free_loopback_port(), INTERNAL,
                       extra=["-c", "4096", "-b", "64", "-ub", "64"],
                       log_path=work / "llama.log").start(timeout=300)
    relay = FaultRelay(child.port).start()
    cfg = ProxyConfig(api_keys=(KEY,), stream_stall_s=stall_s, prefill_stall_s=30.0,
                      connect_timeout_s=2.0, keepalive_s=1.0, queue_timeout_s=30.0)
    try:
        with serve_front(relay.base_url, INTERNAL, cfg) as (srv, _sup), httpx.Client(
                base_url=srv.url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as c:
            yield Rig(c, relay, child.client(timeout=10), stall_s)
        # the front is gone: every connection it had through the relay must close
        with contextlib.suppress(TimeoutError):
            wait_for("the front's connections closed", lambda: relay.open == 0, 10, every=0.05)
    finally:
        relay.stop()
        child.kill()


@dataclass
class Rig:
    client: httpx.Client      # to the front
    relay: FaultRelay
    llama: httpx.Client       # to llama-server itself
    stall_s: float = STREAM_STALL_S  # the front's budget for a stream without progress

    def processing(self) -> int:
        """Slots llama-server is working on, from its own /slots."""
        return sum(1 for s in self.llama.get("/slots").json() if s.get("is_processing"))

    def settled(self, timeout: float = 15) -> tuple[int, int]:
        """Wait until llama-server processes nothing and the front's connections through the
        relay are no more than its slots; return both counts as they then stood."""
        with contextlib.suppress(TimeoutError):
            wait_for("settled", lambda: self.processing() == 0 and self.relay.open <= 2,
                     timeout, every=0.05)
        return self.processing(), self.relay.open


def run_scenarios(r: Rig, n: int, seed: int, seconds: float = 1e9) -> tuple[int, list[str]]:
    """Up to `n` scenarios (or `seconds`); (how many ran, the broken promises)."""
    rng = random.Random(seed)
    bad: list[str] = []
    end = time.monotonic() + seconds
    done = 0
    while done < n and time.monotonic() < end:
        bad += scenario(r.client, r.relay, rng, r.stall_s)
        done += 1
    busy, held = r.settled()
    if busy:
        bad.append(f"llama-server still processing {busy} request(s) after the scenarios")
    if held > 2:
        bad.append(f"the front holds {held} connections to llama-server, more than its slots")
    return done, bad
