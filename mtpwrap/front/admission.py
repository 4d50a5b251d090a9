"""Admission: how many requests reach llama-server at once, who waits, who is refused.

At most `max_concurrency` slot-taking requests are forwarded at once (llama-server's `-np`);
up to `queue_size` more wait (also while the child restarts) for at most `queue_timeout_s`, then
get 503 + `Retry-After`. Beyond that, requests are refused at once: 429 when the child is ready
(overload), 503 when not. Requests that take no slot (tokenize, props, models, ...) only wait
for a ready child. While draining, every new request is refused.

Priority: a key's class (`class=interactive|batch` on its line) places its requests in the
queue. A freed slot goes to the interactive request that has waited longest; a batch request
only when no interactive one waits — or once it has waited `priority_aging_s`, from when it
counts as interactive, so batch work is never starved. Batch requests may wait
`batch_queue_timeout_s`, interactive ones `queue_timeout_s`. A request may lower its own class
with `X-Mtpwrap-Class: batch` (`mtpwrap documents warm` does), never raise it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front.metrics import FrontMetrics
from mtpwrap.front.reads import Reads
from mtpwrap.supervision.state import State, SupervisorPort, SupervisorStatus, Upstream


class Refusal(Exception):
    """A request admission turns away, with the answer it gets."""

    def __init__(self, status: int, reason: str, message: str, retry: bool = True,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry = status, reason, message, retry
        #: when to come back, where the front knows better than its default (a read's end)
        self.retry_after_s = retry_after_s


#: the queue's classes, by rank (the order they are served in)
RANKS = {"interactive": 0, "batch": 1}
#: a request's own class: it may yield to others, not pass them
CLASS_HEADER = b"x-mtpwrap-class"


def request_class(headers: list[tuple[bytes, bytes]], klass: str) -> str:
    """The class a request is queued in: its key's `klass`, or a lower one its
    X-Mtpwrap-Class header asks for. ValueError (one sentence) for a class that is not one."""
    for name, value in headers:
        if name == CLASS_HEADER:
            asked = value.decode("latin-1").strip().lower()
            if asked not in RANKS:
                raise ValueError(f"X-Mtpwrap-Class: expected one of {', '.join(RANKS)}, got "
                                 f"{asked[:40]!r}.")
            return max(klass, asked, key=RANKS.__getitem__)
    return klass


@dataclass(order=True)
class _Waiter:
    rank: int
    since: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class PriorityGate:
    """`max_concurrency` permits, handed to waiters by class and age (see the module
    docstring); FIFO within a class. Touched only from the event loop."""

    def __init__(self, permits: int, aging_s: float) -> None:
        self.free = permits
        self.aging_s = aging_s
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    def locked(self) -> bool:
        return self.free == 0 or bool(self._waiters)

    def waiting(self) -> dict[str, int]:
        by_rank = {rank: name for name, rank in RANKS.items()}
        out = dict.fromkeys(RANKS, 0)
        for w in self._waiters:
            out[by_rank[w.rank]] += 1
        return out

    async def acquire(self, klass: str = "interactive") -> None:
        if not self.locked():
            self.free -= 1
            return
        loop = asyncio.get_running_loop()
        w = _Waiter(RANKS[klass], loop.time(), next(self._seq), loop.create_future())
        self._waiters.append(w)
        try:
            await w.future
        except asyncio.CancelledError:
            if w in self._waiters:
                self._waiters.remove(w)
            elif w.future.done() and not w.future.cancelled():
                self.release()  # handed a permit as it was cancelled: pass it on
            raise

    def release(self) -> None:
        self.free += 1
        self._hand_on()

    def _next(self, now: float) -> _Waiter:
        def key(w: _Waiter) -> tuple[int, float, int]:
            aged = w.rank and now - w.since >= self.aging_s
            return (0 if aged else w.rank, w.since, w.seq)
        return min(self._waiters, key=key)

    def _hand_on(self) -> None:
        if not self._waiters:
            return
        now = asyncio.get_running_loop().time()
        while self.free > 0 and self._waiters:
            w = self._next(now)
            self._waiters.remove(w)
            if w.future.done():
                continue
            self.free -= 1
            w.future.set_result(None)


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
        self.gate = PriorityGate(config.max_concurrency, config.priority_aging_s)
        self._idle = asyncio.Event()
        self._idle.set()
        #: the reads in progress (the chat model's: a queue timeout says when to come back)
        self.reads: Reads | None = None
        self._sampling: set[asyncio.Task[Any]] = set()

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

    async def admit(self, slot: bool, klass: str = "interactive") -> Upstream:
        """Wait for a forwarding slot (when `slot`) and a ready child; the child's address, or
        Refusal. A slot taken here is given back with `done`. `klass`: the key's class."""
        cfg = self.config
        st = self.supervisor.status()
        if not slot:
            if (up := st.ready_upstream) is not None:
                return up
            up = await self.supervisor.wait_ready(cfg.queue_timeout_s)
            if up is None:
                self.metrics.shed.labels("not_ready").inc()
                raise Refusal(503, "not_ready", "The model is not ready; retry later.")
            return up
        if not self.gate.locked() and (up := st.ready_upstream) is not None:
            await self.gate.acquire(klass)  # uncontended: returns without suspending
            return self._took(up)
        if self.queued >= cfg.queue_size:
            raise self._shed(st)
        self.queued += 1
        t = time.perf_counter()
        try:
            return self._took(await self._queue(klass))
        finally:
            self.queued -= 1
            self.metrics.queue_wait.observe(time.perf_counter() - t)

    async def _queue(self, klass: str) -> Upstream:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.batch_queue_timeout_s if klass == "batch"
                                  else self.config.queue_timeout_s)
        if self.reads is not None:  # the first sample of the read it waits behind: its rate
            task = asyncio.create_task(self.reads.sample())
            self._sampling.add(task)
            task.add_done_callback(self._sampling.discard)
        while True:
            up = await self.supervisor.wait_ready(max(0.0, deadline - loop.time()))
            if up is None:
                state = self.supervisor.status().state.value
                reason = "queue_timeout" if state in ("starting", "backoff") else "not_ready"
                self.metrics.shed.labels(reason).inc()
                raise Refusal(503, reason, f"The model is not ready ({state}); retry later.")
            try:
                await asyncio.wait_for(self.gate.acquire(klass),
                                       max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                self.metrics.shed.labels("queue_timeout").inc()
                raise await self._busy() from None
            # The child may have restarted while we waited for a slot: ask again.
            if (ready := self.supervisor.status().ready_upstream) is not None:
                return ready
            # A restart (planned or not) began meanwhile: wait for the next child in the
            # queue rather than send this request to the one that is going away.
            self.gate.release()

    async def _busy(self) -> Refusal:
        """The 503 of a wait that ran out: how far the read it waited behind is, and when to
        come back (`Retry-After`) from that read's own progress where it is known."""
        if self.reads is None or not await self.reads.sample():
            return Refusal(503, "queue_timeout", "The server is busy; retry later.")
        after = self.reads.retry_after()
        return Refusal(503, "queue_timeout", f"The server is busy: {self.reads.describe()}; "
                       + (f"retry in about {after} s." if after else "retry later."),
                       retry_after_s=after)

    def _took(self, up: Upstream) -> Upstream:
        self.forwarding += 1
        return up

    def done(self) -> None:
        """A slot-taking request admitted by `admit` has finished."""
        self.forwarding -= 1
        self.gate.release()
