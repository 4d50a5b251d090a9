"""The front's own answers (errors in the caller's API shape) and the per-request record.

Every room of the front — the access guard, admission, the relay — answers and records through
one `Replies`, so a refusal looks and counts the same wherever it is decided.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mtpwrap.front import audit
from mtpwrap.front.metrics import FrontMetrics

# The ASGI types, as the ASGI spec writes them (its messages are plain mappings).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger("mtpwrap.access")

#: Who made an answer: every response carries it (docs/operations/endpoints.md). The relay
#: marks what it passes on from llama-server; the access guard marks everything else.
ANSWERED_BY = b"x-mtpwrap-answered-by"
BY_FRONT = (ANSWERED_BY, b"front")
BY_UPSTREAM = (ANSWERED_BY, b"llama-server")


def error_message(body: bytes) -> str | None:
    """The `error.message` of an error body (the front's and llama-server's shape alike), or
    None when the body has none."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return None

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          421: "invalid_request_error", 429: "rate_limit_error"}


def error_kind(status: int) -> str:
    """The error's `type` for a status, as OpenAI's and Anthropic's APIs name them."""
    return _KINDS.get(status, "unavailable_error")


def declares_body(scope: Scope) -> bool:
    """The request says a body follows (so a refusal closes instead of reading it)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def error_body(status: int, message: str, kind: str, path: str) -> bytes:
    """An error in the shape of the API the client called: Anthropic's for /v1/messages,
    else OpenAI's, which llama-server's native endpoints share."""
    if path.startswith("/v1/messages"):
        return json.dumps({"type": "error", "error": {"type": kind, "message": message}}
                          ).encode()
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


class Replies:
    """Answers the front gives itself, and the one record of each finished request."""

    def __init__(self, metrics: FrontMetrics, retry_after_s: int) -> None:
        self.metrics = metrics
        self.retry_after_s = retry_after_s

    async def error(self, send: Send, status: int, message: str, label: str, t0: float,
                    retry: bool = False, close: bool = False,
                    extra: list[tuple[bytes, bytes]] | None = None,
                    path: str | None = None, reason: str | None = None,
                    retry_after_s: int | None = None) -> None:
        """A front-made error answer; `reason`: why, for the audit trail (a metrics label);
        `retry_after_s`: when to come back, where known better than the front's default."""
        body = error_body(status, message, error_kind(status), path or label)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if retry or status == 503:  # a 503 always says when to come back
            after = self.retry_after_s if retry_after_s is None else retry_after_s
            headers.append((b"retry-after", str(after).encode()))
        if close:
            headers.append((b"connection", b"close"))
        headers += extra or []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.record(label, status, t0, reason or error_kind(status))

    def record(self, label: str, status: int, t0: float, reason: str | None = None) -> None:
        """The one record of a finished request: its metrics, the access log, and the status
        and reason its audit ticket ends with."""
        if (ticket := audit.current.get()) is not None:
            ticket.status = status
            if reason is not None:
                ticket.reason = reason
        dt = time.perf_counter() - t0
        self.metrics.requests.labels(label, str(status)).inc()
        self.metrics.duration.labels(label).observe(dt)
        # Route pattern and status only: never the query, headers or body (privacy).
        access_log.info("%s %d %.3fs", label, status, dt)
