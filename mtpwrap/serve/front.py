"""The HTTP front: clients talk to this, never to llama-server.

One `Front` serves one supervised child. It forwards every allowed llama-server route through an
`httpx.AsyncClient` (one per front, HTTP/1.1, a fresh connection per request) and
relays the answer chunk by chunk as it arrives, without buffering.

Transparency. Status codes and bodies pass unchanged, byte for byte; a request with temperature 0
and a seed gets the same bytes as a direct request, apart from the fields llama-server itself
varies per call: `id`, `created` and `timings` (and the cached-token counts in `usage` when the
prompt cache is on, since the second of two identical requests finds the first one's prompt).
Response headers pass too, except: hop-by-hop headers (`Connection`, `Keep-Alive`,
`Transfer-Encoding`) which the front's own HTTP layer sets, every `Access-Control-*` header
(llama-server reflects any `Origin`; the front has no permissive CORS), and `Server`/`Date`,
which uvicorn sets. Added: `X-Accel-Buffering: no` on event streams. On the way in the client's
`Authorization`, `X-Api-Key`, `Cookie` and `Host` are dropped and the child's internal key is sent
as `Authorization: Bearer`.

Faults. A request is never retried once its body may have reached the child (a generation is not
idempotent); only a refused connect is retried, once. If the child dies or the loopback link
breaks mid-stream, or a stream makes no progress within its budget (`prefill_stall_s` before the
first chunk, `stream_stall_s` after), the client gets a terminal SSE event
`data: {"error": {...}}` and the stream ends without `[DONE]`; a stall is reported to the
supervisor. A client that goes away, before or after the first token, cancels the upstream
request at once (the connection to the child is closed, which llama-server treats as a cancel).
A client that does not read gets `write_timeout_s` per write, bounded by uvicorn's write buffer.
While a streamed request waits for its first token, `: keep-alive` SSE comments go out every
`keepalive_s` (the 200 event-stream headers are sent early for that; a later upstream error then
arrives as an error event instead of an HTTP status).

Load. At most `max_concurrency` requests are forwarded at once; up to `queue_size` more wait
(also while the child restarts) for at most `queue_timeout_s`, then get 503 + `Retry-After`.
Beyond that, requests are refused at once: 429 when the child is ready (overload), 503 when not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from mtpwrap.config.apikeys import key_table
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.run.state import State, SupervisorPort
from mtpwrap.serve import ops, spec_policy
from mtpwrap.serve.metrics import CONTENT_TYPE, FrontMetrics
from mtpwrap.serve.policy import (
    BadBody,
    check_fields,
    classify,
    derive_allowed_hosts,
    error_body,
    host_of,
    key_scopes,
    parse_json_body,
    presented_key,
    required_scope,
)
from mtpwrap.serve.policy import Route as Verdict

__all__ = ["Front", "ProxyConfig"]

log = logging.getLogger("mtpwrap.proxy")
access_log = logging.getLogger("mtpwrap.access")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_OPEN_PATHS = frozenset({"/livez", "/readyz"})
#: The client headers llama-server uses; nothing else is forwarded (the body's length and the
#: internal key are set by the front itself).
_FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"user-agent"})
_DROP_RESPONSE = frozenset({
    "connection", "keep-alive", "transfer-encoding", "server", "date", "proxy-authenticate",
    "trailer", "upgrade",
})
_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry = status, reason, message, retry


@dataclass(eq=False)  # identity: one exchange is one request (kept in a dict while open)
class _Exchange:
    """Mutable state of one forwarded request, shared by its worker and its guard."""

    label: str
    stream: bool
    t0: float
    phase: str = "queued"            # queued -> headers -> body -> done
    started: bool = False            # http.response.start sent to the client
    committed_sse: bool = False      # we sent event-stream headers before the child answered
    sse: bool = False
    at_boundary: bool = True         # the last byte sent ends an SSE event
    in_send: bool = False
    send_started: float = 0.0
    first_chunk: bool = False
    last_progress: float = 0.0
    last_chunk_at: float = 0.0
    last_keepalive: float = 0.0
    cancel_reason: str | None = None
    status: int = 0
    generation: int | None = None
    slot: bool = True                # takes one of llama-server's slots (a forwarding permit)
    spec: spec_policy.Decision | None = None  # the draft depth chosen for this request
    tail: bytes = b""                # the response's last bytes, while `spec` is set
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _kind(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
            421: "invalid_request_error", 429: "rate_limit_error"}.get(status, "unavailable_error")


class Front:
    """The ASGI front for one supervised llama-server (see the module docstring)."""

    def __init__(self, supervisor: SupervisorPort, config: ProxyConfig,
                 info: dict[str, Any]) -> None:
        self.supervisor = supervisor
        self.config = config
        self.info = dict(info)
        self.inflight = 0
        self.queued = 0
        self.draining = False
        self.leaving = False  # /readyz says draining; requests are still taken (drain grace)
        self._workers: dict[_Exchange, asyncio.Task[None]] = {}
        self._active = 0
        self._gate = asyncio.Semaphore(config.max_concurrency)
        self._keys = key_table(config.api_keys, "proxy.api_keys")
        self._enabled = frozenset(config.enable_paths)
        self._hosts = derive_allowed_hosts(config)
        self._idle = asyncio.Event()
        self._idle.set()
        self._tick = max(0.05, min(1.0, config.keepalive_s / 2, config.stream_stall_s / 4,
                                   config.write_timeout_s / 4))
        n = config.max_concurrency + 4
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=config.connect_timeout_s, read=None,
                                  write=config.write_timeout_s, pool=config.queue_timeout_s),
            # No keep-alive to the child: llama-server 0c1e570 closes kept-alive connections
            # under the client's feet (measured: 12 of 80 requests on reused connections got
            # "Server disconnected without sending a response", 0 of 80 on fresh ones), and a
            # generation sent on such a connection cannot be retried. A loopback connect costs
            # a fraction of a millisecond.
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=0),
            trust_env=False,  # an HTTP_PROXY in the environment must never see loopback traffic
            follow_redirects=False,
        )
        self.metrics = FrontMetrics(supervisor.status, self._front_stats)
        self.spec = spec_policy.from_info(self.info, self.metrics.registry)
        if not config.auth_enabled and not config.listen_is_loopback():
            log.warning("the front listens on %s without API keys: anyone who reaches this "
                        "address can use the model; set api_key_file or MTPWRAP_API_KEYS",
                        config.listen_host)
        routes = [
            Route("/livez", ops.livez, methods=["GET", "HEAD"]),
            Route("/readyz", ops.make_readyz(self), methods=["GET", "HEAD"]),
            Route("/healthz", ops.make_healthz(self), methods=["GET", "HEAD"]),
            Route("/metrics", self._metrics_endpoint, methods=["GET", "HEAD"]),
            Mount("", app=self._proxy),
        ]
        middleware = [Middleware(_Guard, front=self)]
        if config.cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            middleware.append(Middleware(
                CORSMiddleware, allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "x-api-key", "content-type"]))
        self.app = Starlette(routes=routes, middleware=middleware)

    # ----------------------------------------------------------------------------- lifecycle

    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503 + Retry-After) and wait up to `timeout` for in-flight ones.

        When the budget is spent, every request still open is stopped: a stream gets an error
        event that names the shutdown, a request without an answer yet gets 503, and its
        connection to llama-server is closed, so the child can stop at once.
        """
        self.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        if not self.inflight:
            return
        log.warning("drain budget (%gs) spent with %d request(s) still in flight; stopping "
                    "them", timeout, self.inflight)
        for ex, worker in list(self._workers.items()):
            if not worker.done():
                ex.cancel_reason = "shutdown"
                worker.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), 3.0)

    def server_config(self, **kwargs: Any) -> Any:
        """The uvicorn configuration that serves this front, with its connection limits."""
        from mtpwrap.serve.http_server import ConnectionLimits, uvicorn_config

        cfg = self.config
        limits = ConnectionLimits(
            header_timeout_s=cfg.header_timeout_s, max_connections=cfg.max_connections,
            max_header_bytes=cfg.max_header_bytes, max_headers=cfg.max_headers,
            on_refuse=lambda kind: self.metrics.refused.labels(kind).inc())
        return uvicorn_config(self.app, limits, cfg.idle_timeout_s, **kwargs)

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def forwarding(self) -> int:
        """Requests sent to llama-server and not finished (queued ones not counted)."""
        return self._active

    def _front_stats(self) -> dict[str, float]:
        return {"requests_in_flight": float(self.inflight), "queue_depth": float(self.queued),
                "forwarding": float(self._active), "draining": 1.0 if self.draining else 0.0}

    # ----------------------------------------------------------------------------- metrics

    async def _metrics_endpoint(self, _request: Request) -> Response:
        up = self.supervisor.status().upstream
        text = None
        # A scrape is idempotent, so one retry is allowed after a transport error.
        for attempt in (1, 2):
            if up is None:
                break
            try:
                r = await self.client.get(
                    up.base_url + "/metrics",
                    headers={"authorization": f"Bearer {up.api_key}"},
                    timeout=self.config.backend_metrics_timeout_s)
                if r.status_code == 200 and r.headers.get("content-type", "").startswith(
                        "text/plain"):
                    text = r.text
                break
            except httpx.TimeoutException as err:
                log.debug("child /metrics timed out: %s", err)
                break
            except httpx.TransportError as err:
                log.debug("child /metrics unreadable (try %d): %s", attempt, err)
        self.metrics.set_backend(text)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ----------------------------------------------------------------------------- helpers

    async def _answer(self, send: Send, status: int, message: str, label: str, t0: float,
                      retry: bool = False, close: bool = False,
                      extra: list[tuple[bytes, bytes]] | None = None,
                      path: str | None = None) -> None:
        body = error_body(status, message, _kind(status), path or label)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if retry:
            headers.append((b"retry-after", str(self.config.retry_after_s).encode()))
        if close:
            headers.append((b"connection", b"close"))
        headers += extra or []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._record(label, status, t0)

    def _record(self, label: str, status: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.metrics.requests.labels(label, str(status)).inc()
        self.metrics.duration.labels(label).observe(dt)
        # Route pattern and status only: never the query, headers or body (privacy).
        access_log.info("%s %d %.3fs", label, status, dt)

    def _hold(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    # ----------------------------------------------------------------------------- the proxy

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        method = scope["method"]
        route = classify(method, scope.get("raw_path") or scope["path"].encode(), self._enabled)
        if route.status:
            self.metrics.refused.labels("path").inc()
            # The body is not read: close rather than read a refused upload to its end.
            await self._answer(send, route.status, route.message, route.label, t0,
                               close=_declares_body(scope))
            return
        if self.draining:
            self.metrics.shed.labels("draining").inc()
            await self._answer(send, 503, "The server is shutting down.", route.label, t0,
                               retry=True, close=True)
            return
        self._hold()
        try:
            await self._forward(scope, receive, send, route, t0)
        finally:
            self._release()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send, label: str,
                         t0: float) -> bytes | None:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > limit:
                    self.metrics.refused.labels("body_size").inc()
                    await self._answer(send, 413 if declared > limit else 400,
                                       f"The request body is larger than {limit} bytes."
                                       if declared > limit else "Bad Content-Length.",
                                       label, t0, close=True)
                    return None
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.metrics.cancelled.labels("client_disconnect").inc()
                self._record(label, 499, t0)
                return None
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                # Stop reading here: memory stays bounded by the limit plus one read.
                self.metrics.refused.labels("body_size").inc()
                await self._answer(send, 413, f"The request body is larger than {limit} bytes.",
                                   label, t0, close=True)
                return None
            if part:
                chunks.append(part)
            more = msg.get("more_body", False)
        return b"".join(chunks)

    def _must_queue(self) -> bool:
        st = self.supervisor.status()
        return self._active >= self.config.max_concurrency or st.state is not State.READY

    async def _forward(self, scope: Scope, receive: Receive, send: Send, route: Verdict,
                       t0: float) -> None:
        label, upstream_path = route.label, route.upstream_path
        # Shed before reading the body: overload is answered fast and costs no memory.
        if route.slot and self._must_queue() and self.queued >= self.config.queue_size:
            ready = self.supervisor.status().state is State.READY
            reason = "overload" if ready else "not_ready"
            self.metrics.shed.labels(reason).inc()
            await self._answer(send, 429 if ready else 503,
                               "The server is busy; retry later." if ready else
                               "The model is not ready; retry later.", label, t0,
                               retry=True, close=True)
            return
        body = await self._read_body(scope, receive, send, label, t0)
        if body is None:
            return
        stream = False
        decision: spec_policy.Decision | None = None
        if body and route.json_body:
            # llama-server parses the body as JSON whatever its Content-Type says, so every
            # limit is checked on what it will parse.
            try:
                doc = parse_json_body(body)
                check_fields(doc, self.config.max_n_probs, self.config.max_choices,
                             self.config.max_predict)
            except BadBody as err:
                self.metrics.refused.labels("body").inc()
                await self._answer(send, 400, str(err), label, t0)
                return
            stream = isinstance(doc, dict) and doc.get("stream") is True
            decision, body = self._spec_request(label, doc, body)
        ex = _Exchange(label=label, stream=stream, t0=t0, slot=route.slot, spec=decision)
        worker = asyncio.create_task(self._work(ex, scope, send, body, upstream_path))
        guard = asyncio.create_task(self._guard(ex, receive, send, worker))
        self._workers[ex] = worker
        try:
            await worker
        except asyncio.CancelledError:
            if ex.cancel_reason is None or not worker.cancelled():
                raise  # the server is cancelling us; not ours to swallow
        finally:
            guard.cancel()
            self._workers.pop(ex, None)
        if worker.cancelled() and ex.cancel_reason is not None:
            await self._finish_cancelled(ex, send)

    async def _admit(self, ex: _Exchange) -> Any:
        """Wait for a forwarding slot and a ready child; return the Upstream or raise _Refusal."""
        cfg = self.config
        st = self.supervisor.status()
        if not ex.slot:
            # No slot needed (tokenize, props, models ...): only a ready child.
            if st.state is State.READY and st.upstream is not None:
                return st.upstream
            up = await self.supervisor.wait_ready(cfg.queue_timeout_s)
            if up is None:
                self.metrics.shed.labels("not_ready").inc()
                raise _Refusal(503, "not_ready", "The model is not ready; retry later.")
            return up
        if not self._gate.locked() and st.state is State.READY and st.upstream is not None:
            await self._gate.acquire()  # uncontended: returns without suspending
            return st.upstream
        if self.queued >= cfg.queue_size:
            ready = st.state is State.READY
            self.metrics.shed.labels("overload" if ready else "not_ready").inc()
            raise _Refusal(429 if ready else 503, "shed",
                           "The server is busy; retry later." if ready else
                           "The model is not ready; retry later.")
        self.queued += 1
        t = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.queue_timeout_s
        try:
            while True:
                up = await self.supervisor.wait_ready(max(0.0, deadline - loop.time()))
                if up is None:
                    st = self.supervisor.status()
                    state = st.state
                    reason = ("queue_timeout" if state in (State.STARTING, State.BACKOFF)
                              else "not_ready")
                    self.metrics.shed.labels(reason).inc()
                    raise _Refusal(503, reason,
                                   f"The model is not ready ({state.value}); retry later.")
                try:
                    await asyncio.wait_for(self._gate.acquire(),
                                           max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:  # not the builtin before Python 3.11
                    self.metrics.shed.labels("queue_timeout").inc()
                    raise _Refusal(503, "queue_timeout",
                                   "The server is busy; retry later.") from None
                # The child may have restarted while we waited for a slot: ask again.
                st = self.supervisor.status()
                if st.state is State.READY and st.upstream is not None:
                    return st.upstream
                # A restart (planned or not) began meanwhile: wait for the next child in
                # the queue rather than send this request to the one that is going away.
                self._gate.release()
        finally:
            self.queued -= 1
            self.metrics.queue_wait.observe(time.perf_counter() - t)

    def _upstream_headers(self, scope: Scope, api_key: str) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in scope["headers"] if k in _FORWARD_REQUEST]
        headers.append((b"accept-encoding", b"identity"))
        headers.append((b"authorization", b"Bearer " + api_key.encode()))
        return headers

    async def _send_upstream(self, ex: _Exchange, scope: Scope, body: bytes, upstream: Any,
                             path: str) -> httpx.Response:
        qs = scope.get("query_string", b"")
        for attempt in (1, 2):
            url = upstream.base_url + path + (("?" + qs.decode("latin-1")) if qs else "")
            req = self.client.build_request(
                scope["method"], url, headers=self._upstream_headers(scope, upstream.api_key),
                content=body)
            ex.generation = upstream.generation
            try:
                return await self.client.send(req, stream=True)
            except httpx.ConnectError:
                # Nothing reached the child; one retry is safe (a restart may have just moved it).
                self.metrics.upstream_errors.labels("connect").inc()
                if attempt == 2:
                    raise
                up = await self.supervisor.wait_ready(min(5.0, self.config.queue_timeout_s))
                if up is None:
                    raise
                upstream = up
        raise AssertionError("unreachable")

    async def _work(self, ex: _Exchange, scope: Scope, send: Send, body: bytes,
                    path: str) -> None:
        try:
            upstream = await self._admit(ex)
        except _Refusal as r:
            await self._answer(send, r.status, r.message, ex.label, ex.t0, retry=r.retry)
            return
        if not ex.slot:
            await self._exchange(ex, scope, send, body, path, upstream)
            return
        self._active += 1
        try:
            await self._exchange(ex, scope, send, body, path, upstream)
        finally:
            self._active -= 1
            self._gate.release()

    async def _exchange(self, ex: _Exchange, scope: Scope, send: Send, body: bytes, path: str,
                        upstream: Any) -> None:
        loop = asyncio.get_running_loop()
        ex.phase = "headers"
        ex.last_progress = loop.time()
        try:
            resp = await self._send_upstream(ex, scope, body, upstream, path)
        except httpx.HTTPError as err:
            await self._upstream_failed(ex, send, err)
            return
        try:
            await self._relay(ex, resp, send, loop)
        except httpx.HTTPError as err:
            await self._upstream_failed(ex, send, err)
        finally:
            await resp.aclose()

    async def _relay(self, ex: _Exchange, resp: httpx.Response, send: Send,
                     loop: asyncio.AbstractEventLoop) -> None:
        ctype = resp.headers.get("content-type", "")
        ex.status = resp.status_code
        sse = ctype.startswith("text/event-stream")
        async with ex.send_lock:
            if ex.committed_sse:
                if resp.status_code != 200 or not sse:
                    # Headers already went out as an event stream; the error becomes an event.
                    raw = await resp.aread()
                    try:
                        err = json.loads(raw).get("error") or {"message": raw.decode()[:500]}
                    except (ValueError, AttributeError):
                        err = {"message": raw.decode("utf-8", "replace")[:500]}
                    err.setdefault("code", resp.status_code)
                    await send({"type": "http.response.body",
                                "body": b"data: " + json.dumps({"error": err}).encode() + b"\n\n"})
                    ex.phase = "done"
                    await send({"type": "http.response.body", "body": b""})
                    self._record(ex.label, resp.status_code, ex.t0)
                    return
            else:
                headers = [(k.lower(), v) for k, v in resp.headers.raw
                           if k.decode("latin-1").lower() not in _DROP_RESPONSE
                           and not k.lower().startswith(b"access-control-")]
                if sse and not any(k == b"x-accel-buffering" for k, _ in headers):
                    headers.append((b"x-accel-buffering", b"no"))
                if ex.spec is not None:
                    headers.append((spec_policy.HEADER, ex.spec.header()))
                await send({"type": "http.response.start", "status": resp.status_code,
                            "headers": headers})
                ex.started = True
        ex.sse = sse
        ex.phase = "body"
        ttft = self.metrics.ttft.labels(ex.label)
        itl = self.metrics.itl.labels(ex.label)
        async for chunk in resp.aiter_raw():
            now = loop.time()
            if not ex.first_chunk:
                ex.first_chunk = True
                if sse:
                    ttft.observe(time.perf_counter() - ex.t0)
            elif sse:
                itl.observe(now - ex.last_chunk_at)
            ex.last_chunk_at = ex.last_progress = now
            if ex.spec is not None:
                ex.tail = (ex.tail + chunk)[-spec_policy.TAIL_BYTES:]
            # The guard enforces write_timeout_s on this send (a timer per chunk would cost
            # more than the rest of the relay); uvicorn's send blocks while its buffer is full.
            async with ex.send_lock:
                ex.in_send = True
                ex.send_started = now
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finally:
                    ex.in_send = False
                ex.at_boundary = chunk.endswith(b"\n\n") or chunk.endswith(b"\r\n\r\n")
        ex.phase = "done"
        await send({"type": "http.response.body", "body": b""})
        self._record(ex.label, resp.status_code, ex.t0)
        self._spec_response(ex)

    # ------------------------------------------------------------- speculation policy

    def _spec_request(self, label: str, doc: Any, body: bytes
                      ) -> tuple[spec_policy.Decision | None, bytes]:
        """The draft depth for a generation request, and the body that carries it (the
        client's own bytes when the policy sends nothing)."""
        if self.spec is None or label not in spec_policy.GENERATION_ROUTES \
                or not isinstance(doc, dict):
            return None, body
        decision = self.spec.decide(doc)
        if decision.depth is not None:
            body = spec_policy.inject(body, decision.depth, decision.p_min)
        return decision, body

    def _spec_response(self, ex: _Exchange) -> None:
        if self.spec is None or ex.spec is None or ex.status != 200:
            return
        counts = spec_policy.draft_counts(ex.tail)
        ex.tail = b""
        if counts is not None:
            self.spec.observe(ex.spec, *counts)

    async def _upstream_failed(self, ex: _Exchange, send: Send, err: Exception) -> None:
        kind = type(err).__name__
        self.metrics.upstream_errors.labels(kind).inc()
        message = ("The model server closed the connection before finishing the response "
                   f"({kind}).")
        if ex.phase == "headers" and not ex.started:
            await self._answer(send, 502, message, ex.label, ex.t0)
            return
        self.metrics.cancelled.labels("upstream_error").inc()
        await self._end_with_error(ex, send, 502, message)

    async def _end_with_error(self, ex: _Exchange, send: Send, status: int, message: str) -> None:
        """End a started response so that no client can take it for a complete one."""
        ex.phase = "done"
        self._record(ex.label, status, ex.t0)
        if ex.sse or ex.committed_sse:
            event = b"data: " + json.dumps(
                {"error": {"code": status, "message": message, "type": _kind(status)}}).encode()
            prefix = b"" if ex.at_boundary else b"\n\n"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": prefix + event + b"\n\n"}), 1.0)
                await asyncio.wait_for(send({"type": "http.response.body", "body": b""}), 1.0)
            return
        # A plain body cut in the middle: leave the response incomplete so the client's HTTP
        # layer reports it (uvicorn closes the connection without the final chunk).

    async def _guard(self, ex: _Exchange, receive: Receive, send: Send,
                     worker: asyncio.Task[None]) -> None:
        """Watch the client for a disconnect, and the child for progress, while the worker runs.

        Cancelling the worker closes its upstream response, which closes the connection to the
        child: that is how llama-server learns that the client is gone.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        while not worker.done():
            try:
                msg = await asyncio.wait_for(receive(), self._tick)
                if msg["type"] == "http.disconnect":
                    if ex.phase == "done":
                        return  # uvicorn says "disconnect" once the response is complete
                    ex.cancel_reason = "client_disconnect"
                    worker.cancel()
                    return
                continue
            except asyncio.TimeoutError:
                pass
            if ex.in_send:
                if loop.time() - ex.send_started >= cfg.write_timeout_s:
                    ex.cancel_reason = "slow_reader"
                    worker.cancel()
                    return
                continue
            if ex.phase not in ("headers", "body"):
                continue
            idle = loop.time() - ex.last_progress
            budget = cfg.stream_stall_s if ex.first_chunk else cfg.prefill_stall_s
            if idle >= budget:
                ex.cancel_reason = "stall"
                worker.cancel()
                return
            quiet = loop.time() - max(ex.last_progress, ex.last_keepalive)
            if ex.stream and quiet >= cfg.keepalive_s and ex.at_boundary:
                ex.last_keepalive = loop.time()
                await self._keepalive(ex, send)

    async def _keepalive(self, ex: _Exchange, send: Send) -> None:
        async with ex.send_lock:
            if not ex.at_boundary or ex.in_send or ex.phase == "done":
                return
            if not ex.started:
                ex.committed_sse = ex.started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": list(_SSE_HEADERS)})
            elif not (ex.sse or ex.committed_sse):
                return
            await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})

    async def _finish_cancelled(self, ex: _Exchange, send: Send) -> None:
        reason = ex.cancel_reason or "client_disconnect"
        self.metrics.cancelled.labels(reason).inc()
        if reason == "client_disconnect":
            self._record(ex.label, 499, ex.t0)  # nginx's "client closed request"
            return
        if reason == "slow_reader":
            # Returning with the response incomplete makes uvicorn close the connection.
            self._record(ex.label, 499, ex.t0)
            return
        if reason == "shutdown":
            message = ("The server is shutting down and its drain time ran out; the request "
                       "was stopped before it finished. Retry it.")
            if not ex.started:
                await self._answer(send, 503, message, ex.label, ex.t0, retry=True, close=True)
            else:
                await self._end_with_error(ex, send, 503, message)
            return
        # stall
        budget = self.config.stream_stall_s if ex.first_chunk else self.config.prefill_stall_s
        message = f"The model made no progress for {budget:g} s; the request was stopped."
        if ex.stream and ex.generation is not None:
            try:
                self.supervisor.report_stall(
                    ex.generation, f"no progress on {ex.label} for {budget:g} s")
            except Exception as err:
                log.warning("could not report a stall: %s", err)
        if not ex.started:
            await self._answer(send, 504, message, ex.label, ex.t0)
            return
        await self._end_with_error(ex, send, 504, message)


def _declares_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class _Guard:
    """Host check and API keys, in front of everything (ops endpoints included)."""

    def __init__(self, app: Callable[..., Awaitable[None]], front: Front) -> None:
        self.app = app
        self.front = front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        front = self.front
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        t0 = time.perf_counter()
        path = scope["path"]
        if "transfer-encoding" in headers and "content-length" in headers:
            # RFC 9112 §6.1: a sign of request smuggling; the parser refuses it too.
            front.metrics.refused.labels("bad_request").inc()
            await front._answer(send, 400, "Content-Length and Transfer-Encoding together are "
                                "not allowed.", "other", t0, close=True, path=path)
            return
        # Probes (/livez, /readyz) answer whatever Host a balancer or kubelet sends: they carry
        # no key and reveal only up/ready, so DNS rebinding gains nothing from them.
        if (front._hosts is not None and path not in _OPEN_PATHS
                and host_of(headers.get("host", "")) not in front._hosts):
            front.metrics.refused.labels("host").inc()
            await front._answer(send, 421, "This server does not answer for that Host.",
                                "other", t0, close=True, path=path)
            return
        needs_key = front._keys and path not in _OPEN_PATHS and not (
            (path == "/metrics" and front.config.metrics_public)
            or (path == "/healthz" and front.config.healthz_public)
        )
        scopes = key_scopes(presented_key(headers), front._keys) if needs_key else None
        if needs_key and scopes is None:
            front.metrics.refused.labels("auth").inc()
            # Without a key nothing of the body is read: the connection closes after the 401.
            await front._answer(send, 401, "Invalid or missing API key.", "other", t0,
                                extra=[(b"www-authenticate", b"Bearer")],
                                close=_declares_body(scope), path=path)
            return
        if scopes is not None and (need := required_scope(scope["method"], path)) not in scopes:
            front.metrics.refused.labels("scope").inc()
            await front._answer(send, 403, f"This API key may not use {path}: that needs a key "
                                f"with the {need} scope.", "other", t0,
                                close=_declares_body(scope), path=path)
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
                await front._answer(send, 500, "The front failed on this request. The error is "
                                    "in mtpwrap's log.", "other", t0, close=True, path=path)
