"""Admission: how many requests reach llama-server at once, who waits, who is refused.

At most `max_concurrency` slot-taking requests are forwarded at once (llama-server's `-np`);
up to `queue_size` more wait (also while the child restarts) for at most `queue_timeout_s`, then
get 503 + `Retry-After`. Beyond that, requests are refused at once: 429 when the child is ready
(overload), 503 when not. Requests that take no slot (tokenize, props, models, ...) only wait
for a ready child. While draining, every new request is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.run.supervisor import State, SupervisorPort, SupervisorStatus, Upstream
from mtpwrap.serve.metrics import FrontMetrics


class Refusal(Exception):
    """A request admission turns away, with the answer it gets."""

    def __init__(self, status: int, reason: str, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry = status, reason, message, retry


def _ready(st: SupervisorStatus) -> bool:
    return st.state is State.READY and st.upstream is not None


class Admission:
    """The front's counters and its forwarding gate (touched only from the event loop)."""

    def __init__(self, supervisor: SupervisorPort, config: ProxyConfig,
                 metrics: FrontMetrics) -> None:
        self.supervisor = supervisor
        self.config = config
        self.metrics = metrics
        self.inflight = 0     # requests the front holds (queued, forwarding or answering)
        self.queued = 0       # waiting for a slot or a ready child
        self.forwarding = 0   # slot-taking requests sent to llama-server and not finished
        self.draining = False
        self._gate = asyncio.Semaphore(config.max_concurrency)
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ holding

    def hold(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` for no request to be held; True when none is."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.inflight == 0

    # ------------------------------------------------------------------ deciding

    def refuse_draining(self) -> Refusal | None:
        if not self.draining:
            return None
        self.metrics.shed.labels("draining").inc()
        return Refusal(503, "draining", "The server is shutting down.")

    def shed_early(self, slot: bool) -> Refusal | None:
        """Before the body is read: a full queue (overload is answered fast and costs no
        memory)."""
        if not slot or self.queued < self.config.queue_size:
            return None
        st = self.supervisor.status()
        if self.forwarding < self.config.max_concurrency and st.state is State.READY:
            return None
        return self._shed(st)

    def _shed(self, st: SupervisorStatus) -> Refusal:
        ready = st.state is State.READY
        self.metrics.shed.labels("overload" if ready else "not_ready").inc()
        return Refusal(429 if ready else 503, "shed",
                       "The server is busy; retry later." if ready else
                       "The model is not ready; retry later.")

    async def admit(self, slot: bool) -> Upstream:
        """Wait for a forwarding slot (when `slot`) and a ready child; the child's address, or
        Refusal. A slot taken here is given back with `done`."""
        cfg = self.config
        st = self.supervisor.status()
        if not slot:
            if _ready(st):
                assert st.upstream is not None
                return st.upstream
            up = await self.supervisor.wait_ready(cfg.queue_timeout_s)
            if up is None:
                self.metrics.shed.labels("not_ready").inc()
                raise Refusal(503, "not_ready", "The model is not ready; retry later.")
            return up
        if not self._gate.locked() and _ready(st):
            await self._gate.acquire()  # uncontended: returns without suspending
            assert st.upstream is not None
            return self._took(st.upstream)
        if self.queued >= cfg.queue_size:
            raise self._shed(st)
        self.queued += 1
        t = time.perf_counter()
        try:
            return self._took(await self._queue())
        finally:
            self.queued -= 1
            self.metrics.queue_wait.observe(time.perf_counter() - t)

    async def _queue(self) -> Upstream:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s
        while True:
            up = await self.supervisor.wait_ready(max(0.0, deadline - loop.time()))
            if up is None:
                state = self.supervisor.status().state.value
                reason = "queue_timeout" if state in ("starting", "backoff") else "not_ready"
                self.metrics.shed.labels(reason).inc()
                raise Refusal(503, reason, f"The model is not ready ({state}); retry later.")
            try:
                await asyncio.wait_for(self._gate.acquire(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                self.metrics.shed.labels("queue_timeout").inc()
                raise Refusal(503, "queue_timeout",
                              "The server is busy; retry later.") from None
            # The child may have restarted while we waited for a slot: ask again.
            st = self.supervisor.status()
            if _ready(st):
                assert st.upstream is not None
                return st.upstream
            # A restart (planned or not) began meanwhile: wait for the next child in the
            # queue rather than send this request to the one that is going away.
            self._gate.release()

    def _took(self, up: Upstream) -> Upstream:
        self.forwarding += 1
        return up

    def done(self) -> None:
        """A slot-taking request admitted by `admit` has finished."""
        self.forwarding -= 1
        self._gate.release()
