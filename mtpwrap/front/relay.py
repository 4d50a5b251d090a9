"""The exchange with llama-server: one forwarded request, relayed to the client as it arrives.

The relay sends the request over the front's wire to llama-server (`mtpwrap.supervision.wire`:
HTTP/1.1 over its UNIX socket or loopback TCP, parsed by llhttp, connections kept and reused)
and passes the answer on as it arrives, without buffering: status and body byte for byte (what
one read of the socket brought is one write to the client), response headers except hop-by-hop
ones (`Connection`, `Keep-Alive`, `Transfer-Encoding`), `Access-Control-*` (llama-server
reflects any `Origin`) and `Server`/`Date` (uvicorn sets them). Added: `X-Accel-Buffering: no`
on event streams and the draft-depth header on generations the depth policy decided. On the way
in only `Content-Type`, `Accept` and `User-Agent` pass, and the child's internal key is sent as
`Authorization: Bearer`.

Reuse. llama-server (cpp-httplib) ends the connection after each streamed answer: its chunk
provider returns false once it has called `sink.done()`, which cpp-httplib takes for a cancel,
so the keep-alive loop stops and the socket closes with no `Connection: close` to warn the
client. A request sent on that connection in the moment before the close arrives fails with
"Server disconnected without sending a response" and, being possibly read, cannot be retried.
So a streamed request says `Connection: close` itself and its connection is never pooled;
every other answer keeps its connection (measured: 0 failures in 200 requests with reuse,
over the socket and over TCP, tests/test_upstream_reuse.py).

Faults. A request is never retried once its body may have reached the child (a generation is not
idempotent); only a refused connect is retried, once. If the child dies or the loopback link
breaks mid-stream, or a stream makes no progress within its budget (`prefill_stall_s` before the
first chunk — a step of llama-server's on the slot, a token of the prompt read or, for an answer
not streamed, of the answer generated, is progress — and `stream_stall_s` after), the client
gets a terminal SSE event `data: {"error": {...}}` and the stream ends without `[DONE]`; a stall
is reported to the supervisor. A client that goes away, before or after the first token, cancels
the upstream request at once (the connection to the child is closed, which llama-server treats
as a cancel).
A client that does not read gets `write_timeout_s` per write, bounded by uvicorn's write buffer.
While a streamed request waits for its first token, `: keep-alive` SSE comments go out every
`keepalive_s` (the 200 event-stream headers are sent early for that; a later upstream error then
arrives as an error event instead of an HTTP status).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front import depth_policy
from mtpwrap.front.depth_policy import DepthPolicy
from mtpwrap.front.exchange import (
    EVENT_STATUS,
    EVENT_STREAM,
    PEER_EOF,
    UPSTREAM_OWES,
    Action,
    Event,
    Exchange,
    IllegalStep,
)
from mtpwrap.front.metrics import FrontMetrics
from mtpwrap.front.reads import Reads
from mtpwrap.front.replies import (
    BY_UPSTREAM,
    Receive,
    Replies,
    Scope,
    Send,
    error_kind,
    error_message,
)
from mtpwrap.supervision.state import SupervisorPort, Upstream
from mtpwrap.supervision.wire import ConnectFailed, UpstreamError, WirePool, WireResponse

log = logging.getLogger("mtpwrap.proxy")

#: The client headers llama-server uses; nothing else is forwarded (the body's length and the
#: internal key are set by the front itself).
_FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"user-agent"})
_DROP_RESPONSE = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"server", b"date",
    b"proxy-authenticate", b"trailer", b"upgrade",
})
_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


#: llama-server's 500s by the text of their message: (class, caused by the request). Its
#: handlers answer every exception but `std::invalid_argument` with a 500, so a request whose
#: JSON has the wrong shape where it reads it (nlohmann's type and range errors, a missing
#: field) gets a 500 for the client's mistake; the relay answers those with 400 and llama-server's
#: own message (`X-Mtpwrap-Status-Was: 500`). Each is counted in
#: `mtpwrap_upstream_errors_total{kind="status_500", class}` (docs/reliability.md lists them).
UPSTREAM_500: tuple[tuple[re.Pattern[str], str, bool], ...] = tuple(
    (re.compile(pattern, re.I), klass, client) for pattern, klass, client in (
        (r"type must be|type_error|cannot use operator|is not an? (object|array|string)",
         "json_type", True),
        (r"is required|key '[^']*' not found|out_of_range\.403", "missing_field", True),
        (r"parse_error|parse error|syntax error", "json_parse", True),
        (r"_M_range_check|out_of_range|out of range|invalid token", "out_of_range", True),
        (r"grammar", "grammar", True),
        (r"template|jinja", "template", False),
        (r"image|audio|mtmd|multimodal|projector", "multimodal", True),
        (r"failed to parse (tools|messages)", "request_shape", True),
    ))


def upstream_500_class(message: str) -> tuple[str, bool]:
    """The class of a llama-server 500 by its message, and whether the request caused it. Only
    llama-server's own words count: where a message quotes the request's JSON back ("Failed
    to parse messages: Missing tool call type: {…}"), a key in it such as
    `chat_template_kwargs` must not make it a template error (found by make fuzz)."""
    own = message.split("{", 1)[0]
    for pattern, klass, client in UPSTREAM_500:
        if pattern.search(own):
            return klass, client
    return "other", False


def _error_message(raw: bytes) -> str:
    """llama-server's error message (`error.message`, or `error` itself when it is a string,
    in a JSON body or in one `data:` event), or the start of its body when it has none."""
    body = raw.strip().removeprefix(b"data:")
    if (message := error_message(body)) is not None:
        return message
    with contextlib.suppress(ValueError):
        doc = json.loads(body)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"]:
            return str(doc["error"])[:500]
    return raw[:500].decode("utf-8", "replace")


def _as_client_error(raw: bytes) -> bytes:
    """llama-server's error body with the code and type of a client's mistake."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return raw
    err.update(code=400, type="invalid_request_error")
    return json.dumps(doc, ensure_ascii=False).encode()


def relay_wire(config: ProxyConfig) -> WirePool:
    """The relay's connections to llama-server (`mtpwrap.supervision.wire`)."""
    return WirePool(connect_timeout_s=config.connect_timeout_s,
                    write_timeout_s=config.write_timeout_s,
                    # llama-server's slots, and two for the routes that take none (tokenize …)
                    max_idle=config.max_concurrency + 2)


class Relay:
    """Sends exchanges to llama-server and relays their answers (see the module docstring)."""

    def __init__(self, supervisor: SupervisorPort, config: ProxyConfig, metrics: FrontMetrics,
                 replies: Replies, wire: WirePool, depth: DepthPolicy | None) -> None:
        self.supervisor = supervisor
        self.config = config
        self.metrics = metrics
        self.replies = replies
        self.wire = wire
        self.depth = depth
        # how often the watch looks (a client's shut side is acted on within one look)
        self.tick = max(0.05, min(0.25, config.keepalive_s / 2, config.stream_stall_s / 4,
                                  config.write_timeout_s / 4))
        #: the chat model's slots: a step on one (a token read or generated) is progress, so
        #: `prefill_stall_s` cuts a read or an unstreamed answer that stopped, not a long one
        self.reads: Reads | None = None

    # ------------------------------------------------------------------ sending

    def _upstream_headers(self, scope: Scope, api_key: str, stream: bool
                          ) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in scope["headers"] if k in _FORWARD_REQUEST]
        headers.append((b"accept-encoding", b"identity"))
        headers.append((b"authorization", b"Bearer " + api_key.encode()))
        if stream:
            # llama-server closes the connection after every streamed answer, without saying
            # so (see the module docstring): ask for the close, so the connection never goes
            # back to the pool for a request to die on.
            headers.append((b"connection", b"close"))
        return headers

    async def _send_upstream(self, ex: Exchange, scope: Scope, body: bytes, upstream: Upstream,
                             path: str) -> WireResponse:
        qs = scope.get("query_string", b"")
        target = path + (("?" + qs.decode("latin-1")) if qs else "")
        for attempt in (1, 2):
            ex.generation = upstream.generation
            try:
                return await self.wire.request(
                    upstream, scope["method"], target,
                    self._upstream_headers(scope, upstream.api_key, ex.stream), body,
                    keep=not ex.stream)
            except ConnectFailed:
                # Nothing reached the child; one retry is safe (a restart may have just moved it).
                self.metrics.upstream_errors.labels("connect", "").inc()
                if attempt == 2:
                    raise
                up = await self.supervisor.wait_ready(min(5.0, self.config.queue_timeout_s))
                if up is None:
                    raise
                upstream = up
        raise AssertionError("unreachable")

    async def exchange(self, ex: Exchange, scope: Scope, send: Send, body: bytes, path: str,
                       upstream: Upstream) -> None:
        loop = asyncio.get_running_loop()
        ex.on(Event.SENT)
        ex.last_progress = loop.time()
        if ex.ticket is not None:  # from here on a prompt may be computed: it is charged
            ex.ticket.tally.sent = True
        try:
            resp = await self._send_upstream(ex, scope, body, upstream, path)
        except UpstreamError as err:
            await self._failed(ex, send, err)
            return
        try:
            await self._relay(ex, resp, send, loop)
        except UpstreamError as err:
            await self._failed(ex, send, err)
        finally:
            await resp.aclose()

    # ------------------------------------------------------------------ relaying

    async def _upstream_error(self, resp: WireResponse) -> tuple[int, str, bytes | None]:
        """llama-server's answer read as an error: the status to end with, its message, its
        body (None where the link broke before its end: a 502). A 500 is counted by class,
        and one the request caused is a 400."""
        try:
            raw = await resp.read()
        except UpstreamError as err:  # the exchange has ended already: this is its message
            return 502, self._broken(err), None
        message = _error_message(raw)
        if resp.status != 500:
            return (resp.status if resp.status >= 400 else 502), message, raw
        klass, client = upstream_500_class(message)
        self.metrics.upstream_errors.labels("status_500", klass).inc()
        return (400 if client else 500), message, raw

    def _response_headers(self, ex: Exchange, resp: WireResponse,
                          sse: bool) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in resp.headers
                   if k not in _DROP_RESPONSE and not k.startswith(b"access-control-")]
        if sse and not any(k == b"x-accel-buffering" for k, _ in headers):
            headers.append((b"x-accel-buffering", b"no"))
        if ex.depth is not None:
            headers.append((depth_policy.HEADER, ex.depth.header()))
        headers.append(BY_UPSTREAM)
        return headers

    async def _relay(self, ex: Exchange, resp: WireResponse, send: Send,
                     loop: asyncio.AbstractEventLoop) -> None:
        ex.status = resp.status
        sse = resp.header(b"content-type").startswith(b"text/event-stream")
        if ex.ticket is not None:
            ex.ticket.tally.status, ex.ticket.tally.stream = resp.status, sse
        event = (Event.HEAD_500 if resp.status == 500 and not sse
                 else Event.HEAD_STREAM if resp.status == 200 and sse else Event.HEAD_BODY)
        async with ex.send_lock:  # no keep-alive comment under the head
            action = ex.on(event)
            if action is Action.SEND_HEAD:
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": self._response_headers(ex, resp, sse)})
        if action is Action.ANSWER:
            await self._answer_whole(ex, resp, send)
            return
        if action is Action.ERROR_EVENT:
            status, message, _ = await self._upstream_error(resp)
            await self.conclude(ex, send, event, action, message, status)
            return
        await self._body(ex, resp, send, loop)
        await self.conclude(ex, send, Event.BODY_END, ex.on(Event.BODY_END))

    async def _answer_whole(self, ex: Exchange, resp: WireResponse, send: Send) -> None:
        """llama-server's 500, counted by class; one the request caused goes out as a 400
        with llama-server's own message (`X-Mtpwrap-Status-Was: 500`)."""
        status, message, raw = await self._upstream_error(resp)
        if raw is None:
            await self.replies.error(send, status, message, ex.label, ex.t0,
                                     reason="upstream_error")
            return
        client = status == 400
        if client:
            raw = _as_client_error(raw)
        headers = [(k, v) for k, v in self._response_headers(ex, resp, False)
                   if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        if client:
            headers.append((b"x-mtpwrap-status-was", b"500"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})
        self.replies.record(ex.label, status, ex.t0)

    async def _body(self, ex: Exchange, resp: WireResponse, send: Send,
                    loop: asyncio.AbstractEventLoop) -> None:
        """Pass the body on as it arrives, one client write per upstream read. Per chunk only
        what the watch needs (the time, the chunk's reference) and one float appended for the
        inter-chunk histogram, which takes the request's gaps once at its end; whether the
        stream stands at an event boundary is read from the last chunk only when a keep-alive
        comment or an error event is to be written. The ticket's tally sees each chunk (its
        token counts)."""
        clock = loop.time
        lock = ex.send_lock
        feed = ex.ticket.tally.feed if ex.ticket is not None else None
        gaps: list[float] = []
        streaming = ex.state in EVENT_STREAM
        gap = gaps.append if streaming else None
        last = 0.0
        try:
            async for chunk in resp.chunks():
                now = clock()
                if gap is not None and ex.first_chunk:
                    gap(now - last)
                elif not ex.first_chunk:
                    ex.first_chunk = True
                    if streaming:
                        ttft = time.perf_counter() - ex.t0
                        self.metrics.ttft.labels(ex.label).observe(ttft)
                        if ex.ticket is not None:
                            ex.ticket.ttft_s = ttft
                last = ex.last_progress = now
                if lock.locked():  # a keep-alive comment is being written: let it end first
                    async with lock:
                        pass
                # The watch enforces write_timeout_s on this send (a timer per chunk would cost
                # more than the rest of the relay); uvicorn's send blocks while its buffer is
                # full. A keep-alive comment is only written while no send is in progress.
                ex.last_chunk = chunk
                if feed is not None:
                    feed(chunk)
                ex.sending_since = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                ex.sending_since = 0.0
        finally:
            if gaps:
                self.metrics.itl.labels(ex.label).observe_many(gaps)

    def _observe_depth(self, ex: Exchange) -> None:
        """What the drafts of a relayed answer came to (its timings: its tally keeps them)."""
        if self.depth is None or ex.depth is None or ex.status != 200 or ex.ticket is None:
            return
        said = ex.ticket.tally.said()
        drafted, accepted = said["drafted_tokens"], said["accepted_tokens"]
        if drafted is not None and accepted is not None:
            self.depth.observe(ex.depth, drafted, accepted)

    # ------------------------------------------------------------------ ending

    def _broken(self, err: UpstreamError) -> str:
        """A broken link to llama-server, counted; the message that ends its request."""
        if not isinstance(err, ConnectFailed):  # a failed connect is counted where it happens
            self.metrics.upstream_errors.labels(err.kind, "").inc()
        return ("The model server closed the connection before finishing the response "
                f"({err.kind}: {err}).")

    async def _failed(self, ex: Exchange, send: Send, err: UpstreamError) -> None:
        await self.conclude(ex, send, Event.UPSTREAM_FAILED, ex.on(Event.UPSTREAM_FAILED),
                            self._broken(err))

    def _stall_budget(self, ex: Exchange) -> float:
        """Seconds without progress that stop `ex`: before its first chunk, after it."""
        return self.config.stream_stall_s if ex.first_chunk else self.config.prefill_stall_s

    def _message(self, ex: Exchange, event: Event) -> str:
        if event is Event.SHUTDOWN:
            return ("The server is shutting down and its drain time ran out; the request "
                    "was stopped before it finished. Retry it.")
        if event is Event.STALL:
            return (f"The model made no progress for {self._stall_budget(ex):g} s; the request "
                    "was stopped.")
        return "The model server failed on this request."

    async def conclude(self, ex: Exchange, send: Send, event: Event, action: Action,
                       message: str | None = None, status: int | None = None) -> None:
        """Carry out the action that ends an exchange (`mtpwrap.front.exchange.TABLE`): the one
        place an ending is written and the request recorded, with the status the client saw."""
        if status is None:
            status = EVENT_STATUS.get(event, ex.status)
        reason = event.value if event in EVENT_STATUS else None
        # cut short: stopped by the watch or the drain, or broken once its answer had begun (a
        # failed link before any head is an error answer, counted in upstream_errors)
        if reason is not None and not (event is Event.UPSTREAM_FAILED and action is Action.REPLY):
            self.metrics.cancelled.labels(reason).inc()
        if event is Event.STALL and ex.stream and ex.generation is not None:
            try:
                self.supervisor.report_stall(ex.generation, message or self._message(ex, event))
            except Exception as err:
                log.warning("could not report a stall: %s", err)
        if action in (Action.FINISH, Action.TAKEN):
            if ex.ticket is not None:
                ex.ticket.tally.ended = True
            if action is Action.FINISH:
                await send({"type": "http.response.body", "body": b""})
            self.replies.record(ex.label, status, ex.t0)
            self._observe_depth(ex)
        elif action is Action.REPLY:
            await self.replies.error(send, status, message or self._message(ex, event),
                                     ex.label, ex.t0, retry=event is Event.SHUTDOWN,
                                     close=event is Event.SHUTDOWN, reason=reason)
        elif action is Action.ERROR_EVENT:
            # the headers went out as an event stream: no client can take this for a
            # complete answer (no `[DONE]`)
            self.replies.record(ex.label, status, ex.t0, reason or "upstream_error")
            body = b"data: " + json.dumps(
                {"error": {"code": status, "message": message or self._message(ex, event),
                           "type": error_kind(status)}}).encode() + b"\n\n"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(send({"type": "http.response.body", "more_body": True,
                                             "body": (b"" if ex.at_boundary else b"\n\n")
                                             + body}), 1.0)
                await asyncio.wait_for(send({"type": "http.response.body", "body": b""}), 1.0)
        elif action is Action.CUT:
            # the client is gone, or its body is left incomplete: uvicorn closes the connection
            # without the final chunk, so the client's HTTP layer reports it cut
            self.replies.record(ex.label, status, ex.t0, reason)
        else:
            raise IllegalStep(f"exchange {ex.label}: {action.value} does not end it")

    # ------------------------------------------------------------------ watching

    async def watch(self, ex: Exchange, scope: Scope, receive: Receive, send: Send,
                    worker: asyncio.Task[None]) -> None:
        """Watch the client for a disconnect, and the child for progress, while the worker
        runs; what it finds is an event (`Exchange.end`), carried out once the worker has
        stopped (its cancel closes its upstream response: llama-server learns the client is
        gone)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        while not worker.done():
            try:
                msg = await asyncio.wait_for(receive(), self.tick)
                if msg["type"] == "http.disconnect":
                    ex.stop(Event.STREAM_TAKEN if ex.stream_ended else Event.CLIENT_GONE,
                            worker)
                    return
                continue
            except asyncio.TimeoutError:
                pass
            if ex.in_send:
                if loop.time() - ex.sending_since >= cfg.write_timeout_s:
                    ex.stop(Event.SLOW_READER, worker)
                    return
                continue
            if ex.state not in UPSTREAM_OWES:
                continue
            if loop.time() - ex.last_progress >= cfg.prefill_stall_s and not ex.first_chunk \
                    and self.reads is not None:
                ago = await self.reads.advanced_ago()
                if worker.done() or ex.first_chunk or ex.state not in UPSTREAM_OWES:
                    continue  # the answer began (or ended) while the slots were asked
                if ago is not None and ago < cfg.prefill_stall_s:
                    # the slot still steps (a read or an answer): the budget runs from its last
                    ex.last_progress = max(ex.last_progress, loop.time() - ago)
                    continue
            if loop.time() - ex.last_progress >= self._stall_budget(ex):
                ex.stop(Event.STALL, worker)
                return
            quiet = loop.time() - max(ex.last_progress, ex.last_keepalive)
            # a client that shut its side may have gone for good: a keep-alive comment now
            # (opening its stream if need be) is answered with a reset if it has, and the
            # connection sees that
            if ex.stream and ex.at_boundary and (quiet >= cfg.keepalive_s
                                                 or scope.pop(PEER_EOF, False)):
                ex.last_keepalive = loop.time()
                # the comment's write has the write budget too: for a client that stopped
                # reading, uvicorn's send waits for room in its buffer, and holds the send lock
                try:
                    await asyncio.wait_for(self._keepalive(ex, send), cfg.write_timeout_s)
                except asyncio.TimeoutError:
                    if ex.state in UPSTREAM_OWES:  # (the worker may have ended it meanwhile)
                        ex.stop(Event.SLOW_READER, worker)
                    return

    async def _keepalive(self, ex: Exchange, send: Send) -> None:
        async with ex.send_lock:
            if not ex.at_boundary or ex.in_send or ex.state not in UPSTREAM_OWES:
                return
            action = ex.on(Event.QUIET)
            if action is Action.OPEN_STREAM:
                await send({"type": "http.response.start", "status": 200,
                            "headers": list(_SSE_HEADERS)})
            if action in (Action.OPEN_STREAM, Action.COMMENT):
                await send({"type": "http.response.body", "body": _KEEPALIVE,
                            "more_body": True})
