"""The wedge watch: a READY llama-server that stops producing tokens while requests wait.

Two signs: llama-server's own counters (`n_decode_total` does not move for `wedge_s` while
`requests_processing` > 0, or /metrics hangs), and a stalled stream the front reports, which
counts only when the whole child has stopped decoding (`confirm`).

On a launch that computes on the CPU (no layer offloaded), CPU time the child spends counts as
progress as well: there one long prompt batch is a single decode call that can take longer than
`wedge_s` on a slow or busy machine, and llama-server answers /metrics only between decode calls.
A GPU launch keeps the counters alone, since a hung GPU can keep a CPU thread spinning.
"""

from __future__ import annotations

import asyncio
import time

from mtpwrap.supervision.child import ChildProcess


class WedgeWatch:
    """One per READY child; `check` once per monitor interval."""

    #: the share of one core the child must use between checks to count as computing (a deadlocked
    #: llama-server uses none; a computing one, even on a crowded machine, far more)
    BUSY_CORE_SHARE = 0.2

    def __init__(self, wedge_s: float, cpu_compute: bool = False) -> None:
        self.wedge_s = wedge_s  # 0: the counters are not watched
        self.cpu_compute = cpu_compute
        self._last_decode: float | None = None
        self._no_progress_since: float | None = None
        self._last_cpu: tuple[float, float] | None = None  # (monotonic, CPU seconds)

    async def check(self, child: ChildProcess) -> str | None:
        """Why the child is wedged, or None."""
        if self.wedge_s <= 0:
            return None
        m = await child.metrics()
        processing = (m or {}).get("requests_processing", 0.0)
        decode = (m or {}).get("n_decode_total")
        now = time.monotonic()
        busy = m is None or processing > 0  # a /metrics that hangs is a wedge sign
        if m is None and self._last_decode is None:
            busy = False  # metrics are off: only the front's reports can tell
        why = None
        computing = self._computing(child, now)
        if busy and (decode is None or decode == self._last_decode) and not computing:
            self._no_progress_since = self._no_progress_since or now
            quiet = now - self._no_progress_since
            if quiet >= self.wedge_s:
                why = f"no token progress for {quiet:.0f}s with {processing:g} requests processing"
        else:
            self._no_progress_since = None
        if decode is not None:
            self._last_decode = decode
        return why

    def _computing(self, child: ChildProcess, now: float) -> bool:
        """On a CPU launch: did the child use a fifth of a core or more since the last check?"""
        if not self.cpu_compute:
            return False
        used = child.cpu_seconds()
        last, self._last_cpu = self._last_cpu, (now, used)
        if last is None or now <= last[0]:
            return False
        return (used - last[1]) >= self.BUSY_CORE_SHARE * (now - last[0])

    @staticmethod
    async def confirm(child: ChildProcess, interval_s: float) -> bool:
        """A stalled stream means a wedged child only if the whole child stopped decoding."""
        first = await child.metrics()
        if first is None:
            return True  # no metrics (or they hang): trust the front
        await asyncio.sleep(min(2.0, max(0.2, interval_s)))
        second = await child.metrics()
        if second is None:
            return True
        return (second.get("requests_processing", 0) > 0
                and second.get("n_decode_total") == first.get("n_decode_total"))
