"""The `up` loop: one asyncio loop runs the supervisor (which owns llama-server), the HTTP
front (uvicorn), mtpwrap's own service loop (sd_notify WATCHDOG/STATUS, the state file) and the
watch on the key file (`keys`).

`Service` has uvicorn's phases: `startup`, `main_loop`, `shutdown`, and signal handlers that
only set flags (SIGTERM/SIGINT: stop, a second one: skip the rest of the drain; SIGHUP: reload;
SIGUSR2: restart). The shutdown order is fixed: leave the balancer's rotation (drain_grace_s)
→ readiness drops (DRAINING) → STOPPING=1 → the front drains in-flight requests within the
drain budget → the supervisor stops llama-server (SIGTERM, bounded wait, SIGKILL of its
group) → the front closes → the state file goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mtpwrap.config.objects import SupervisorConfig, exit_on_failed
from mtpwrap.config.settings import Settings
from mtpwrap.errors import ConfigError
from mtpwrap.service.keys import KeyWatch
from mtpwrap.service.reload import (
    ReloadKind,
    ReloadOutcome,
    ReloadResult,
    ReloadState,
    apply_reload,
    reload_inputs,
)
from mtpwrap.service.startup import Runtime, audit_config, make_front, open_store
from mtpwrap.supervision import instance
from mtpwrap.supervision.state import State
from mtpwrap.supervision.supervisor import Supervisor
from mtpwrap.supervision.systemd import Notifier
from mtpwrap.supervision.writer import LatestWriter

if TYPE_CHECKING:
    import uvicorn

    from mtpwrap.front.app import Front

log = logging.getLogger("mtpwrap.runner")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RELOAD_SIGNALS = {sig: ReloadKind(kind) for kind, sig in instance.RELOAD_SIGNALS.items()}


def bind_public(host: str, port: int) -> socket.socket:
    """Bind the public socket before anything starts, so a port in use is a clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve ({exc.strerror}).") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {host}:{port} is already in use.",
                              hint="Choose another port with --port (MTPWRAP_PORT), or stop "
                                   "what holds it (`mtpwrap down`).") from exc
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: not allowed to bind {host}:{port}.",
                              hint="Use a port above 1023.") from exc
        raise ConfigError(f"--host {host}: cannot bind {host}:{port} ({exc.strerror}).") from exc
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def public_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    return f"http://{shown}:{port}"


class Service:
    """One `up`: construct, then `await serve()` (0 after a clean stop, 1 after a failure)."""

    def __init__(self, runtime: Runtime, sock: socket.socket, notifier: Notifier | None = None,
                 announce: Callable[[Runtime], None] | None = None) -> None:
        #: everything derived for this run; a reload derives a new one and `_use` swaps it in
        self.runtime = runtime
        self.sock = sock
        self.notifier = notifier or Notifier()
        self.announce = announce
        settings = runtime.settings
        #: the listen address: the front's socket, kept until mtpwrap restarts
        self.listen = (settings.host, settings.port)
        self.inputs = reload_inputs(settings)
        # llama-server saves slots in the store's directory: both are the settings' persist.dir
        self.store, self.documents = open_store(settings, runtime.info)
        self.sup = Supervisor(runtime, runtime.supervisor, socket=runtime.socket)
        #: one supervisor per companion: its own child, log, backoff and wedge watch; its
        #: failures never touch the chat model's
        self.companions = {c.name: Supervisor(c, runtime.companion_config(c), socket=c.socket,
                                              name=c.name)
                           for c in runtime.companions}
        self.url = public_url(*self.listen)
        self.reload_state = ReloadState()
        self.exit_code = 0
        # the flags the signal handlers set; the phases act on them
        self.should_exit = asyncio.Event()
        self.force_exit = asyncio.Event()
        self._first_ready = asyncio.Event()
        self._requests: asyncio.Queue[ReloadKind] = asyncio.Queue()
        self._t0 = time.monotonic()
        self._base = self._base_record()
        #: the state file, rewritten on every state change by a thread (never on the loop)
        self._state_file: LatestWriter[dict[str, Any]] = LatestWriter(
            _write_state, name="mtpwrap-state-file")
        self.front: Front | None = None
        #: the front's keys: the key file watched, a reload's keys swapped in
        self.keys: KeyWatch | None = None
        self._server: uvicorn.Server | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._waits: list[asyncio.Task[Any]] = []
        #: tasks started from a state listener, held here until they end
        self._background: set[asyncio.Task[None]] = set()

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def config(self) -> SupervisorConfig:
        """The chat model's supervisor settings."""
        return self.runtime.supervisor

    @property
    def exit_on_failed(self) -> bool:
        return exit_on_failed(self.runtime.exit_on_failed, under_systemd=self.notifier.enabled)

    # --- the phases -----------------------------------------------------------------------
    async def serve(self) -> int:
        with self._signals():
            await self.startup()
            await self.main_loop()
            await self.shutdown()
        return self.exit_code

    async def startup(self) -> None:
        """Start llama-server first and import the HTTP stack while it loads: the imports cost
        a few hundred milliseconds that would otherwise add to the time to ready."""
        sup = self.sup
        sup.add_listener(self._on_state)
        self.record()
        await sup.start()
        for c in self.companions.values():
            c.add_listener(self._on_companion_state)
            await c.start()
        await sup.wait_spawned(1.0)  # the summary names llama-server's pid
        self._use(self.runtime.with_plan())  # the plan left for later, while it loads
        if self.announce is not None:
            self.announce(self.runtime)  # the summary, printed while llama-server loads
        try:
            import uvicorn

            front = make_front(sup, self.runtime, audit_config(self.settings), self.companions,
                               self.documents)
            if self.documents is not None:
                await self.documents.launch(self.runtime.info)
            server_config = front.server_config(timeout_graceful_shutdown=5)
            sup.busy = lambda: front.forwarding
            for name, c in self.companions.items():
                c.busy = front.companion_forwarding(name)
            self.front = front
            self.keys = keys = KeyWatch.for_settings(front, self.settings)
            self.record()
        except BaseException:
            # never leave a child behind a front that could not start
            await asyncio.gather(sup.stop(), *(c.stop() for c in self.companions.values()))
            raise

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # mtpwrap owns the signals (see `Service._signals`)

        self._server = _Server(server_config)
        self._tasks = {
            "front": asyncio.create_task(self._server.serve(sockets=[self.sock]), name="front"),
            "service": asyncio.create_task(self._watchdog_loop(), name="service"),
            "reload": asyncio.create_task(self._reload_loop(), name="reload"),
            "keys": asyncio.create_task(keys.run(), name="keys"),
        }

    async def main_loop(self) -> None:
        """Until a stop signal, a failure that should end mtpwrap, or the front stopping."""
        server_task = self._tasks["front"]
        self._waits = [asyncio.create_task(self.should_exit.wait()), server_task]
        if self.settings.ready_timeout_s > 0:
            self._waits.append(asyncio.create_task(self._ready_deadline()))
        await asyncio.wait(self._waits, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done():
            self.exit_code = 1
            exc = server_task.exception() if not server_task.cancelled() else None
            log.error("the HTTP front stopped unexpectedly: %s", exc)
        elif self.sup.state is State.FAILED or (self.settings.ready_timeout_s > 0
                                                and not self._first_ready.is_set()):
            self.exit_code = 1

    async def shutdown(self) -> None:
        """The documented shutdown order."""
        settings, sup, notifier, front = self.settings, self.sup, self.notifier, self.front
        assert front is not None and self._server is not None
        if settings.drain_grace_s > 0 and not self.force_exit.is_set():
            # Leave the balancer's rotation first: readiness drops, requests are still served.
            front.leaving = True
            notifier.status(f"leaving rotation for {settings.drain_grace_s:g}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.force_exit.wait(), settings.drain_grace_s)
        sup.begin_drain()
        for c in self.companions.values():
            c.begin_drain()
        notifier.stopping("draining: finishing in-flight requests")
        drain_task = asyncio.create_task(front.drain(settings.drain_s))
        force_task = asyncio.create_task(self.force_exit.wait())
        await asyncio.wait([drain_task, force_task], timeout=settings.drain_s + 5,
                           return_when=asyncio.FIRST_COMPLETED)
        for t in (drain_task, force_task):
            t.cancel()
        notifier.status("stopping llama-server")
        self._tasks["reload"].cancel()
        self._tasks["keys"].cancel()
        grace = 0.0 if self.force_exit.is_set() else sup.config.stop_grace_s
        await asyncio.gather(sup.stop(grace), *(c.stop(grace) for c in self.companions.values()))
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._tasks["front"], 10)
        with contextlib.suppress(Exception):
            await front.aclose()
        self._tasks["service"].cancel()
        for t in self._waits:
            t.cancel()
        # the last pending write lands before the file goes (never after: a stale file)
        await asyncio.to_thread(self._state_file.close)
        with contextlib.suppress(OSError):
            instance.instance_path().unlink()
        notifier.status("stopped")

    # --- signal handlers: flags only; the phases run the sequence ------------------------
    def handle_exit(self, signum: int) -> None:
        if self.should_exit.is_set():
            log.warning("second %s: skipping the rest of the drain",
                        signal.Signals(signum).name)
            self.force_exit.set()
        else:
            log.info("%s received: shutting down", signal.Signals(signum).name)
            self.should_exit.set()

    def handle_reload(self, kind: ReloadKind) -> None:
        if not self.should_exit.is_set():
            log.info("%s requested", kind.value)
            self._requests.put_nowait(kind)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig)
        for sig, kind in _RELOAD_SIGNALS.items():
            loop.add_signal_handler(sig, self.handle_reload, kind)
        try:
            yield
        finally:
            for sig in (*_STOP_SIGNALS, *_RELOAD_SIGNALS):
                loop.remove_signal_handler(sig)

    # --- what runs beside the front -------------------------------------------------------
    async def _watchdog_loop(self) -> None:
        # WATCHDOG=1 comes from this loop, not from the child's health: a crashed child is
        # the supervisor's job, a hung mtpwrap is systemd's.
        notifier = self.notifier
        interval = notifier.watchdog_interval()
        extend_every = 5.0
        next_extend = 0.0
        while True:
            if interval:
                notifier.watchdog()
            now = time.monotonic()
            if not self._first_ready.is_set() and self.sup.state is not State.FAILED \
                    and now >= next_extend:
                # The model may take minutes to load; each progress-bounded wait extends the
                # start timeout (the supervisor's stall timer decides what is stuck). Once
                # failed, nothing is loading: TimeoutStartSec may act again.
                notifier.extend_timeout(self.config.load_stall_s + 30)
                next_extend = now + extend_every
            await asyncio.sleep(min(interval or 1.0, 1.0))

    async def _ready_deadline(self) -> None:
        timeout = self.settings.ready_timeout_s
        if await self.sup.wait_ready(timeout) is None and not self.should_exit.is_set():
            log.error("not ready within %.0fs (%s)", timeout, self.sup.status().reason)
            self.should_exit.set()

    async def _reload_loop(self) -> None:
        while True:
            kind = await self._requests.get()
            if self.should_exit.is_set():
                return
            self.reload_state.begin(kind)
            self.record()
            self.notifier.status(f"{kind.value}ing llama-server")
            try:
                front = self.front.config if self.front is not None else self.runtime.front
                res = await apply_reload(kind, self.sup, self.store, self.inputs, self.runtime,
                                         front, self.companions, self.keys)
            except Exception as exc:  # a reload must never take the service down
                log.exception("%s failed", kind.value)
                res = ReloadResult(ReloadOutcome.FAILED, f"{kind.value} failed: {exc}", 1)
            if res.runtime is not None:
                self._use(res.runtime)
                if self.documents is not None:
                    await self.documents.launch(res.runtime.info)
            self.reload_state.end(res)
            if self.front is not None:
                self.front.metrics.reloads.labels(res.outcome.value).inc()
            (log.info if res.outcome is ReloadOutcome.OK else log.warning)(
                "%s %s: %s", kind.value, res.outcome.value, res.message)
            self.notifier.status(f"{kind.value} {res.outcome.value}: {res.message}"[:200])
            self.record()

    def _use(self, runtime: Runtime) -> None:
        """Swap in `runtime` whole: the supervisors take its settings (restart policy, log
        file, budgets) and the chat model its command (a changed one is running already), the
        state file and the front its facts. The listen address and the front's settings but
        its keys (swapped already) stay until mtpwrap restarts (a reload's answer says so). A
        companion takes a new command only through its own restart, which brings the previous
        one back when the new one does not start."""
        host, port = self.listen
        self.runtime = dataclasses.replace(runtime, settings=dataclasses.replace(
            runtime.settings, host=host, port=port))
        self.sup.configure(runtime.supervisor, self.runtime)
        for c in runtime.companions:
            if (csup := self.companions.get(c.name)) is not None:
                csup.configure(runtime.companion_config(c))
        self._base = self._base_record()
        if self.front is not None:
            self.front.info = runtime.info

    # --- the state file and sd_notify -----------------------------------------------------
    def _base_record(self) -> dict[str, Any]:
        info, store = self.runtime.info, self.store
        return {"pid": os.getpid(), "url": self.url, "host": self.listen[0],
                "port": self.listen[1], "profile": info.profile, "model": info.model,
                "binary": info.binary, "log_file": str(self.config.log_file),
                "drain_s": self.settings.drain_s, "stop_grace_s": self.config.stop_grace_s,
                "reload_inputs": self.inputs,
                "persist_dir": str(store.directory) if store is not None else None}

    def record(self) -> None:
        """Have the state file written (by its writer thread: the disk may be slow) and show
        the reload state on /healthz."""
        sup = self.sup
        st = sup.status()
        reload = self.reload_state.to_dict()
        if self.front is not None:
            self.front.reload = reload
        # SupervisorStatus.pid is the child's; the file's pid is mtpwrap's own.
        data = {**st.to_dict(), **sup.timeline(), **self._base, "child_pid": st.pid,
                "child_pgid": st.pid, "child_start": st.pid_start, "updated_at": time.time(),
                "reload": reload,
                "persist": self.documents.summary() if self.documents is not None else None,
                "companions": [{**run.to_dict(), **self.companions[run.name].status().to_dict()}
                               for run in self.runtime.companions]}
        self._state_file.submit(copy.deepcopy(data))  # the thread reads its own copy

    async def _announce_ready(self) -> None:
        """READY=1 once the state file says ready: whoever systemd lets in next reads it."""
        await asyncio.to_thread(self._state_file.flush, 5.0)
        self.notifier.ready(f"ready: {self.runtime.info.profile} at {self.url}")

    def _on_companion_state(self, old: State, new: State, reason: str | None) -> None:
        self.record()

    def _on_state(self, old: State, new: State, reason: str | None) -> None:
        self.record()
        if new is State.READY and not self._first_ready.is_set():
            self._first_ready.set()
            took = time.monotonic() - self._t0
            log.info("ready in %.2fs: %s/v1", took, self.url)
            task = asyncio.create_task(self._announce_ready(), name="ready")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            self.notifier.status(f"{new.value}" + (f": {reason}" if reason else ""))
        if new is State.FAILED and self.exit_on_failed:
            log.error("failed: exiting 1 so that the service manager's restart policy takes "
                      "over (supervisor.exit_on_failed)")
            self.should_exit.set()


def _write_state(data: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a full disk must not stop the service
        instance.write_instance(data)


async def serve(runtime: Runtime, sock: socket.socket, notifier: Notifier | None = None,
                announce: Callable[[Runtime], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT. 0 after a clean stop, 1 after a runtime failure."""
    return await Service(runtime, sock, notifier, announce).serve()
