"""The wedge watch: a READY llama-server that stops producing tokens while requests wait.

Two signs: llama-server's own counters (`n_decode_total` does not move for `wedge_s` while
`requests_processing` > 0, or /metrics hangs), and a stalled stream the front reports, which
counts only when the whole child has stopped decoding (`confirm`).
"""

from __future__ import annotations

import asyncio
import time

from mtpwrap.run.child import ChildProcess


class WedgeWatch:
    """One per READY child; `check` once per monitor interval."""

    def __init__(self, wedge_s: float) -> None:
        self.wedge_s = wedge_s  # 0: the counters are not watched
        self._last_decode: float | None = None
        self._no_progress_since: float | None = None

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
        if busy and (decode is None or decode == self._last_decode):
            self._no_progress_since = self._no_progress_since or now
            quiet = now - self._no_progress_since
            if quiet >= self.wedge_s:
                why = f"no token progress for {quiet:.0f}s with {processing:g} requests processing"
        else:
            self._no_progress_since = None
        if decode is not None:
            self._last_decode = decode
        return why

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
