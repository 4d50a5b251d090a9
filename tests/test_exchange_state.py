"""How a forwarded request goes and ends (`mtpwrap.front.exchange`), driven from the outside:
events in, actions out, without sockets or sleeps. The expectations are written from what a
client must see, not read back from the table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpwrap.front.exchange import EVENT_STATUS, Action, Event, Exchange, IllegalStep, Step

E, A = Event, Action

#: the actions that end a request: each one is its one record
ENDING = {A.REPLY, A.ANSWER, A.ERROR_EVENT, A.CUT, A.FINISH, A.TAKEN}
#: the actions that give the client a response's head
HEADS = {A.SEND_HEAD, A.OPEN_STREAM, A.REPLY, A.ANSWER}


def run(*events: Event) -> tuple[Exchange, list[Action]]:
    ex = Exchange(label="chat", stream=True, t0=0.0)
    return ex, [ex.on(e) for e in events]


@pytest.mark.parametrize(("events", "actions"), [
    # a stream relayed as it came
    ((E.SENT, E.HEAD_STREAM, E.QUIET, E.BODY_END),
     [A.NONE, A.SEND_HEAD, A.COMMENT, A.FINISH]),
    # a long prefill: the front's event-stream head and comments, then llama-server's stream
    ((E.SENT, E.QUIET, E.QUIET, E.HEAD_STREAM, E.BODY_END),
     [A.NONE, A.OPEN_STREAM, A.COMMENT, A.RELAY, A.FINISH]),
    # llama-server's 500 before any head: answered whole
    ((E.SENT, E.HEAD_500), [A.NONE, A.ANSWER]),
    # ... and after the front's head: an error event, whatever the answer's shape
    ((E.SENT, E.QUIET, E.HEAD_500), [A.NONE, A.OPEN_STREAM, A.ERROR_EVENT]),
    ((E.SENT, E.QUIET, E.HEAD_BODY), [A.NONE, A.OPEN_STREAM, A.ERROR_EVENT]),
    # a JSON answer relayed, and cut when the link breaks under it
    ((E.SENT, E.HEAD_BODY, E.QUIET, E.UPSTREAM_FAILED), [A.NONE, A.SEND_HEAD, A.NONE, A.CUT]),
    # a stream whose link breaks, or that stalls, or that the drain stops: an error event
    ((E.SENT, E.HEAD_STREAM, E.UPSTREAM_FAILED), [A.NONE, A.SEND_HEAD, A.ERROR_EVENT]),
    ((E.SENT, E.HEAD_STREAM, E.STALL), [A.NONE, A.SEND_HEAD, A.ERROR_EVENT]),
    ((E.SENT, E.HEAD_STREAM, E.SHUTDOWN), [A.NONE, A.SEND_HEAD, A.ERROR_EVENT]),
    # nothing sent to the client yet: the front answers itself
    ((E.SENT, E.UPSTREAM_FAILED), [A.NONE, A.REPLY]),
    ((E.SENT, E.STALL), [A.NONE, A.REPLY]),
    ((E.SHUTDOWN,), [A.REPLY]),
    ((E.REFUSED,), [A.REPLY]),
    # the client goes: nothing more is written, wherever it was
    ((E.CLIENT_GONE,), [A.CUT]),
    ((E.SENT, E.QUIET, E.CLIENT_GONE), [A.NONE, A.OPEN_STREAM, A.CUT]),
    ((E.SENT, E.HEAD_STREAM, E.SLOW_READER), [A.NONE, A.SEND_HEAD, A.CUT]),
    # ... after the stream's last event: an answer given, not one cut short
    ((E.SENT, E.HEAD_STREAM, E.STREAM_TAKEN), [A.NONE, A.SEND_HEAD, A.TAKEN]),
    # uvicorn's disconnect once the response is complete changes nothing
    ((E.SENT, E.HEAD_STREAM, E.BODY_END, E.CLIENT_GONE),
     [A.NONE, A.SEND_HEAD, A.FINISH, A.NONE]),
], ids=["streamed", "kept-alive", "500-whole", "500-as-event", "answer-as-event", "json-cut",
        "stream-broken", "stream-stalled", "stream-shut", "link-failed", "prefill-stalled",
        "shut-while-queued", "refused", "gone-while-queued", "gone-while-kept", "slow-reader",
        "stream-taken", "disconnect-after-end"])
def test_the_relays_paths(events: tuple[Event, ...], actions: list[Action]) -> None:
    ex, got = run(*events)
    assert got == actions
    assert ex.state is Step.DONE


@pytest.mark.parametrize(("events", "illegal"), [
    ((), E.BODY_END),                              # no body before a head
    ((), E.HEAD_STREAM),                           # no head before the request went
    ((E.SENT, E.HEAD_STREAM), E.HEAD_BODY),        # one head per answer
    ((E.SENT, E.HEAD_BODY), E.STREAM_TAKEN),       # only an event stream has a last event
    ((E.SENT, E.HEAD_STREAM, E.BODY_END), E.STALL),        # nothing ends twice
    ((E.SENT, E.HEAD_STREAM, E.BODY_END), E.UPSTREAM_FAILED),
    ((E.SENT, E.UPSTREAM_FAILED), E.SHUTDOWN),
    ((E.SENT,), E.REFUSED),                        # refused only while queued
    ((E.SENT,), E.SENT),
])
def test_an_illegal_event_raises_and_changes_nothing(events: tuple[Event, ...],
                                                     illegal: Event) -> None:
    ex, _ = run(*events)
    before = ex.state
    with pytest.raises(IllegalStep, match=f"{illegal.value} in {before.value}"):
        ex.on(illegal)
    assert ex.state is before


def test_an_ending_found_outside_the_worker_is_kept_once() -> None:
    ex, _ = run(E.SENT, E.HEAD_STREAM)
    assert ex.end(E.STALL) and ex.ending is not None
    assert (ex.ending.event, ex.ending.action) == (E.STALL, A.ERROR_EVENT)
    # the disconnect that follows the stop is no second ending
    assert not ex.end(E.CLIENT_GONE)
    assert ex.ending.event is E.STALL
    with pytest.raises(IllegalStep):
        ex.end(E.SHUTDOWN)


def test_the_statuses_of_the_endings_found_outside_the_worker() -> None:
    assert EVENT_STATUS == {E.UPSTREAM_FAILED: 502, E.SHUTDOWN: 503, E.STALL: 504,
                            E.CLIENT_GONE: 499, E.SLOW_READER: 499}


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(list(Event)), max_size=12))
def test_whatever_happens_a_request_ends_once_and_writes_in_order(events: list[Event]) -> None:
    """Any sequence of events: the legal prefix ends in at most one ending action; once ended,
    nothing is written; an error event or a comment goes only into an event stream the client
    has the head of; a whole answer of the front's (a reply, llama-server's 500) only where
    the client has no head yet."""
    ex = Exchange(label="chat", stream=True, t0=0.0)
    steps: list[tuple[Event, Action]] = []
    for e in events:
        try:
            steps.append((e, ex.on(e)))
        except IllegalStep:
            continue
    actions = [a for _, a in steps]
    endings = [a for a in actions if a in ENDING]
    assert len(endings) <= 1
    assert (ex.state is Step.DONE) == (len(endings) == 1)
    if endings:
        assert all(a is A.NONE for a in actions[actions.index(endings[0]) + 1:])
    heads = 0
    event_stream = False
    for e, a in steps:
        if a in (A.ERROR_EVENT, A.COMMENT, A.TAKEN, A.RELAY):
            assert event_stream, actions
        if a in (A.REPLY, A.ANSWER):
            assert heads == 0, actions
        if a is A.OPEN_STREAM:
            event_stream = True
        if a is A.SEND_HEAD:
            event_stream = e is E.HEAD_STREAM
        heads += a in HEADS
    assert heads <= 1, actions


def test_event_boundaries_and_sends() -> None:
    e = Exchange(label="chat", stream=True, t0=0.0)
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


@pytest.mark.parametrize("head, last, sending, ended", [
    (E.HEAD_STREAM, b'data: {"choices":[]}\n\ndata: [DONE]\n\n', 0.0, True),
    (E.HEAD_STREAM, b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", 0.0, True),
    # still being written: the client has not had it
    (E.HEAD_STREAM, b"data: [DONE]\n\n", 12.5, False),
    (E.HEAD_STREAM, b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', 0.0, False),
    # a plain body is never a stream's end
    (E.HEAD_BODY, b'{"content": "data: [DONE]"}', 0.0, False),
])
def test_a_stream_has_ended_once_its_last_event_was_sent_whole(
        head: Event, last: bytes, sending: float, ended: bool) -> None:
    e, _ = run(E.SENT, head)
    e.last_chunk, e.sending_since = last, sending
    assert e.stream_ended is ended
