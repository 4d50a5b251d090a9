"""When a failed llama-server is started again: the crash window, the capped exponential
backoff, FAILED after too many failures, and stepping down to a cheaper launch after repeated
out-of-memory starts."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from mtpwrap.config.objects import SupervisorConfig
from mtpwrap.supervision.child import ChildCommand
from mtpwrap.supervision.state import Ended, Outcome

log = logging.getLogger("mtpwrap.supervisor")


class RestartPolicy:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        #: the step-down rung the next start uses (0: the configured launch) and what it changed
        self.step = 0
        self.step_note: str | None = None
        self._failures: collections.deque[tuple[float, Outcome]] = collections.deque()
        self._consecutive_oom = 0

    def loaded(self) -> None:
        """The model answered: out-of-memory starts are no longer consecutive."""
        self._consecutive_oom = 0

    def record(self, outcome: Ended, probe: Callable[[int], ChildCommand | None]
               ) -> float | str:
        """Remember a failure: the backoff delay in seconds, or why the service is FAILED.
        `probe(step)` is the launch of a step-down rung (None: there is none)."""
        cfg = self.config
        now = time.monotonic()
        self._failures.append((now, outcome.kind))
        while self._failures and now - self._failures[0][0] > cfg.failure_window_s:
            self._failures.popleft()
        ooms = sum(1 for _, k in self._failures if k is Outcome.OOM)
        crashes = len(self._failures) - ooms
        if outcome.kind is Outcome.OOM:
            # GPU memory is often still held for a moment after a crash (the driver frees it
            # asynchronously), so an out-of-memory start is retried, not fatal.
            self._consecutive_oom += 1
            if ooms >= cfg.oom_max_retries:
                return (f"out of GPU memory at load {ooms} times in "
                        f"{cfg.failure_window_s:g}s; last: {outcome.detail}")
            if cfg.oom_step_down and self._consecutive_oom >= cfg.oom_step_after:
                self._consecutive_oom = 0
                self._step_down(probe)
        else:
            self._consecutive_oom = 0
            if crashes >= cfg.max_failures:
                return (f"llama-server failed {crashes} times in "
                        f"{cfg.failure_window_s:g}s; last: {outcome.detail}")
        n = len(self._failures)
        return min(cfg.backoff_max_s, cfg.backoff_initial_s * (2 ** (n - 1)))

    def _step_down(self, probe: Callable[[int], ChildCommand | None]) -> None:
        cheaper = probe(self.step + 1)
        if cheaper is None:
            log.warning("out of memory again, and there is no cheaper configuration left")
            return
        self.step += 1
        self.step_note = cheaper.note or "cheaper configuration"
        log.warning("out of memory at load; stepping down (step %d): %s", self.step,
                    self.step_note)

    def reset_step_down(self, why: str) -> None:
        """Back to the configured launch: a clean run means the memory pressure has gone (or
        the operator changed something), so the next start tries the real thing again."""
        if self.step:
            log.info("step-down reset after %s: the next start uses the configured launch", why)
        self.step, self.step_note = 0, None
