"""The relay's per-request states and steps (`mtpwrap.front.exchange`), without sockets or
sleeps: the table itself, and the paths the relay takes through it."""

from __future__ import annotations

import itertools

import pytest

from mtpwrap.front.exchange import (
    HEAD_SENT,
    STEPS,
    UPSTREAM_OWES,
    Exchange,
    IllegalStep,
    Step,
    allowed,
)


def ex() -> Exchange:
    return Exchange(label="chat", stream=True, t0=0.0)


def walk(*steps: Step) -> Exchange:
    e = ex()
    for s in steps:
        e.to(s)
    return e


def test_every_state_has_a_row_and_done_is_the_only_end() -> None:
    assert set(STEPS) == set(Step)
    ends = [s for s in Step if not STEPS[s] and s is not Step.DONE]
    assert ends == [Step.RELAYING]  # RELAYING's only way on is DONE, allowed from anywhere
    assert all(allowed(s, Step.DONE) for s in Step)
    assert not any(allowed(Step.DONE, s) for s in Step if s is not Step.DONE)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(Step, Step)))
def test_to_takes_exactly_the_steps_the_table_allows(old: Step, new: Step) -> None:
    e = ex()
    e.state = old
    if new is old or new is Step.DONE or new in STEPS[old]:
        e.to(new)
        assert e.state is new
    else:
        with pytest.raises(IllegalStep, match=f"{old.value} -> {new.value}"):
            e.to(new)
        assert e.state is old  # a refused step changes nothing


@pytest.mark.parametrize("path", [
    # a plain answer relayed as it came
    (Step.WAITING, Step.RELAYING, Step.DONE),
    # a long prefill: keep-alive comments, then llama-server's stream
    (Step.WAITING, Step.KEPT_ALIVE, Step.RELAYING, Step.DONE),
    # llama-server's 500 answered whole (or the connection failed before its head)
    (Step.WAITING, Step.DONE),
    # an error after keep-alive: an error event
    (Step.WAITING, Step.KEPT_ALIVE, Step.DONE),
    # refused while queued (or the client went away)
    (Step.DONE,),
], ids=["relayed", "kept-alive", "answered-whole", "error-event", "refused"])
def test_the_relays_paths_are_legal(path: tuple[Step, ...]) -> None:
    assert walk(*path).state is Step.DONE


def test_no_going_back() -> None:
    e = walk(Step.WAITING, Step.RELAYING)
    for back in (Step.QUEUED, Step.WAITING, Step.KEPT_ALIVE):
        with pytest.raises(IllegalStep):
            e.to(back)
    # a keep-alive cannot be started under a body already relayed, nor skip the request
    with pytest.raises(IllegalStep):
        ex().to(Step.RELAYING)
    with pytest.raises(IllegalStep):
        ex().to(Step.KEPT_ALIVE)


def test_what_the_watch_and_the_error_paths_read_from_the_state() -> None:
    assert {s for s in Step if walk_to(s).head_sent} == HEAD_SENT
    assert not walk_to(Step.WAITING).head_sent  # an error now can still be a status
    assert walk_to(Step.KEPT_ALIVE).head_sent  # now only an event
    assert {Step.WAITING, Step.KEPT_ALIVE, Step.RELAYING} == UPSTREAM_OWES


def walk_to(target: Step) -> Exchange:
    route = {Step.QUEUED: (), Step.WAITING: (Step.WAITING,),
             Step.KEPT_ALIVE: (Step.WAITING, Step.KEPT_ALIVE),
             Step.RELAYING: (Step.WAITING, Step.RELAYING),
             Step.DONE: (Step.WAITING, Step.RELAYING, Step.DONE)}[target]
    return walk(*route)


def test_event_boundaries_and_sends() -> None:
    e = ex()
    assert e.at_boundary and not e.in_send
    e.last_chunk = b'data: {"a"'
    assert not e.at_boundary
    e.last_chunk = b'data: {"a": 1}\r\n\r\n'
    assert e.at_boundary
    e.sending_since = 12.5
    assert e.in_send


@pytest.mark.parametrize("message, klass, client", [
    ("Failed to parse messages: Missing tool call type: {}", "request_shape", True),
    # the request's own JSON quoted back: its keys are not llama-server's words (make fuzz)
    ('Failed to parse messages: Missing tool call type: {"chat_template_kwargs":null}',
     "request_shape", True),
    ("[json.exception.type_error.302] type must be string, but is number", "json_type", True),
    ("Unknown model architecture: {}", "other", False),
    ("Error rendering the chat template: {}", "template", False),
])
def test_a_500_is_classed_by_llama_servers_own_words(message: str, klass: str,
                                                     client: bool) -> None:
    from mtpwrap.front.relay import upstream_500_class

    assert upstream_500_class(message) == (klass, client)


@pytest.mark.parametrize("event_stream, last, sending, ended", [
    (True, b'data: {"choices":[]}\n\ndata: [DONE]\n\n', 0.0, True),
    (True, b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", 0.0, True),
    (True, b"data: [DONE]\n\n", 12.5, False),  # still being written: the client has not had it
    (True, b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', 0.0, False),
    (False, b'{"content": "data: [DONE]"}', 0.0, False),  # a plain body is never a stream's end
])
def test_a_stream_has_ended_once_its_last_event_was_sent_whole(
        event_stream: bool, last: bytes, sending: float, ended: bool) -> None:
    e = ex()
    e.event_stream, e.last_chunk, e.sending_since = event_stream, last, sending
    assert e.stream_ended is ended
