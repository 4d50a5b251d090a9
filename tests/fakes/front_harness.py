"""Run a Front under uvicorn in a thread, with a test double of the Supervisor.

`SupervisorDouble` implements the Supervisor methods of the supervisor/front contract
(status, wait_ready, report_stall, add_listener, begin_drain, stop) over an upstream the test
owns: a real llama-server it started (`LlamaChild`) or the fault-injecting `FakeUpstream`.
It never fakes llama-server's answers; it only says where the child is and whether it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from mtpwrap import upstream
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.front import loop as event_loop
from mtpwrap.proc import ServerProcess, free_loopback_port
from mtpwrap.supervision.state import State, SupervisorStatus, Upstream
from tests.helpers import until


class SupervisorDouble:
    def __init__(self, base_url: str, api_key: str, state: State = State.READY,
                 pid: int | None = None, socket: str | None = None) -> None:
        self.base_url, self.api_key, self.pid = base_url, api_key, pid
        self.socket = socket
        self.state = state
        self.reason: str | None = None
        self.generation = 1
        self.restarts = 0
        self.started_at = time.time()
        self.child_started_at = time.time()
        self.ready_since = time.time() if state == State.READY else None
        self.last_exit: str | None = None
        self.stalls: list[tuple[int, str]] = []
        self.listeners: list[Callable[[State, State, str | None], None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Condition | None = None
        self.upstream_override: list[Upstream] = []  # handed out once each by wait_ready

    # --- the contract -------------------------------------------------------------
    def status(self) -> SupervisorStatus:
        up = (Upstream(self.base_url, self.api_key, self.generation, self.socket)
              if self.state in (State.READY, State.DRAINING) else None)
        return SupervisorStatus(self.state, self.reason, self.restarts, self.started_at,
                                self.child_started_at, self.ready_since, self.last_exit,
                                self.pid, up)

    async def wait_ready(self, timeout: float) -> Upstream | None:
        if self.upstream_override:
            return self.upstream_override.pop(0)
        if self._changed is None:
            self._changed = asyncio.Condition()
        deadline = asyncio.get_running_loop().time() + timeout
        async with self._changed:
            while True:
                if self.state == State.READY:
                    return self.status().upstream
                if self.state in (State.FAILED, State.DRAINING, State.STOPPING, State.STOPPED):
                    return None
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)

    def report_stall(self, generation: int, reason: str) -> None:
        self.stalls.append((generation, reason))

    def add_listener(self, callback: Callable[[State, State, str | None], None]) -> None:
        self.listeners.append(callback)

    def begin_drain(self) -> None:
        self.set_state(State.DRAINING)

    async def stop(self, grace: float) -> None:
        self.set_state(State.STOPPED)

    # --- test control (any thread) -------------------------------------------------
    def set_state(self, state: State, reason: str | None = None, base_url: str | None = None,
                  new_generation: bool = False) -> None:
        def apply() -> None:
            old = self.state
            self.state, self.reason = state, reason
            if base_url:
                self.base_url = base_url
            if new_generation:
                self.generation += 1
                self.restarts += 1
                self.child_started_at = time.time()
            if state == State.READY:
                self.ready_since = time.time()
            for cb in self.listeners:
                cb(old, state, reason)
            if self._changed is not None:
                cond = self._changed

                async def notify() -> None:
                    async with cond:
                        cond.notify_all()

                asyncio.ensure_future(notify())

        if self.loop is None:
            apply()
        else:
            self.loop.call_soon_threadsafe(apply)


class FrontServer:
    """uvicorn serving `make_front()` in a background thread with its own event loop."""

    def __init__(self, make_front: Callable[[], Any], port: int, supervisor: SupervisorDouble
                 ) -> None:
        self.make_front, self.port, self.supervisor = make_front, port, supervisor
        self.front: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name="front", daemon=True)
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Client connections the server holds open now."""
        return 0 if self._server is None else len(self._server.server_state.connections)

    def _run(self) -> None:
        import uvicorn

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.supervisor.loop = self.loop
            self.front = self.make_front()
            self._server = uvicorn.Server(self.front.server_config(host="127.0.0.1",
                                                                   port=self.port))
            task = asyncio.ensure_future(self._server.serve())
            await until("uvicorn started", lambda: self._server.started or task.done(), 15)
            self._started.set()
            await task
            await self.front.aclose()

        event_loop.run(main())

    def start(self) -> FrontServer:
        self._thread.start()
        if not self._started.wait(15):
            raise RuntimeError("the front did not start")
        return self

    def call(self, coro_factory: Callable[[], Any], timeout: float = 30) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro_factory(), self.loop).result(timeout)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(15)


class LlamaChild:
    """A real llama-server on loopback (or on the UNIX socket `socket`) with an internal key,
    started and killed by the test."""

    def __init__(self, binary: Path, model: Path, port: int, api_key: str,
                 extra: list[str] | None = None, log_path: Path | None = None,
                 socket: Path | None = None) -> None:
        self.binary, self.model, self.port, self.api_key = binary, model, port, api_key
        self.socket = str(socket) if socket is not None else None
        self.extra = extra or []
        self.log_path = log_path
        self.server: ServerProcess | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(socket=self.socket, port=self.port)

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url

    def client(self, **kwargs: Any) -> httpx.Client:
        """A client to this llama-server (mtpwrap's one upstream client), key included."""
        return upstream.client(self.socket, base_url=self.base_url, api_key=self.api_key,
                               **kwargs)

    def start(self, timeout: float = 120) -> LlamaChild:
        from mtpwrap.build.probe import probe
        from mtpwrap.decide import launch
        from mtpwrap.proc import start_server

        # One thread: ggml's threads wait for each other at every op, so two threads on a
        # 2-core machine shared with the suite made a step of the demo model take seconds
        # (600 tokens: over 120 s with two, 44 s with one, same load)
        cfg = launch.plain(self.model, context=4096, slots=2, threads=1, why="test upstream")
        argv = launch.render(cfg, probe(self.binary), binary=self.binary,
                             endpoint=self.endpoint, extra=self.extra).argv
        # the key travels in the environment, not argv
        self.server = start_server(argv, base_url=self.base_url, socket=self.socket,
                                   timeout=timeout, env={"LLAMA_API_KEY": self.api_key},
                                   log_path=self.log_path)
        self.proc = self.server.proc
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.server is not None:
            self.server.kill(sig)

    def slots_busy(self) -> int:
        with self.client(timeout=5) as c:
            r = c.get("/slots")
        r.raise_for_status()
        return sum(1 for s in r.json() if s.get("is_processing"))


@contextlib.contextmanager
def serve_front(base_url: str, api_key: str, config: Any, info: Any = None,
                state: State = State.READY, pid: int | None = None,
                socket: str | None = None, companions: tuple[Any, ...] = ()):
    """A Front over `base_url` (on the UNIX socket `socket`, if given) with a
    SupervisorDouble; yields (server, supervisor). `companions`: (CompanionInfo, base_url,
    api_key) of each companion, each behind a SupervisorDouble of its own."""
    from mtpwrap.front.app import Front

    sup = SupervisorDouble(base_url, api_key, state=state, pid=pid, socket=socket)
    others = [(info_, SupervisorDouble(url, key)) for info_, url, key in companions]
    srv = FrontServer(lambda: Front(sup, config, info, companions=others), free_loopback_port(),
                      sup).start()
    try:
        yield srv, sup
    finally:
        srv.stop()
