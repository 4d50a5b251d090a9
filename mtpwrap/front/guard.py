"""The guard in front of every route of the front (ops endpoints included): the host check, API
keys and budgets (`Access.check` says, `Replies` answers a denial), each request's audit ticket
opened and ended, the `X-Mtpwrap-Answered-By` mark, and the last word on an error inside the
app."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from mtpwrap.config.apikeys import ApiKey
from mtpwrap.front import audit
from mtpwrap.front.access import Access, Denial
from mtpwrap.front.audit import UNAUDITED, Ticket, Trail
from mtpwrap.front.budgets import OverBudget
from mtpwrap.front.exchange import REFUSED
from mtpwrap.front.replies import (
    ANSWERED_BY,
    BY_FRONT,
    BY_UPSTREAM,
    ASGIApp,
    Message,
    Receive,
    Replies,
    Scope,
    Send,
    declares_body,
)

log = logging.getLogger("mtpwrap.proxy")


class AccessGuard:
    """Host check, API keys and budgets, in front of everything (ops endpoints included): asks
    `Access.check` of the rules in force (`access()`, whose keys a reload or the key file's
    watch may swap) and answers a denial through `Replies`; opens each request's audit ticket
    and ends it when the answer has gone; also the last word on an error inside the app."""

    def __init__(self, app: ASGIApp, access: Callable[[], Access], replies: Replies,
                 trail: Trail) -> None:
        self.app = app
        self.access = access
        self.replies = replies
        self.trail = trail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await _refuse_other(scope, send)  # nothing but HTTP passes the guard
            return
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        t0 = time.perf_counter()
        path = scope["path"]
        # the table in use now (swapped whole on a change of keys): this request's verdict
        verdict = self.access().check(scope["method"], path, headers)
        if path in UNAUDITED:
            await self._answer(scope, receive, _marking(send), verdict, t0, path)
            return
        key = verdict.key if isinstance(verdict, Denial) else verdict
        ticket = self.trail.begin(scope, path, key)
        token = audit.current.set(ticket)
        try:
            await self._answer(scope, _counting(receive, ticket), _observing(send, ticket),
                               verdict, t0, path)
        finally:
            audit.current.reset(token)
            if (refused := scope.get(REFUSED)) is not None:  # the connection's
                ticket.status, ticket.reason = refused
            elif not ticket.status:
                ticket.status, ticket.reason = 499, ticket.reason or "client_disconnect"
            await self.trail.finish(ticket)

    async def _answer(self, scope: Scope, receive: Receive, send: Send,
                      verdict: Denial | ApiKey | None, t0: float, path: str) -> None:
        if isinstance(verdict, Denial):
            self.replies.metrics.refused.labels(verdict.reason).inc()
            close = declares_body(scope) if verdict.close is None else verdict.close
            await self.replies.error(send, verdict.status, verdict.message, "other", t0,
                                     close=close, extra=list(verdict.headers), path=path,
                                     reason=verdict.reason)
            return
        if verdict is not None and (over := self.trail.budgets.check(verdict)) is not None:
            await refuse_budget(self.replies, send, verdict, over, "other", t0,
                                close=declares_body(scope), path=path)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            log.error("internal error on %s %s: %s: %s", scope["method"], path,
                      type(exc).__name__, exc)
            log.debug("internal error details", exc_info=exc)
            # If the response had started, uvicorn refuses a second start and closes the
            # connection, which leaves the client with an incomplete (not a wrong) answer.
            with contextlib.suppress(Exception):
                await self.replies.error(send, 500, "The front failed on this request. The "
                                         "error is in mtpwrap's log.", "other", t0, close=True,
                                         path=path, reason="internal")


async def refuse_budget(replies: Replies, send: Send, key: ApiKey, over: OverBudget, label: str,
                        t0: float, close: bool, path: str | None = None) -> None:
    """The 429 of a budget: which key, which budget, when it resets (and `Retry-After`)."""
    replies.metrics.refused.labels("budget").inc()
    await replies.error(send, 429, over.message(key.name), label, t0, close=close,
                        extra=[(b"retry-after", str(over.retry_after_s).encode())], path=path,
                        reason=f"budget_{over.budget}")


def _counting(receive: Receive, ticket: Ticket) -> Receive:
    """`receive`, counting the request body's bytes on the ticket."""
    async def counted() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            ticket.bytes_in += len(message.get("body", b""))
        return message
    return counted


def _observing(send: Send, ticket: Ticket) -> Send:
    """`_marking(send)` that also notes on the ticket the status, who answered and the bytes
    out (the relay feeds llama-server's answer to the ticket's tally)."""
    marked = _marking(send)

    async def observed(message: Message) -> None:
        if message["type"] == "http.response.start":
            ticket.status = message["status"]
            if BY_UPSTREAM in (message.get("headers") or ()):
                ticket.by = "llama-server"
        elif body := message.get("body"):
            ticket.bytes_out += len(body)
        await marked(message)
    return observed


def _marking(send: Send) -> Send:
    """`send`, with `X-Mtpwrap-Answered-By: front` added to every response the relay did not
    mark as llama-server's."""
    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers") or ())
            if not any(k == ANSWERED_BY for k, _v in headers):
                message = {**message, "headers": [*headers, BY_FRONT]}
        await send(message)
    return marked


async def _refuse_other(scope: Scope, send: Send) -> None:
    """A scope that is not HTTP never reaches the app: a websocket is closed before it is
    accepted (a 403 to its handshake); anything else gets nothing."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
