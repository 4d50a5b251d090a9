"""How one forwarded request goes and ends, in one table (in the manner of h11's `_state.py`):
(state, event) -> (state, action). The relay's worker, its watch and the drain only say what
happened (an `Event`); the table says what state follows and what to write (an `Action`); a
pair the table does not hold raises `IllegalStep`.

    QUEUED ──sent──> WAITING ──head_stream──> STREAMING ─┐
                       │ └─quiet─> KEPT_ALIVE ──┘        ├──> DONE
                       └──head_body──> RELAYING ─────────┘

- QUEUED: admitted to the front, waiting for a permit; nothing sent anywhere.
- WAITING: the request went to llama-server; the client has nothing yet.
- KEPT_ALIVE: still no head from llama-server, but the front has sent the client event-stream
  headers and `: keep-alive` comments (a long prefill); an error can now only be an event.
- STREAMING: llama-server's event stream is being passed on; an error ends it as an event.
- RELAYING: any other answer of llama-server's is being passed on; an error cuts it (the
  client's HTTP layer sees a body without its end).
- DONE: the client has its whole answer or its end; nothing more is written. The one pair
  allowed here is a disconnect, which uvicorn reports once a response is complete.

Every ending is an event that leads to DONE, so a request ends once: the action that goes with
it is the one write (or none) and the one record of the request, with the status the client saw
(`EVENT_STATUS`). An ending the watch or the drain finds (a disconnect, a slow reader, a
stall, a shutdown) moves the exchange to DONE at once and is kept in `Exchange.ending`; the
worker is then cancelled (that closes the connection to llama-server, which it takes for a
cancel) and the request's handler carries the action out.

The progress figures beside the state (the time of the last chunk, the write in progress, the
last keep-alive) are what the watch reads to find stalls and slow readers.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtpwrap.front.audit import Ticket
    from mtpwrap.front.depth_policy import DepthDecision


class Step(str, enum.Enum):
    QUEUED = "queued"
    WAITING = "waiting"
    KEPT_ALIVE = "kept_alive"
    STREAMING = "streaming"
    RELAYING = "relaying"
    DONE = "done"


class Event(str, enum.Enum):
    """What happened. The values of the endings found outside the worker are the causes the
    metrics (`mtpwrap_cancelled`) and the audit trail name."""

    # the worker's
    REFUSED = "refused"                 # admission refused it (its own status and message)
    SENT = "sent"                       # the request went to llama-server
    HEAD_STREAM = "head_stream"         # llama-server's head: 200 and an event stream
    HEAD_BODY = "head_body"             # llama-server's head: any other answer but a plain 500
    HEAD_500 = "head_500"               # llama-server's plain 500 (classed by its message)
    BODY_END = "body_end"               # llama-server's body ended
    UPSTREAM_FAILED = "upstream_error"  # the link to llama-server broke or closed early
    # the watch's
    QUIET = "quiet"                     # no byte for `keepalive_s` on a streamed request
    CLIENT_GONE = "client_disconnect"   # the client went away
    STREAM_TAKEN = "stream_taken"       # ... after the last event of a whole stream
    SLOW_READER = "slow_reader"         # a write to the client took `write_timeout_s`
    STALL = "stall"                     # llama-server made no progress within its budget
    # the drain's
    SHUTDOWN = "shutdown"               # the drain budget ran out


class Action(str, enum.Enum):
    NONE = "none"                # nothing to write
    SEND_HEAD = "send_head"      # llama-server's head to the client, then its body
    RELAY = "relay"              # the body only (the front sent event-stream headers already)
    OPEN_STREAM = "open_stream"  # the front's event-stream head and a keep-alive comment
    COMMENT = "comment"          # a keep-alive comment
    ANSWER = "answer"            # llama-server's 500 whole (a 400 when the request caused it)
    REPLY = "reply"              # an error answer of the front's own
    ERROR_EVENT = "error_event"  # an error event that ends the event stream
    CUT = "cut"                  # leave the answer incomplete (the client sees it cut)
    FINISH = "finish"            # the body's end: the answer is complete
    TAKEN = "taken"              # nothing more: the client had the whole stream


_S, _E, _A = Step, Event, Action
_ENDINGS_UNANSWERED = {_E.UPSTREAM_FAILED: _A.REPLY, _E.STALL: _A.REPLY,
                       _E.SHUTDOWN: _A.REPLY, _E.CLIENT_GONE: _A.CUT}
_ENDINGS_IN_STREAM = {_E.UPSTREAM_FAILED: _A.ERROR_EVENT, _E.STALL: _A.ERROR_EVENT,
                      _E.SHUTDOWN: _A.ERROR_EVENT, _E.CLIENT_GONE: _A.CUT}

#: (state, event) -> (state, action): every step an exchange can take. Besides these, nothing.
TABLE: dict[tuple[Step, Event], tuple[Step, Action]] = {
    (_S.QUEUED, _E.SENT): (_S.WAITING, _A.NONE),
    (_S.QUEUED, _E.REFUSED): (_S.DONE, _A.REPLY),
    (_S.QUEUED, _E.SHUTDOWN): (_S.DONE, _A.REPLY),
    (_S.QUEUED, _E.CLIENT_GONE): (_S.DONE, _A.CUT),

    (_S.WAITING, _E.QUIET): (_S.KEPT_ALIVE, _A.OPEN_STREAM),
    (_S.WAITING, _E.HEAD_STREAM): (_S.STREAMING, _A.SEND_HEAD),
    (_S.WAITING, _E.HEAD_BODY): (_S.RELAYING, _A.SEND_HEAD),
    (_S.WAITING, _E.HEAD_500): (_S.DONE, _A.ANSWER),
    **{(_S.WAITING, e): (_S.DONE, a) for e, a in _ENDINGS_UNANSWERED.items()},

    (_S.KEPT_ALIVE, _E.QUIET): (_S.KEPT_ALIVE, _A.COMMENT),
    (_S.KEPT_ALIVE, _E.HEAD_STREAM): (_S.STREAMING, _A.RELAY),
    (_S.KEPT_ALIVE, _E.HEAD_BODY): (_S.DONE, _A.ERROR_EVENT),
    (_S.KEPT_ALIVE, _E.HEAD_500): (_S.DONE, _A.ERROR_EVENT),
    (_S.KEPT_ALIVE, _E.SLOW_READER): (_S.DONE, _A.CUT),
    **{(_S.KEPT_ALIVE, e): (_S.DONE, a) for e, a in _ENDINGS_IN_STREAM.items()},

    (_S.STREAMING, _E.QUIET): (_S.STREAMING, _A.COMMENT),
    (_S.STREAMING, _E.BODY_END): (_S.DONE, _A.FINISH),
    (_S.STREAMING, _E.STREAM_TAKEN): (_S.DONE, _A.TAKEN),
    (_S.STREAMING, _E.SLOW_READER): (_S.DONE, _A.CUT),
    **{(_S.STREAMING, e): (_S.DONE, a) for e, a in _ENDINGS_IN_STREAM.items()},

    (_S.RELAYING, _E.QUIET): (_S.RELAYING, _A.NONE),
    (_S.RELAYING, _E.BODY_END): (_S.DONE, _A.FINISH),
    (_S.RELAYING, _E.SLOW_READER): (_S.DONE, _A.CUT),
    **{(_S.RELAYING, e): (_S.DONE, _A.CUT) for e in _ENDINGS_UNANSWERED},

    (_S.DONE, _E.CLIENT_GONE): (_S.DONE, _A.NONE),
}

#: The status a request is recorded with when this event ends it (the ones not here take
#: theirs from llama-server's answer or the refusal).
EVENT_STATUS: dict[Event, int] = {
    _E.UPSTREAM_FAILED: 502, _E.SHUTDOWN: 503, _E.STALL: 504,
    _E.CLIENT_GONE: 499,   # nginx's "client closed request"
    _E.SLOW_READER: 499,
}

#: llama-server owes this exchange something: the watch looks for stalls.
UPSTREAM_OWES = frozenset({_S.WAITING, _S.KEPT_ALIVE, _S.STREAMING, _S.RELAYING})
#: The client's answer is an event stream: comments and error events can be written.
EVENT_STREAM = frozenset({_S.KEPT_ALIVE, _S.STREAMING})

#: what the connection layer (`mtpwrap.front.http_server`) marks in a request's scope: its
#: client shut down its sending side before the answer (True) ...
PEER_EOF = "mtpwrap.peer_eof"
#: ... or its body missed its deadline: (status, reason) for the guard to answer with
REFUSED = "mtpwrap.refused"

_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
#: the last event of a complete stream, OpenAI's and Anthropic's
STREAM_ENDS = (b"data: [DONE]", b"event: message_stop")


class IllegalStep(RuntimeError):
    """A pair the table does not hold: the relay is wrong, not the client or llama-server."""


@dataclass(frozen=True)
class Ending:
    """An ending found outside the worker, carried out once the worker has stopped."""

    event: Event
    action: Action


@dataclass(eq=False)  # identity: one exchange is one request (kept in a dict while open)
class Exchange:
    """One forwarded request, shared by its worker (which relays) and its watch."""

    label: str
    stream: bool                     # the client asked for a stream, on a route that streams
    t0: float
    slot: bool = True                # takes one of llama-server's slots (a forwarding permit)
    depth: DepthDecision | None = None  # the draft depth chosen for this request
    state: Step = Step.QUEUED
    #: an ending found by the watch or the drain, for the handler to carry out
    ending: Ending | None = None
    #: the last chunk sent to the client (a reference: whether it ends an SSE event is read
    #: from it only when the front writes bytes of its own)
    last_chunk: bytes = b"\n\n"
    #: loop time the relay's current client write began; 0.0 while none is in progress
    sending_since: float = 0.0
    first_chunk: bool = False
    last_progress: float = 0.0
    last_keepalive: float = 0.0
    #: llama-server's status, once its head came
    status: int = 0
    generation: int | None = None
    #: its audit ticket, whose tally the relay feeds the answer's chunks to (the depth policy
    #: reads the draft figures from its last ones)
    ticket: Ticket | None = None
    #: held while a head or the front's own bytes (a keep-alive comment) are written; the
    #: relay takes it only when it is held (see `Relay._body`)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def on(self, event: Event) -> Action:
        """The one way to change state: the table's step for `event`, or `IllegalStep`."""
        try:
            self.state, action = TABLE[self.state, event]
        except KeyError:
            raise IllegalStep(f"exchange {self.label}: {event.value} in {self.state.value}"
                              ) from None
        return action

    def end(self, event: Event) -> bool:
        """An ending found outside the worker: step, and keep the action for the handler.
        False (nothing kept) where the exchange has ended already."""
        if self.state is Step.DONE:
            self.on(event)  # only a disconnect may come after the end
            return False
        self.ending = Ending(event, self.on(event))
        return True

    def stop(self, event: Event, worker: asyncio.Task[None]) -> None:
        """`end`, and cancel the worker where that ended the exchange (the cancel closes its
        connection to llama-server, which takes it for a cancel)."""
        if self.end(event):
            worker.cancel()

    @property
    def at_boundary(self) -> bool:
        """The last byte sent ends an SSE event (a comment or an event may follow)."""
        return self.last_chunk.endswith(_EVENT_ENDS)

    @property
    def in_send(self) -> bool:
        return self.sending_since != 0.0

    @property
    def stream_ended(self) -> bool:
        """The client has been sent the stream's last event (OpenAI's `[DONE]`, Anthropic's
        `message_stop`), whole: one that goes now, before llama-server's closing chunk, has
        had the whole answer."""
        return (self.state is Step.STREAMING and not self.in_send
                and any(end in self.last_chunk for end in STREAM_ENDS))
