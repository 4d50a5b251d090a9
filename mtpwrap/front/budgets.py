"""Per-key budgets: requests per minute, tokens per hour and per day (`rpm=`,
`tokens_per_hour=`, `tokens_per_day=` on the key's line).

Windows are the UTC calendar's: a minute, an hour, a day; a budget resets at its window's end,
which is what the 429 says (`Retry-After` and the time). A request is checked at the door (a
request past `rpm`, or any once the tokens are spent or spoken for), and once its body is read
it reserves what it may cost (`front.usage.reservation`), refused if the requests already in
flight have spoken for the rest: so parallel requests cannot all pass before any is charged.
When it ends, its reservation is let go and what llama-server computed for it is charged
(`front.usage`: its counts, at a cut what was computed, else the reservation itself). The
hour's and the day's counts are kept in
`<audit.dir>/budgets.json` (written at most every 2 s while they change, and at the end), so a
restart does not give a key its day again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.config.apikeys import ApiKey
from mtpwrap.supervision.writer import LatestWriter

log = logging.getLogger("mtpwrap.budgets")

#: window name -> (seconds, the budget field it counts against, what it counts)
WINDOWS = {"minute": (60, "rpm", "requests"), "hour": (3600, "tokens_per_hour", "tokens"),
           "day": (86400, "tokens_per_day", "tokens")}
SAVE_EVERY_S = 2.0


@dataclass(frozen=True)
class OverBudget:
    budget: str      # the field: rpm, tokens_per_hour, tokens_per_day
    limit: int
    resets_at: float  # epoch seconds
    retry_after_s: int

    #: tokens held by the key's requests in flight when it was refused
    held: int = 0

    def message(self, key: str) -> str:
        when = time.strftime("%H:%M:%S UTC", time.gmtime(self.resets_at))
        what = ("requests per minute" if self.budget == "rpm"
                else f"tokens per {self.budget.rsplit('_', 1)[1]}")
        used = "used" if not self.held else \
            f"used or reserved (for its requests in flight, {self.held} tokens)"
        return (f"The API key {key!r} has {used} its budget of {self.limit} {what}; it resets "
                f"at {when} (in {self.retry_after_s} s).")


@dataclass
class Hold:
    """Tokens a request in flight has reserved against its key's token budgets."""

    key: str
    tokens: int


class Budgets:
    """Counts per key name and window; `check` at the door, `reserve` once the body is read,
    `settle` when the request ends."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path, self.clock = path, clock
        #: (key name, window) -> [window start, count]
        self.counts: dict[tuple[str, str], list[float]] = {}
        #: key name -> tokens reserved by its requests in flight
        self.held: dict[str, int] = {}
        self._save: asyncio.TimerHandle | None = None
        #: the file written by a thread of its own: the serving loop never waits for the disk
        self._writer: LatestWriter[list[dict[str, Any]]] | None = None
        self._load()

    def _count(self, name: str, window: str, now: float) -> list[float]:
        span = WINDOWS[window][0]
        start = now - now % span
        c = self.counts.get((name, window))
        if c is None or c[0] != start:
            c = self.counts[(name, window)] = [start, 0.0]
        return c

    def used(self, name: str, window: str) -> int:
        return int(self._count(name, window, self.clock())[1])

    def check(self, key: ApiKey) -> OverBudget | None:
        """Whether `key` may send one more request now; counts it against its rpm if so."""
        limits = key.budget.limits()
        if not limits:
            return None
        now = self.clock()
        if (over := self._over(key, limits, now, ("minute", "hour", "day"))) is not None:
            return over
        if "rpm" in limits:
            self._count(key.name, "minute", now)[1] += 1
        return None

    def reserve(self, key: ApiKey, tokens: int) -> Hold | OverBudget | None:
        """Reserve `tokens` for a request of `key`'s about to be sent: refused while what is
        spent and what its requests in flight hold reach a token budget; None for a key with
        no token budget."""
        limits = key.budget.limits()
        if not (limits.get("tokens_per_hour") or limits.get("tokens_per_day")):
            return None
        if (over := self._over(key, limits, self.clock(), ("hour", "day"))) is not None:
            return over
        self.held[key.name] = self.held.get(key.name, 0) + tokens
        return Hold(key.name, tokens)

    def _over(self, key: ApiKey, limits: dict[str, int], now: float,
              windows: tuple[str, ...]) -> OverBudget | None:
        held = self.held.get(key.name, 0)
        for window in windows:
            span, field, what = WINDOWS[window]
            limit = limits.get(field)
            c = self._count(key.name, window, now)
            reserved = held if what == "tokens" else 0
            if limit and c[1] + reserved >= limit:
                resets = c[0] + span
                return OverBudget(field, limit, resets, max(1, int(resets - now + 0.999)),
                                  reserved)
        return None

    def settle(self, key: ApiKey, hold: Hold | None, tokens: int) -> None:
        """A request has ended: its reservation goes, its tokens count (for a key with a token
        budget)."""
        if hold is not None:
            left = self.held.get(hold.key, 0) - hold.tokens
            if left > 0:
                self.held[hold.key] = left
            else:
                self.held.pop(hold.key, None)
        b = key.budget
        if not tokens or not (b.tokens_per_hour or b.tokens_per_day):
            return
        now = self.clock()
        for window in ("hour", "day"):
            self._count(key.name, window, now)[1] += tokens
        self._schedule_save()

    # ------------------------------------------------------------------ persistence

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            for row in data["counts"]:
                self.counts[(row["key"], row["window"])] = [float(row["start"]),
                                                             float(row["count"])]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("budgets: %s is unreadable (%s); counting from zero", self.path, err)

    def _schedule_save(self) -> None:
        if self.path is None or self._save is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save()
            return
        self._save = loop.call_later(SAVE_EVERY_S, self.save)

    def save(self) -> None:
        """The counts to the file: handed to the writer thread inside the event loop, written
        at once outside it."""
        self._save = None
        if self.path is None:
            return
        rows = self._rows()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._write(rows)
            return
        if self._writer is None:
            self._writer = LatestWriter(self._write, name="mtpwrap-budgets")
        self._writer.submit(rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        assert self.path is not None
        try:
            paths.replace_text(self.path, json.dumps({"counts": rows}), 0o600)
        except OSError as err:
            log.warning("budgets: cannot write %s (%s)", self.path, err)

    def close(self) -> None:
        """The last counts written before it returns (blocks: at shutdown)."""
        if self._save is not None:
            self._save.cancel()
            self._save = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.path is not None:
            with contextlib.suppress(Exception):
                self._write(self._rows())

    def _rows(self) -> list[dict[str, Any]]:
        return [{"key": k, "window": w, "start": c[0], "count": c[1]}
                for (k, w), c in self.counts.items() if w != "minute"]
