"""The supervisor's transition table: what may follow what."""

from __future__ import annotations

from mtpwrap.supervision.state import (
    SHUTDOWN_STATES,
    TRANSITIONS,
    Outcome,
    State,
    is_valid_transition,
)


def test_every_state_has_a_row_and_every_running_state_can_shut_down() -> None:
    assert set(TRANSITIONS) == set(State)
    for old in State:
        if old is not State.STOPPED:
            assert is_valid_transition(old, State.STOPPED), old
        if old not in SHUTDOWN_STATES:
            assert TRANSITIONS[old] >= SHUTDOWN_STATES, old


def test_nothing_brings_readiness_back_once_shutting_down() -> None:
    for old in SHUTDOWN_STATES:
        for new in State:
            if new not in SHUTDOWN_STATES:
                assert not is_valid_transition(old, new), (old, new)
    assert not is_valid_transition(State.STOPPING, State.DRAINING)
    assert [n for n in State if is_valid_transition(State.STOPPED, n)] == [State.STOPPED]


def test_failed_waits_for_a_stop_and_only_starting_becomes_ready() -> None:
    assert TRANSITIONS[State.FAILED] == SHUTDOWN_STATES
    assert [o for o in State if State.READY in TRANSITIONS[o]] == [State.STARTING]
    assert is_valid_transition(State.BACKOFF, State.BACKOFF)  # a new reason, same state


def test_planned_outcomes() -> None:
    assert {o for o in Outcome if o.planned} == {Outcome.RECYCLE, Outcome.RELOAD,
                                                 Outcome.RESTART}
