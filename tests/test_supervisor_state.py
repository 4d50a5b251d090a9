"""The supervisor's transition table: what may follow what, and what an illegal change does."""

from __future__ import annotations

import logging

import pytest

from mtpwrap.config.objects import SupervisorConfig
from mtpwrap.supervision.state import (
    SHUTDOWN_STATES,
    TRANSITIONS,
    IllegalTransition,
    Outcome,
    State,
    is_valid_transition,
)
from mtpwrap.supervision.supervisor import Supervisor


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


def _supervisor() -> Supervisor:
    """A supervisor that has not started anything: its state changes are the ones to watch."""
    return Supervisor(lambda endpoint, key, step: None, SupervisorConfig())


def test_an_illegal_transition_raises_under_test() -> None:
    sup = _supervisor()
    sup._set_state(State.BACKOFF, "crashed")
    with pytest.raises(IllegalTransition, match="backoff -> ready"):
        sup._set_state(State.READY, "a bug")  # only STARTING becomes READY
    assert sup.state is State.BACKOFF


def test_an_illegal_transition_is_reported_in_production(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Outside the tests the supervisor stays where it was, logs an error and counts it on
    /metrics; a shutting-down supervisor's later news is the planned case: kept as the reason,
    no error, no count."""
    from mtpwrap.front.metrics import FrontMetrics
    from mtpwrap.supervision import state

    monkeypatch.setattr(state, "STRICT", False)
    sup = _supervisor()
    sup._set_state(State.BACKOFF, "crashed")
    with caplog.at_level(logging.INFO, logger="mtpwrap.supervisor"):
        sup._set_state(State.READY, "a bug")
    assert sup.state is State.BACKOFF and sup.status().reason == "crashed"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "illegal state change backoff -> ready" in errors[0].message
    text = FrontMetrics(sup.status, dict, list).render().decode()
    assert "mtpwrap_supervisor_illegal_transitions_total 1.0" in text
    caplog.clear()
    sup._set_state(State.DRAINING, "stopping")
    with caplog.at_level(logging.INFO, logger="mtpwrap.supervisor"):
        sup._set_state(State.READY, "llama-server answered")
    assert sup.state is State.DRAINING and sup.status().reason == "llama-server answered"
    assert not caplog.records and sup.status().illegal_transitions == 1
    monkeypatch.setattr(state, "STRICT", True)
    sup._set_state(State.STARTING, "news while draining")  # planned: silent even under test
    assert sup.status().reason == "news while draining"
