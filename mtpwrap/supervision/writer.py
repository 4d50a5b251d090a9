"""Writes that must not block the event loop, done by a thread of their own: `LatestWriter`
keeps only the newest value not yet written (a state file, where only the last state counts);
`InOrderWriter` writes every value in order from a bounded queue (an audit trail). Neither's
`submit` waits for the disk."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("mtpwrap.writer")

T = TypeVar("T")


class _Writer(Generic[T]):
    """`write(value)` in a daemon thread for each value the queue holds, in order."""

    def __init__(self, write: Callable[[T], None], *, name: str) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._queue: collections.deque[T] = collections.deque()
        self._writing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what was submitted is written; blocks (call it off the loop): True when
        it was within `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def _stop(self, timeout: float) -> None:
        """Write what is queued, then stop, waiting up to `timeout` for the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                value = self._queue.popleft()
                self._writing = True
            try:
                self._write(value)
            except Exception:  # a failed write must not end the writer
                log.exception("%s: write failed", self._thread.name)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()


class LatestWriter(_Writer[T]):
    """`write(value)` in a daemon thread, for the newest value submitted; values submitted while
    a write runs replace each other, so a burst of state changes costs at most two writes."""

    def submit(self, value: T) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.clear()
            self._queue.append(value)
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> bool:
        """Write what is pending, then stop; blocks (call it off the loop): True when the
        thread finished within `timeout`."""
        self._stop(timeout)
        return not self._thread.is_alive()


class InOrderWriter(_Writer[T]):
    """`write(value)` in a daemon thread for every value submitted, in the order submitted (an
    audit trail, where each line counts). The queue holds `limit` values: `submit` never waits
    for the disk, and says False when the queue is full, the value not taken; what to do with
    it then is the caller's to decide (nothing is dropped without the caller knowing)."""

    def __init__(self, write: Callable[[T], None], *, name: str, limit: int) -> None:
        self.limit = limit
        super().__init__(write, name=name)

    @property
    def pending(self) -> int:
        """Values submitted and not yet written (the one being written included)."""
        with self._cond:
            return len(self._queue) + (1 if self._writing else 0)

    def submit(self, value: T) -> bool:
        with self._cond:
            if self._closed or len(self._queue) >= self.limit:
                return False
            self._queue.append(value)
            self._cond.notify_all()
            return True

    def close(self, timeout: float = 5.0) -> list[T]:
        """Write what is queued, then stop; blocks (a shutdown's last step): the values still
        unwritten when `timeout` ran out (none when the disk kept up), taken off the queue."""
        self._stop(timeout)
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
            return left
