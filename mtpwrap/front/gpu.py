"""The GPU gauges of /metrics, /healthz and /status.json, read off the event loop: NVML opened
once (`hardware.NvmlSession`), each read in a worker thread, awaited for at most `timeout_s`,
and kept for `max_age_s` so that pages polled every few seconds read NVML once between them.

NVML init is slow without persistence mode and can hang on some drivers. A read that does not
answer in time leaves the pages with the last readings, marked `stale` with their age (or
`unavailable` when there are none), and no second read is started while it hangs: at most one
thread waits on NVML, and the loop that serves streams, /livez and the systemd watchdog never
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtpwrap.decide.hardware import GpuReading, NvmlSession

#: a reading younger than this is served from the cache
MAX_AGE_S = 2.0
#: how long a page waits for NVML before it answers with what it has
TIMEOUT_S = 0.5


@dataclass(frozen=True)
class GpuView:
    """What the pages show of the GPUs: the readings and how current they are."""

    readings: tuple[GpuReading, ...] = ()
    #: "fresh" (read within max_age_s), "stale" (NVML has not answered since: the last
    #: readings) or "unavailable" (no readings: no driver, NVML failed, or it never answered)
    state: str = "unavailable"
    age_s: float | None = None  # since the readings were taken
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state,
                "age_s": None if self.age_s is None else round(self.age_s, 1),
                "reason": self.reason}


class GpuGauge:
    """One front's GPU readings: `await view()` on a request, `current()` where nothing may
    wait (the metrics collector)."""

    def __init__(self, read: Callable[[], list[GpuReading]] | None = None, *,
                 max_age_s: float = MAX_AGE_S, timeout_s: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = NvmlSession() if read is None else None
        self._read = read if read is not None else self._session.readings  # type: ignore[union-attr]
        self.max_age_s, self.timeout_s, self._clock = max_age_s, timeout_s, clock
        self._readings: tuple[GpuReading, ...] = ()
        self._read_at: float | None = None  # when the last read answered
        self._error: str | None = None  # the last read's failure
        self._pending: asyncio.Future[None] | None = None
        self._since = 0.0  # when the pending read began

    async def view(self) -> GpuView:
        """The readings, read again when older than max_age_s; never waits past timeout_s."""
        now = self._clock()
        if self._pending is None and (self._read_at is None
                                      or now - self._read_at >= self.max_age_s):
            self._start()
        pending = self._pending
        if pending is not None:
            left = self.timeout_s - (now - self._since)
            if left > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(pending), left)
        return self.current()

    def current(self) -> GpuView:
        """What is known now, without reading."""
        now = self._clock()
        age = None if self._read_at is None else now - self._read_at
        if self._pending is not None and now - self._since >= self.timeout_s:
            why = f"NVML has not answered for {now - self._since:.1f}s"
            if self._read_at is None:
                return GpuView(state="unavailable", reason=why)
            return GpuView(self._readings, "stale", age, why + "; the readings are the last it "
                           "gave")
        if self._error is not None:
            return GpuView(state="unavailable", age_s=None, reason=self._error)
        if self._read_at is None:
            return GpuView(state="unavailable", reason="not read yet")
        return GpuView(self._readings, "fresh", age, None)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        pending: asyncio.Future[None] = loop.create_future()
        self._pending, self._since = pending, self._clock()

        def settle(readings: list[GpuReading] | None, error: str | None) -> None:
            self._pending = None
            self._read_at = self._clock()
            self._error = error
            self._readings = tuple(readings or ())
            if not pending.done():
                pending.set_result(None)

        def work() -> None:
            try:
                readings, error = self._read(), None
            except Exception as exc:  # a page must never fail because the GPU side did
                readings, error = None, str(exc) or type(exc).__name__
            with contextlib.suppress(RuntimeError):  # the loop closed while NVML hung
                loop.call_soon_threadsafe(settle, readings, error)

        # a daemon thread, not an executor's: a read hung in the driver must not hold up exit
        threading.Thread(target=work, name="mtpwrap-nvml", daemon=True).start()

    def close(self) -> None:
        """Shut NVML down (in a thread of its own: that call can hang too), unless a read is
        still waiting on it."""
        if self._session is not None and self._pending is None:
            threading.Thread(target=self._session.close, name="mtpwrap-nvml-close",
                             daemon=True).start()
