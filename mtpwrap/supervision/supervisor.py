"""The single owner of the llama-server child: states, restarts, watchdogs and a clean stop.

One asyncio task (`_run`) owns the child from spawn to reap; everybody else asks through the
methods below (`status`, `wait_ready`, `report_stall`, `begin_drain`, `stop`). Every state
change goes through `_set_state`, which also tells the listeners (metrics, sd_notify).

Life of one child: spawn on its UNIX socket (a stale one from a crash removed first, the
bound one made 0600) or, for a binary that cannot bind one, on loopback with an ephemeral
port, and with a random key (environment, never argv) → STARTING until `/health` is 200
*and* a one-token generation answers (output from the child resets the load-stall timer)
→ READY, watched for exit, failing health, no token progress while requests are processing,
and memory growth → on a crash BACKOFF with a capped exponential delay, FAILED after too
many crashes in a window → on stop SIGTERM, bounded wait, SIGKILL of the process group.

Planned restarts (`reload`: a new command or the same one again; a memory recycle) take the
same path: readiness drops so new requests wait in the front's queue, in-flight ones finish
within a budget, the old child stops and the new one starts (the documents it read are in the
front's document store, front/store.py). A new command that does not start is replaced by the
previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mtpwrap.config.objects import SupervisorConfig
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.errors import MtpwrapError
from mtpwrap.proc import describe_returncode, free_loopback_port
from mtpwrap.supervision import sockets
from mtpwrap.supervision.backoff import RestartPolicy
from mtpwrap.supervision.child import (
    ChildCommand,
    ChildProcess,
    close_file_logger,
    make_file_logger,
)
from mtpwrap.supervision.state import (
    SHUTDOWN_STATES,
    Ended,
    Outcome,
    ReloadPhase,
    State,
    SupervisorStatus,
    Upstream,
    is_valid_transition,
    refuse_transition,
)
from mtpwrap.supervision.wedge import WedgeWatch
from mtpwrap.units import MiB

log = logging.getLogger("mtpwrap.supervisor")

#: a readiness generation that keeps failing is logged once, then summed up at most this often
PROBE_REPORT_S = 5.0

#: the vocabulary is defined in mtpwrap.supervision.state; these are the names the front imports
__all__ = ["PROBE_REPORT_S", "LaunchFactory", "Supervisor"]


class LaunchFactory(Protocol):
    def __call__(self, endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        """The child to run on `endpoint` with `api_key`. `step` > 0 asks for the n-th cheaper
        configuration after repeated out-of-memory starts; None means there is no such step."""


@dataclass
class _Reload:
    """A requested swap of the child: `factory` None restarts with the current one."""

    factory: LaunchFactory | None
    drain_s: float
    done: asyncio.Future[tuple[bool, str]]
    phase: ReloadPhase = ReloadPhase.PENDING
    previous: LaunchFactory | None = None

    def finish(self, ok: bool, message: str) -> None:
        if not self.done.done():
            self.done.set_result((ok, message))


class Supervisor:
    def __init__(self, factory: LaunchFactory, config: SupervisorConfig | None = None,
                 socket: Path | None = None,
                 name: str | None = None) -> None:
        self._factory = factory
        #: its log lines' logger: `mtpwrap.supervisor`, `mtpwrap.supervisor.NAME` for a
        #: companion's
        self.log = log if name is None else log.getChild(name)
        #: llama-server's UNIX socket (None: loopback TCP on a fresh port each start)
        self.socket = socket
        #: requests the front is forwarding now; a planned restart waits for 0 (None: ask the
        #: child's /metrics only)
        self.busy: Callable[[], int] | None = None
        self._reload: _Reload | None = None
        self._spec: ChildCommand | None = None
        self._shown: dict[str, Any] | None = None  #: _spec as shown (ChildCommand.shown)
        self._was_ready = False
        self.config = config or SupervisorConfig()
        self._state = State.STARTING
        self._reason: str | None = "not started yet"
        self._illegal = 0  # transitions refused as illegal (state.refuse_transition)
        self._listeners: list[Callable[[State, State, str | None], None]] = []
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._spawned = asyncio.Event()  # a child was started, or the first start failed
        self._stop_requested = False
        self._shutdown = False
        self._task: asyncio.Task[None] | None = None
        self._child: ChildProcess | None = None
        self._upstream: Upstream | None = None
        self._generation = 0
        self._started_at: float | None = None
        self._ready_since: float | None = None
        self._last_exit: str | None = None
        self._policy = RestartPolicy(self.config)
        self._stall_report: str | None = None  # why the front reports a stalled stream
        self._stop_grace = self.config.stop_grace_s
        self._file_logger = make_file_logger(self.config.log_file, self.config.log_max_bytes,
                                             self.config.log_backups)

    # --- the interface ------------------------------------------------------------------
    def status(self) -> SupervisorStatus:
        child = self._child
        return SupervisorStatus(
            state=self._state, reason=self._reason, restarts=max(0, self._generation - 1),
            started_at=self._started_at,
            child_started_at=child.started_at if child else None,
            ready_since=self._ready_since, last_exit=self._last_exit,
            pid=child.pid if child else None, upstream=self._upstream,
            pid_start=child.leader.start if child and child.leader else None,
            step=self._policy.step, step_note=self._policy.step_note,
            illegal_transitions=self._illegal,
            command=self._shown if child else None,
        )

    @property
    def state(self) -> State:
        return self._state

    def timeline(self) -> dict[str, float | None]:
        """Wall times of the current child: spawned, first /health 200 (llama-server's own
        idea of ready), READY (a generated token). For the instance file and benchmarks."""
        child = self._child
        return {"child_started_at": child.started_at if child else None,
                "child_health_ok_at": child.health_ok_at if child else None,
                "ready_since": self._ready_since}

    def add_listener(self, callback: Callable[[State, State, str | None], None]) -> None:
        self._listeners.append(callback)

    async def start(self) -> None:
        """Start owning a child. Returns at once; use `wait_ready` to wait for the model."""
        if self._task is None:
            self._started_at = time.time()
            self._task = asyncio.create_task(self._run(), name="supervisor")

    async def wait_spawned(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until the first child was started or could not be: True
        when that happened in time."""
        try:
            await asyncio.wait_for(self._spawned.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def wait_ready(self, timeout: float) -> Upstream | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._state is State.READY and self._upstream is not None:
                return self._upstream
            if self._state is State.FAILED or self._state in SHUTDOWN_STATES:
                return None
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                return None

    def report_stall(self, generation: int, reason: str) -> None:
        if self._upstream is None or generation != self._upstream.generation:
            return  # a stream on a child that is already gone
        if self._state is not State.READY:
            return
        self.log.warning("front reports a stalled stream on child generation %d: %s",
                    generation, reason)
        self._stall_report = reason
        self._wake.set()

    def begin_drain(self) -> None:
        """Readiness drops now; the child keeps serving what it has until `stop`."""
        self._shutdown = True
        if self._state not in (State.STOPPING, State.STOPPED):
            self._set_state(State.DRAINING, "shutting down")

    async def reload(self, factory: LaunchFactory | None, drain_s: float) -> tuple[bool, str]:
        """Swap the child for one made by `factory` (None: the same command again): new
        requests wait in the front's queue, in-flight ones finish (at most `drain_s`), the old child
        stops and the new one starts. (True, what happened) once the new child is READY;
        (False, why) when it did not start and the previous command is back."""
        if self._shutdown:
            return False, "mtpwrap is shutting down"
        if self._reload is not None:
            return False, "another reload is in progress"
        if self._state is not State.READY or self._task is None:
            if factory is None:
                return False, f"llama-server is {self._state.value}: nothing to restart"
            self._factory, self._policy.step = factory, 0
            return True, (f"llama-server is {self._state.value}; the new configuration "
                          "applies to its next start")
        rl = _Reload(factory, drain_s, asyncio.get_running_loop().create_future())
        self._reload = rl
        self._wake.set()
        return await asyncio.shield(rl.done)

    def configure(self, config: SupervisorConfig, factory: LaunchFactory | None = None) -> None:
        """Run on `config` from now on, without a restart: the restart policy, the log file's
        rotation, the watchdogs and the budgets; `factory`, when given, is the command the
        child already runs (a new command is `reload`'s)."""
        if factory is not None:
            self._factory = factory
        old, self.config = self.config, config
        self._policy.config = config
        rotation = (config.log_file, config.log_max_bytes, config.log_backups)
        if rotation != (old.log_file, old.log_max_bytes, old.log_backups):
            close_file_logger(self._file_logger)
            self._file_logger = make_file_logger(*rotation)
            if self._child is not None:
                self._child.file_logger = self._file_logger

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.stop_grace_s if grace is None else grace
        self._shutdown = True
        self._stop_requested = True
        self._stop_grace = grace
        if self._state is not State.STOPPED:
            self._set_state(State.STOPPING, "stopping llama-server")
        self._wake.set()
        if self._task is not None:
            # The run task owns the child; it does the SIGTERM → wait → SIGKILL sequence.
            await asyncio.shield(self._task)
        else:
            self._set_state(State.STOPPED, "stopped")
        close_file_logger(self._file_logger)

    # --- the single state setter --------------------------------------------------------
    def _set_state(self, new: State, reason: str | None) -> None:
        """The one way to change state; `state.TRANSITIONS` says which changes are allowed."""
        old = self._state
        if not is_valid_transition(old, new):
            if old in SHUTDOWN_STATES:
                # Once draining, nothing brings readiness back; keep only the news.
                if old is not State.STOPPED:
                    self._reason = reason
            else:
                self._illegal += 1
                refuse_transition(old, new, reason, self.log)
            return
        if new is old and reason == self._reason:
            return
        self._state, self._reason = new, reason
        if new is not State.STARTING:
            self._spawned.set()  # past the first start, whichever way it went
        if new is State.READY:
            self._ready_since = time.time()
        elif old is State.READY:
            self._ready_since = None
        level = logging.WARNING if new in (State.BACKOFF, State.FAILED) else logging.INFO
        self.log.log(level, "state %s -> %s%s", old.value, new.value,
                     f": {reason}" if reason else "")
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for cb in list(self._listeners):
            try:
                cb(old, new, reason)
            except Exception:  # a broken listener must not take the owner down
                self.log.exception("state listener failed")

    # --- the owner loop -----------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while not self._stop_requested:
                outcome = await self._one_child()
                if self._stop_requested or outcome.kind is Outcome.STOP:
                    break
                rl = self._reload
                if outcome.kind in (Outcome.RELOAD, Outcome.RESTART) and rl is not None:
                    rl.phase, rl.previous = ReloadPhase.STARTING, self._factory
                    if rl.factory is not None:
                        self._factory, self._policy.step = rl.factory, 0
                    continue
                if outcome.kind.planned:
                    continue  # planned: no failure, no delay
                if rl is not None and rl.phase is ReloadPhase.STARTING and not self._was_ready:
                    # The new command did not come up: back to the one that worked.
                    self._reload = None
                    if rl.previous is not None:
                        self._factory, self._policy.step = rl.previous, 0
                    rl.finish(False, f"the new llama-server did not start ({outcome.detail}); "
                                     "the previous configuration is starting again")
                    continue
                delay = self._policy.record(
                    outcome, lambda step: self._factory(Endpoint(port=0), "probe-key", step))
                if isinstance(delay, str):
                    self._set_state(State.FAILED, delay)
                    await self._wait_for_stop(None)  # FAILED: stay, report, wait for stop
                    break
                self._set_state(State.BACKOFF, f"{outcome.detail}; restarting in {delay:g}s")
                await self._wait_for_stop(delay)
        except Exception as exc:  # the owner must never die silently
            self.log.exception("supervisor loop failed")
            self._set_state(State.FAILED, f"internal error: {exc}")
            await self._wait_for_stop(None)
        finally:
            if self._reload is not None:
                self._reload.finish(False, "mtpwrap is shutting down")
                self._reload = None
            child = self._child
            if child is not None and child.returncode is None:
                rc = await child.terminate(self._stop_grace)
                self._last_exit = describe_returncode(rc)
            elif child is not None:
                child.kill_group()
                await child.close()
            if self.socket is not None:
                sockets.remove(self.socket)
            self._child, self._upstream = None, None
            self._shutdown = True
            self._set_state(State.STOPPED, "stopped")

    async def _wait_for_stop(self, delay: float | None) -> None:
        """Sleep `delay` seconds (forever when None) unless a stop is requested."""
        loop = asyncio.get_running_loop()
        end = None if delay is None else loop.time() + delay
        while not self._stop_requested:
            remaining = None if end is None else end - loop.time()
            if remaining is not None and remaining <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    async def _one_child(self) -> Ended:
        cfg = self.config
        try:
            endpoint = await self._endpoint()
        except MtpwrapError as exc:
            self._last_exit = "not started"
            return Ended(Outcome.EXIT, exc.message)
        key = secrets.token_urlsafe(32)
        spec = self._factory(endpoint, key, self._policy.step)
        if spec is None:
            raise RuntimeError("the launch factory returned no command for step 0")
        self._generation += 1
        gen = self._generation
        self._spec, self._shown, self._was_ready = spec, spec.shown(), False
        base_url = endpoint.base_url
        self._set_state(State.STARTING, f"starting llama-server (generation {gen})"
                        + (f", {spec.note}" if spec.note else ""))
        try:
            child = await ChildProcess.spawn(
                spec, base_url=base_url, api_key=key, file_logger=self._file_logger,
                lines_per_s=cfg.log_lines_per_s, log_file=cfg.log_file, socket=endpoint.socket)
        except (OSError, ValueError) as exc:
            self._last_exit = "not started"
            return Ended(Outcome.EXIT, f"cannot start {spec.argv[0]}: {exc}")
        self._child = child
        self._upstream = Upstream(base_url, key, gen, endpoint.socket)
        self._stall_report = None  # one about the previous child is not about this one
        self._spawned.set()
        self.log.info("llama-server started: pid %d, %s (generation %d)", child.pid,
                 endpoint.describe(), gen)
        loaded = False
        try:
            outcome = await self._bring_up(child)
            if outcome is None:
                loaded = True
                outcome = await self._watch(child)
        finally:
            if not self._stop_requested:
                rc = await child.terminate(self.config.stop_grace_s)
                self._last_exit = describe_returncode(rc)
                self._child, self._upstream = None, None
        if outcome.kind is Outcome.EXIT and child.saw_oom and not loaded:
            # out of memory while loading; the same line from a served request is a crash
            outcome = Ended(Outcome.OOM, outcome.detail)
        elif loaded and outcome.kind in (Outcome.RECYCLE, Outcome.STOP):
            self._policy.reset_step_down(f"a clean run ({outcome.kind.value})")
        return outcome

    async def _endpoint(self) -> Endpoint:
        """Where the next child listens: the socket, its directory made 0700 and a crashed
        child's socket file removed (it would refuse to bind), or a free loopback port. The
        socket's probe (a connect that can wait up to a second) runs off the loop."""
        if self.socket is None:
            return Endpoint(host=self.config.host, port=free_loopback_port(self.config.host))
        await asyncio.to_thread(sockets.prepare, self.socket)
        return Endpoint(socket=str(self.socket))

    def _exit_outcome(self, child: ChildProcess, when: str) -> Ended:
        rc = child.returncode
        assert rc is not None
        self._last_exit = describe_returncode(rc)
        line = child.last_error_line()
        detail = f"llama-server {when}: {self._last_exit}" + (f" ({line})" if line else "")
        return Ended(Outcome.EXIT, detail)

    async def _bring_up(self, child: ChildProcess) -> Ended | None:
        """Wait for /health 200 and a one-token answer. None when READY."""
        cfg = self.config
        last_health: int | None = -1
        progress = time.monotonic()
        probe_fails, reported_at = 0, 0.0  # failed readiness generations not yet logged
        while True:
            if self._stop_requested:
                return Ended(Outcome.STOP, "stop requested")
            if child.returncode is not None or await child.wait(0) is not None:
                return self._exit_outcome(child, "exited while loading")
            code = await child.health(timeout=max(1.0, cfg.poll_interval_s * 10))
            if code != last_health:
                last_health, progress = code, time.monotonic()
            if code == 200:
                if child.health_ok_at is None:
                    child.health_ok_at = time.time()
                    if child.socket is not None:
                        sockets.seal(Path(child.socket))
                launch = self._spec.launch if self._spec is not None else None
                ok, why = await child.answer_once(launch.serves if launch else None,
                                                  cfg.probe_timeout_s)
                if ok:
                    self._policy.loaded()
                    self._was_ready = True
                    self._set_state(State.READY, None)
                    rl = self._reload
                    if rl is not None and rl.phase is ReloadPhase.STARTING:
                        self._reload = None
                        rl.finish(True, "llama-server restarted with the new configuration"
                                  if rl.factory is not None else "llama-server restarted")
                    return None
                if child.returncode is not None or await child.wait(0.2) is not None:
                    return self._exit_outcome(child, "exited during the first generation")
                probe_fails += 1
                now = time.monotonic()
                if not reported_at or now - reported_at >= PROBE_REPORT_S:
                    if reported_at:
                        self.log.warning("readiness generation failed %d more times in the last "
                                    "%.0fs; last: %s", probe_fails, now - reported_at, why)
                    else:
                        self.log.warning("readiness generation failed: %s (retrying)", why)
                    probe_fails, reported_at = 0, now
                if time.monotonic() - max(progress, child.last_output) > cfg.load_stall_s:
                    return Ended(Outcome.PROBE, f"llama-server does not answer: {why}")
            stalled = time.monotonic() - max(progress, child.last_output)
            if stalled > cfg.load_stall_s:
                return Ended(Outcome.STALL, f"llama-server made no loading progress for "
                             f"{stalled:.0f}s")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), cfg.poll_interval_s)

    async def _watch(self, child: ChildProcess) -> Ended:
        """Watch a READY child until it exits or must be restarted (on the settings of the
        moment: `configure` may change them while it runs)."""
        health_failures = 0
        launch = self._spec.launch if self._spec is not None else None
        wedge = WedgeWatch(self.config.wedge_s,
                           cpu_compute=launch is not None and launch.gpu_layers == 0)
        next_memory = time.monotonic()
        while True:
            cfg = self.config
            wedge.wedge_s = cfg.wedge_s
            if self._stop_requested:
                return Ended(Outcome.STOP, "stop requested")
            self._wake.clear()
            exited = child.returncode is not None
            if not exited:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        _first(child.wait(None), self._wake.wait()), cfg.monitor_interval_s)
                exited = child.returncode is not None
            if self._stop_requested:
                return Ended(Outcome.STOP, "stop requested")
            if exited:
                return self._exit_outcome(child, "exited")
            rl = self._reload
            if rl is not None and rl.phase is ReloadPhase.PENDING:
                rl.phase = ReloadPhase.DRAINING
                kind = Outcome.RELOAD if rl.factory is not None else Outcome.RESTART
                return await self._planned(child, kind, f"{kind.value}ing llama-server",
                                           rl.drain_s)

            if (why := self._stall_report) is not None:
                self._stall_report = None
                if await WedgeWatch.confirm(child, cfg.monitor_interval_s):
                    return Ended(Outcome.WEDGE, f"llama-server stopped producing tokens ({why})")
                self.log.info("stall report ignored: llama-server is still decoding")
                continue

            code = await child.health()
            if code == 200:
                health_failures = 0
            else:
                health_failures += 1
                if health_failures >= cfg.health_failures:
                    return Ended(Outcome.HEALTH, f"/health failed {health_failures} times "
                                 f"(last: {code or 'no answer'})")

            wedged = await wedge.check(child)
            if wedged is not None:
                return Ended(Outcome.WEDGE, wedged)

            if cfg.rss_limit_bytes and time.monotonic() >= next_memory:
                next_memory = time.monotonic() + cfg.memory_interval_s
                used = child.memory_bytes()
                if used > cfg.rss_limit_bytes:
                    return await self._planned(
                        child, Outcome.RECYCLE, f"recycling llama-server: memory {used // MiB} MiB "
                        f"> limit {cfg.rss_limit_bytes // MiB} MiB", cfg.recycle_drain_s)

    def _forwarding(self) -> int:
        return self.busy() if self.busy is not None else 0

    async def _planned(self, child: ChildProcess, kind: Outcome, why: str,
                       drain_s: float) -> Ended:
        """A planned restart: stop routing new work here (requests wait in the front's queue)
        and let in-flight requests finish (at most `drain_s`)."""
        self._set_state(State.STARTING, why)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        # A request the front picked up just before readiness dropped may not have reached
        # the child yet; settle briefly, then require two idle samples in a row.
        await asyncio.sleep(0.3)
        idle = 0
        while loop.time() < deadline and idle < 2 and not self._stop_requested:
            m = await child.metrics()
            if child.returncode is not None:
                break
            busy = (m or {}).get("requests_processing", 0) + (m or {}).get("requests_deferred", 0)
            forwarding = self._forwarding()
            idle = idle + 1 if m is not None and busy == 0 and forwarding == 0 else 0
            await asyncio.sleep(0.2)
        if idle < 2 and not self._stop_requested:
            self.log.warning("%s: drain budget (%gs) spent with requests still running",
                        kind.value, drain_s)
        return Ended(kind, why)


async def _first(*aws: Any) -> None:
    """Return when the first awaitable finishes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
