"""The supervisor's vocabulary: its states and the transitions allowed between them, why a
child's run ended, the phases of a reload, and what the front is told (`SupervisorStatus`)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Protocol


class State(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


#: Once shutting down, only these: nothing brings readiness back.
SHUTDOWN_STATES = frozenset({State.DRAINING, State.STOPPING, State.STOPPED})

#: Which state may follow which. Staying in a state with a new reason is always allowed.
TRANSITIONS: dict[State, frozenset[State]] = {
    # a planned restart (reload, recycle) goes READY -> STARTING; a crash -> BACKOFF
    State.STARTING: frozenset({State.READY, State.BACKOFF, State.FAILED}) | SHUTDOWN_STATES,
    State.READY: frozenset({State.STARTING, State.BACKOFF, State.FAILED}) | SHUTDOWN_STATES,
    State.BACKOFF: frozenset({State.STARTING, State.FAILED}) | SHUTDOWN_STATES,
    # FAILED stays until a stop (or systemd restarts the whole service)
    State.FAILED: SHUTDOWN_STATES,
    State.DRAINING: frozenset({State.STOPPING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


def is_valid_transition(old: State, new: State) -> bool:
    return new is old or new in TRANSITIONS[old]


class IllegalTransition(RuntimeError):
    """A state change `TRANSITIONS` does not allow: a bug in the supervisor, never news from the
    world (as h11's LocalProtocolError is a bug of the caller, not of the peer)."""


#: An illegal transition raises `IllegalTransition` instead of being reported and refused. The
#: test suite sets it (tests/conftest.py), so a bug that reaches one fails the test that shows
#: it; a service keeps running in the state it had, and says so.
STRICT = False


def refuse_transition(old: State, new: State, reason: str | None,
                      log: logging.Logger) -> None:
    """Report an illegal transition (the caller stays in `old` and counts it for /metrics):
    an error line, or `IllegalTransition` under `STRICT`. Later news of a supervisor that is
    shutting down is no such thing: the caller keeps it as the reason, silently."""
    message = (f"illegal state change {old.value} -> {new.value} ({reason}) refused; a bug: "
               f"staying {old.value}")
    log.error("%s", message)
    if STRICT:
        raise IllegalTransition(message)


class Outcome(str, enum.Enum):
    """Why one child's run ended."""

    EXIT = "exit"  # it exited (or could not be started)
    OOM = "oom"  # out of memory while loading
    STALL = "stall"  # no loading progress
    PROBE = "probe"  # /health 200 but the readiness generation never answered
    WEDGE = "wedge"  # no token progress while requests were processing
    HEALTH = "health"  # /health failed while ready
    STOP = "stop"  # mtpwrap is stopping
    # planned restarts: no failure counted, no backoff
    RECYCLE = "recycle"  # memory above the limit
    RELOAD = "reload"  # a new command
    RESTART = "restart"  # the same command again

    @property
    def planned(self) -> bool:
        return self in (Outcome.RECYCLE, Outcome.RELOAD, Outcome.RESTART)


@dataclass(frozen=True)
class Ended:
    """How a child's run ended, and the sentence for the operator."""

    kind: Outcome
    detail: str


class ReloadPhase(str, enum.Enum):
    PENDING = "pending"  # asked for; the watch loop has not picked it up yet
    DRAINING = "draining"  # in-flight requests finish, the slots are saved
    STARTING = "starting"  # the new child is loading


@dataclass(frozen=True)
class Upstream:
    """Where the front reaches the child now: `base_url` (over a socket only its host part,
    a Host header), the UNIX socket path or None for loopback TCP, the internal key."""

    base_url: str
    api_key: str
    generation: int
    socket: str | None = None


@dataclass(frozen=True)
class SupervisorStatus:
    state: State
    reason: str | None
    restarts: int
    started_at: float | None
    child_started_at: float | None
    ready_since: float | None
    last_exit: str | None
    pid: int | None
    upstream: Upstream | None
    #: the step-down rung running now (0: the configured launch) and what it changed
    step: int = 0
    step_note: str | None = None
    #: state changes refused as illegal since the start (each one a bug)
    illegal_transitions: int = 0
    #: the child's start time (`pids.Identity.start`): its pid names it only with this
    pid_start: int | None = None
    #: the command the current child runs (`ChildCommand.shown`: secrets left out)
    command: dict[str, Any] | None = None

    @property
    def ready_upstream(self) -> Upstream | None:
        """The child's address when it is READY; None otherwise."""
        return self.upstream if self.state is State.READY else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; the internal API key is left out on purpose (this goes to files)."""
        return {
            "state": self.state.value,
            "reason": self.reason,
            "restarts": self.restarts,
            "started_at": self.started_at,
            "child_started_at": self.child_started_at,
            "ready_since": self.ready_since,
            "last_exit": self.last_exit,
            "pid": self.pid, "pid_start": self.pid_start,
            "upstream": None if self.upstream is None else {
                "base_url": self.upstream.base_url, "socket": self.upstream.socket,
                "generation": self.upstream.generation},
            "step_down": self.step, "step_down_note": self.step_note,
            "command": self.command,
        }


class SupervisorPort(Protocol):
    """What the front, its ops endpoints and its metrics need of a supervisor: the Supervisor,
    and every test double of it."""

    def status(self) -> SupervisorStatus: ...

    async def wait_ready(self, timeout: float) -> Upstream | None: ...

    def report_stall(self, generation: int, reason: str) -> None: ...
