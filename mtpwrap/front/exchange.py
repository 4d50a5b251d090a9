"""One forwarded request's state: where it stands between the client and llama-server, and the
steps allowed between those states, in one table (in the manner of h11's `_state.py`).

    QUEUED ──> WAITING ──────────────> RELAYING ──> DONE
                  │ └─> KEPT_ALIVE ──────┘            ^
                  │         └─────────────────────────┤
                  └───────────────────────────────────┘

- QUEUED: admitted to the front, waiting for a permit; nothing sent anywhere.
- WAITING: the request went to llama-server; the client has nothing yet.
- KEPT_ALIVE: still no head from llama-server, but the front has sent the client event-stream
  headers and `: keep-alive` comments (a long prefill); an error can now only be an event.
- RELAYING: llama-server's head went to the client and its body is being passed on.
- DONE: the client has its whole answer or its end (an error event, a cut body, a 499, a
  front-made refusal); nothing more is written.

Every state may step into DONE (a cancel, a refusal, an error ends an exchange from wherever it
is); besides, only the steps of `STEPS`. A step into the state an exchange is already in is no
change. `Exchange.to` is the only way to change state: an illegal step is a bug in the relay and
raises `IllegalStep` rather than relaying a response in a state nobody planned.

The progress figures beside the state (the time of the last chunk, the write in progress, the
last keep-alive) are what the relay's watch reads to find stalls and slow readers.
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
    RELAYING = "relaying"
    DONE = "done"


#: Which state may follow which (besides DONE, always allowed, and staying).
STEPS: dict[Step, frozenset[Step]] = {
    Step.QUEUED: frozenset({Step.WAITING}),
    Step.WAITING: frozenset({Step.KEPT_ALIVE, Step.RELAYING}),
    Step.KEPT_ALIVE: frozenset({Step.RELAYING}),
    Step.RELAYING: frozenset(),
    Step.DONE: frozenset(),
}

#: The client has the head of a response (the front's event-stream headers or llama-server's).
HEAD_SENT = frozenset({Step.KEPT_ALIVE, Step.RELAYING, Step.DONE})
#: llama-server owes this exchange something: the watch looks for stalls.
UPSTREAM_OWES = frozenset({Step.WAITING, Step.KEPT_ALIVE, Step.RELAYING})

_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
#: the last event of a complete stream, OpenAI's and Anthropic's
STREAM_ENDS = (b"data: [DONE]", b"event: message_stop")


class IllegalStep(RuntimeError):
    """A step the table does not allow: the relay is wrong, not the client or llama-server."""


def allowed(old: Step, new: Step) -> bool:
    return new is old or new is Step.DONE or new in STEPS[old]


@dataclass(eq=False)  # identity: one exchange is one request (kept in a dict while open)
class Exchange:
    """One forwarded request, shared by its worker (which relays) and its watch."""

    label: str
    stream: bool
    t0: float
    slot: bool = True                # takes one of llama-server's slots (a forwarding permit)
    depth: DepthDecision | None = None  # the draft depth chosen for this request
    state: Step = Step.QUEUED
    #: the client's answer is an event stream (the front's keep-alive headers, or llama-server's)
    event_stream: bool = False
    #: the last chunk sent to the client (a reference: whether it ends an SSE event is read
    #: from it only when the front writes bytes of its own)
    last_chunk: bytes = b"\n\n"
    #: loop time the relay's current client write began; 0.0 while none is in progress
    sending_since: float = 0.0
    first_chunk: bool = False
    last_progress: float = 0.0
    last_keepalive: float = 0.0
    cancel_reason: str | None = None
    status: int = 0
    generation: int | None = None
    #: its audit ticket, whose tally the relay feeds the answer's chunks to (the depth policy
    #: reads the draft figures from its last ones)
    ticket: Ticket | None = None
    #: held while the front's own bytes (headers, a keep-alive comment) are written; the relay
    #: takes it only when it is held (see `Relay._body`)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def to(self, new: Step) -> None:
        """The one way to change state (`STEPS`)."""
        if not allowed(self.state, new):
            raise IllegalStep(f"exchange {self.label}: {self.state.value} -> {new.value}")
        self.state = new

    @property
    def head_sent(self) -> bool:
        return self.state in HEAD_SENT

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
        return (self.event_stream and not self.in_send
                and any(end in self.last_chunk for end in STREAM_ENDS))
