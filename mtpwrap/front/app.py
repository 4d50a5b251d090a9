"""The HTTP front: clients talk to this, never to llama-server.

One `Front` serves one supervised chat model and its companions (front/companions.py). Its
rooms:
- access (front/access.py): the allow-list, hosts, keys and scopes, checked by `AccessGuard`
  (front/guard.py) in front of every route (ops endpoints included); bodies
  (front/bodies.py): what a JSON body may hold;
- admission (front/admission.py): limits, the queue, drain;
- the relay (front/relay.py): the exchange with llama-server and the streaming relay, with
  its fault handling;
- the draft-depth policy (front/depth_policy.py) for generation requests;
- here: the routes, reading the request body, and the lifecycle.

Transparency. Status codes and bodies pass unchanged, byte for byte; a request with temperature 0
and a seed gets the same bytes as a direct request, apart from the fields llama-server itself
varies per call: `id`, `created` and `timings` (and the cached-token counts in `usage` when the
prompt cache is on, since the second of two identical requests finds the first one's prompt).
On the way in the client's `Authorization`, `X-Api-Key`, `Cookie` and `Host` are dropped (see
the relay for what passes either way).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from mtpwrap.config.apikeys import KeyTable
from mtpwrap.config.objects import AuditConfig, ProxyConfig
from mtpwrap.front import audit, depth_policy, ops, rereads, status, usage
from mtpwrap.front.access import Access, classify
from mtpwrap.front.access import Route as Verdict
from mtpwrap.front.admission import Admission, Refusal, request_class
from mtpwrap.front.audit import NoSink, Trail
from mtpwrap.front.bodies import (
    BadBody,
    check_fields,
    check_grammar,
    check_messages,
    check_reasoning_format,
    check_tokens,
    check_tools,
    parse_json_body,
    require_object,
)
from mtpwrap.front.budgets import Budgets, OverBudget
from mtpwrap.front.companions import Companion, CompanionInfo, Routes, UnknownModel
from mtpwrap.front.depth_policy import DepthDecision
from mtpwrap.front.exchange import Event, Exchange, Step
from mtpwrap.front.gpu import GpuGauge
from mtpwrap.front.guard import AccessGuard, refuse_budget
from mtpwrap.front.info import ServeInfo
from mtpwrap.front.metrics import CONTENT_TYPE, FrontMetrics
from mtpwrap.front.reads import Reads
from mtpwrap.front.relay import Relay, relay_wire
from mtpwrap.front.replies import (
    Receive,
    Replies,
    Scope,
    Send,
    declares_body,
)
from mtpwrap.front.store import TIMEOUT_S, Documents, Read
from mtpwrap.supervision.state import SupervisorPort, Upstream
from mtpwrap.upstream import UpstreamClients

if TYPE_CHECKING:
    import uvicorn

__all__ = ["Front"]

log = logging.getLogger("mtpwrap.proxy")

#: the paths of the `webui` feature
_WEBUI_PATHS = frozenset({"/", "/index.html"})
#: the model lists the front answers itself when companions are configured
_MODEL_LISTS = frozenset({"/v1/models", "/models"})


class Front:
    """The ASGI front for one supervised llama-server (see the module docstring)."""

    def __init__(self, supervisor: SupervisorPort, config: ProxyConfig,
                 info: ServeInfo | None = None, audit_config: AuditConfig | None = None,
                 clock: Callable[[], float] = time.time,
                 companions: Sequence[tuple[CompanionInfo, SupervisorPort]] = (),
                 documents: Documents | None = None) -> None:
        self.supervisor = supervisor
        #: the document store (None: off); the chat model's one slot only
        self.documents = documents if config.max_concurrency == 1 else None
        self.config = config
        #: the launch served; replaced (not changed) after a reload
        self.info = info if info is not None else ServeInfo()
        #: the operator's last reload as the service that runs this front reports it (JSON)
        self.reload: Mapping[str, object] | None = None
        self.leaving = False  # /readyz says draining; requests are still taken (drain grace)
        self._workers: dict[Exchange, asyncio.Task[None]] = {}
        self._enabled = frozenset(config.enable_paths)
        #: the GPU gauges: NVML opened once, read off the loop with a timeout, cached
        self.gpu = GpuGauge()
        self.metrics = FrontMetrics(supervisor.status, self._front_stats,
                                    lambda: [c.health() for c in self.routes.companions],
                                    self.gpu.current)
        self.admission = Admission(supervisor, config, self.metrics)
        self.replies = Replies(self.metrics, config.retry_after_s)
        #: the audit trail, usage and budgets (audit_config None: no trail, budgets in memory)
        self.budgets = Budgets(audit_config.directory / "budgets.json" if audit_config
                               else None, clock)
        self.trail = Trail(audit.open_sink(audit_config, clock) if audit_config else NoSink(),
                           self.metrics, self.budgets, lambda: self.info.model, clock)
        self.trail.rereads = rereads.Rereads(config.reread_threshold_tokens,
                                             self.metrics.reread_tokens)
        #: httpx clients for what is not relayed (the metrics scrape); the relay has its wire
        self.clients = UpstreamClients(
            timeout=httpx.Timeout(config.connect_timeout_s, read=None),
            max_connections=config.max_concurrency + 4)
        #: the prompts llama-server is reading (the status page, a queue timeout's 503)
        self.reads = Reads(supervisor, self.clients, self._prompt_totals)
        self.admission.reads = self.reads
        self.wire = relay_wire(config)
        self.depth = depth_policy.for_launch(self.info, self.metrics.registry)
        self.relay = Relay(supervisor, config, self.metrics, self.replies, self.wire,
                           self.depth)
        self.relay.reads = self.reads
        #: the embedding and rerank companions, each with its own slots, queue and relay
        self.routes = Routes(tuple(
            Companion(info, sup,
                      Admission(sup, dataclasses.replace(config, max_concurrency=info.slots),
                                self.metrics),
                      Relay(sup, config, self.metrics, self.replies, self.wire, None))
            for info, sup in companions))
        self._warn_at_start(config, documents)
        status_page, status_data = status.make_pages(self)
        routes = [
            Route("/livez", ops.livez, methods=["GET", "HEAD"]),
            Route("/readyz", ops.make_readyz(self), methods=["GET", "HEAD"]),
            Route("/healthz", ops.make_healthz(self), methods=["GET", "HEAD"]),
            Route("/metrics", self._metrics_endpoint, methods=["GET", "HEAD"]),
            Route("/status", status_page, methods=["GET", "HEAD"]),
            Route("/status.json", status_data, methods=["GET", "HEAD"]),
            Mount("", app=self._proxy),
        ]
        #: hosts, keys and open pages; `swap_keys` replaces it whole
        self.access = Access.from_config(config)
        middleware = [Middleware(AccessGuard, access=lambda: self.access,
                                 replies=self.replies, trail=self.trail)]
        if config.cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            middleware.append(Middleware(
                CORSMiddleware, allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "x-api-key", "content-type"]))
        self.app = Starlette(routes=routes, middleware=middleware)

    def swap_keys(self, keys: KeyTable) -> KeyTable:
        """Check requests against `keys` from the next one on; the table it replaces. One
        reference is swapped: a request already let in finishes under the key it came with."""
        old, self.access = self.access.keys, dataclasses.replace(self.access, keys=keys)
        return old

    def _warn_at_start(self, config: ProxyConfig, documents: Documents | None) -> None:
        if not config.auth_enabled and not config.listen_is_loopback():
            log.warning("the front listens on %s without API keys: anyone who reaches this "
                        "address can use the model; set api_key_file or MTPWRAP_API_KEYS",
                        config.listen_host)
        if self.depth is not None and self.depth.reason is not None and (
                self.depth.table or self.depth.adapt.enabled):
            log.warning("per-class draft depth is unsupported: %s", self.depth.reason)
        if self.documents is None and documents is not None:
            log.warning("the document store is off: it serves a launch of one slot, and this "
                        "one has %d (set the profile's slots to 1)", config.max_concurrency)
        if "webui" in self._enabled and self.info.webui is False:
            log.warning("proxy.enable_paths lists webui, but %s", self._no_webui())

    # ----------------------------------------------------------------------------- lifecycle

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def queued(self) -> int:
        return self.admission.queued

    @property
    def draining(self) -> bool:
        return self.admission.draining

    @property
    def forwarding(self) -> int:
        """Requests sent to llama-server and not finished (queued ones not counted)."""
        return self.admission.forwarding

    def companion_forwarding(self, name: str) -> Callable[[], int]:
        """What one companion's supervisor asks before a planned restart (its `busy`)."""
        c = self.routes.get(name)
        assert c is not None, name
        return lambda: c.admission.forwarding

    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503 + Retry-After) and wait up to `timeout` for in-flight ones.

        When the budget is spent, every request still open is stopped: a stream gets an error
        event that names the shutdown, a request without an answer yet gets 503, and its
        connection to llama-server is closed, so the child can stop at once.
        """
        self.admission.draining = True
        if await self.admission.wait_idle(timeout):
            return
        log.warning("drain budget (%gs) spent with %d request(s) still in flight; stopping "
                    "them", timeout, self.inflight)
        for ex, worker in list(self._workers.items()):
            if not worker.done() and ex.state is not Step.DONE:  # not one that just ended
                ex.stop(Event.SHUTDOWN, worker)
        await self.admission.wait_idle(3.0)

    def server_config(self, **kwargs: Any) -> uvicorn.Config:
        """The uvicorn configuration that serves this front, with its connection limits."""
        from mtpwrap.front.http_server import ConnectionLimits, uvicorn_config

        cfg = self.config
        limits = ConnectionLimits(
            header_timeout_s=cfg.header_timeout_s, body_timeout_s=cfg.body_timeout_s,
            body_min_rate=cfg.body_min_rate, max_connections=cfg.max_connections,
            max_header_bytes=cfg.max_header_bytes, max_headers=cfg.max_headers,
            on_refuse=lambda kind: self.metrics.refused.labels(kind).inc())
        return uvicorn_config(self.app, limits, cfg.idle_timeout_s, **kwargs)

    async def aclose(self) -> None:
        await self.wire.aclose()
        await self.clients.aclose()
        self.trail.close()
        self.gpu.close()

    def _front_stats(self) -> dict[str, float]:
        by_class = self.admission.gate.waiting()
        return {"requests_in_flight": float(self.inflight), "queue_depth": float(self.queued),
                "queue_interactive": float(by_class["interactive"]),
                "queue_batch": float(by_class["batch"]),
                "forwarding": float(self.forwarding),
                "draining": 1.0 if self.draining else 0.0}

    # ----------------------------------------------------------------------------- metrics

    async def _metrics_endpoint(self, _request: Request) -> Response:
        up = self.supervisor.status().upstream
        text = None
        # A scrape is idempotent, so one retry is allowed after a transport error.
        for attempt in (1, 2):
            if up is None:
                break
            try:
                r = await self.clients.get(up).get(
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
        await self.gpu.view()  # off the loop, within its timeout: the collector reads the cache
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ----------------------------------------------------------------------------- the proxy

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        method = scope["method"]
        route = classify(method, scope.get("raw_path") or scope["path"].encode(), self._enabled)
        ticket = audit.current.get()
        if ticket is not None:
            ticket.route = route.label
        if not route.status and route.label in _WEBUI_PATHS and self.info.webui is False:
            route = Verdict(404, route.label,
                            message=f"The web UI is unavailable: {self._no_webui()}.")
        if route.status:
            self.metrics.refused.labels("path").inc()
            # The body is not read: close rather than read a refused upload to its end.
            await self.replies.error(send, route.status, route.message, route.label, t0,
                                     close=declares_body(scope), reason="path")
            return
        if (r := self.admission.refuse_draining()) is not None:
            await self.replies.error(send, r.status, r.message, route.label, t0, retry=True,
                                     close=True, reason=r.reason)
            return
        if ticket is not None:
            try:
                ticket.klass = request_class(scope["headers"], ticket.klass)
            except ValueError as err:
                await self.replies.error(send, 400, str(err), route.label, t0,
                                         close=declares_body(scope), reason="header")
                return
        self.admission.hold()
        try:
            if route.label in _MODEL_LISTS and self.routes.companions:
                await self._models(send, route, t0)
            else:
                await self._forward(scope, receive, send, route, t0)
        finally:
            self.admission.release()

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
                    await self.replies.error(send, 413 if declared > limit else 400,
                                             f"The request body is larger than {limit} bytes."
                                             if declared > limit else "Bad Content-Length.",
                                             label, t0, close=True, reason="body_size")
                    return None
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.metrics.cancelled.labels("client_disconnect").inc()
                self.replies.record(label, 499, t0, "client_disconnect")
                return None
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                # Stop reading here: memory stays bounded by the limit plus one read.
                self.metrics.refused.labels("body_size").inc()
                await self.replies.error(send, 413, f"The request body is larger than {limit} "
                                         "bytes.", label, t0, close=True, reason="body_size")
                return None
            if part:
                chunks.append(part)
            more = msg.get("more_body", False)
        return b"".join(chunks)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, route: Verdict,
                       t0: float) -> None:
        label = route.label
        role = self.routes.role_of(label)
        # the chat model's, or the companion's when the route alone names it; with several
        # companions of a role, the body's `model` chooses (below)
        early = self.routes.only(role) if role is not None else None
        admission = early.admission if early is not None else self.admission
        relay = early.relay if early is not None else self.relay
        if (role is None or early is not None) and \
                (r := admission.shed_early(route.slot)) is not None:
            await self.replies.error(send, r.status, r.message, label, t0, retry=True,
                                     close=True, reason=r.reason)
            return
        body = await self._read_body(scope, receive, send, label, t0)
        if body is None:
            return
        stream = False
        decision: DepthDecision | None = None
        doc: object = None
        target = early
        if route.json_body and (body or route.object_body):
            # llama-server parses the body as JSON whatever its Content-Type says, so every
            # limit is checked on what it will parse.
            try:
                doc = parse_json_body(body) if body else None
                if route.object_body:
                    require_object(doc, not body)
                if role is not None and target is None:
                    target = self.routes.target(role, doc.get("model") if isinstance(doc, dict)
                                                else None)
                check_fields(doc, self.config.max_n_probs, self.config.max_choices,
                             self.config.max_predict)
                check_tokens(doc, self.info.n_vocab if target is None else target.info.n_vocab)
                check_grammar(doc)
                check_messages(doc)
                check_reasoning_format(doc)
                if not scope["path"].startswith("/v1/messages"):
                    check_tools(doc)
            except UnknownModel as err:
                self.metrics.refused.labels("model").inc()
                await self.replies.error(send, 404, str(err), label, t0, reason="model")
                return
            except BadBody as err:
                self.metrics.refused.labels("body").inc()
                await self.replies.error(send, 400, str(err), label, t0, reason="body")
                return
            # a stream asked of a route that never streams is its JSON (a keep-alive head
            # before it would make the answer a 502)
            stream = isinstance(doc, dict) and doc.get("stream") is True \
                and label in usage.STREAMS
            if target is not None and target is not early:
                admission, relay = target.admission, target.relay
                if (r := admission.shed_early(route.slot)) is not None:
                    await self.replies.error(send, r.status, r.message, label, t0, retry=True,
                                             close=True, reason=r.reason)
                    return
            decision, body = self._decide_depth(label, doc, body)
        ticket = audit.current.get()
        if ticket is not None:
            if target is not None:
                ticket.model = target.name
            elif route.slot:  # the chat model's prompt, hashed (front/rereads.py)
                ticket.blocks = rereads.blocks(doc)
            ticket.stream = ticket.tally.stream = stream
            ticket.tally.route = label
            if not await self._reserve(ticket, send, label, doc, body, t0, scope):
                return
        ex = Exchange(label=label, stream=stream, t0=t0, slot=route.slot, depth=decision,
                      ticket=ticket)
        worker = asyncio.create_task(self._work(ex, scope, send, body, route.upstream_path,
                                                admission, relay, doc))
        watch = asyncio.create_task(relay.watch(ex, scope, receive, send, worker))
        self._workers[ex] = worker
        try:
            await worker
        except asyncio.CancelledError:
            if ex.ending is None or not worker.cancelled():
                raise  # the server is cancelling us; not ours to swallow
        finally:
            watch.cancel()
            self._workers.pop(ex, None)
            if ticket is not None:
                ticket.generation = ex.generation
        if ex.ending is not None:  # found by the watch or the drain, which stopped the worker
            await relay.conclude(ex, send, ex.ending.event, ex.ending.action)

    async def _reserve(self, ticket: audit.Ticket, send: Send, label: str, doc: object,
                       body: bytes, t0: float, scope: Scope) -> bool:
        """Reserve what the request may cost against its key's token budgets (False: refused,
        the 429 sent), and say how to count its prompt if its answer is cut."""
        ticket.prompt_estimate = usage.reservation(label, None, len(body), 0, None)
        ticket.count_prompt = _once(lambda: self._count_prompt(label, doc))
        ticket.reserved = usage.reservation(label, doc, len(body), self.config.max_predict,
                                            self.info.context)
        if ticket.api_key is None:
            return True
        hold = self.budgets.reserve(ticket.api_key, ticket.reserved)
        if isinstance(hold, OverBudget):
            await refuse_budget(self.replies, send, ticket.api_key, hold, label, t0,
                                close=False, path=scope["path"])
            return False
        ticket.hold = hold
        return True

    async def _prompt_totals(self) -> list[int]:
        """The prompt lengths of the requests forwarded to the chat model now, longest first,
        each counted once by llama-server's tokenizer (`Reads`: how long a read has left)."""
        forwarded = [ex.ticket.count_prompt for ex in list(self._workers)
                     if ex.slot and ex.state is not Step.DONE and ex.ticket is not None
                     and ex.ticket.count_prompt is not None]
        counted = [await count() for count in forwarded]
        return sorted((n for n in counted if n is not None), reverse=True)

    async def _count_prompt(self, label: str, doc: object) -> int | None:
        """The prompt of a request to the chat model as llama-server's tokenizer counts it."""
        up = self.supervisor.status().upstream
        if up is None:
            return None
        return await usage.count_prompt(self.clients.get(up), up.base_url, up.api_key, label,
                                        doc, self.config.backend_metrics_timeout_s)

    async def _work(self, ex: Exchange, scope: Scope, send: Send, body: bytes,
                    path: str, admission: Admission, relay: Relay, doc: object = None) -> None:
        try:
            t = time.perf_counter()
            upstream = await admission.admit(
                ex.slot, ex.ticket.klass if ex.ticket is not None else "interactive")
            if ex.ticket is not None:
                ex.ticket.queued_s = time.perf_counter() - t
        except Refusal as r:
            ex.on(Event.REFUSED)
            await self.replies.error(send, r.status, r.message, ex.label, ex.t0, retry=r.retry,
                                     reason=r.reason, retry_after_s=r.retry_after_s)
            return
        store = self.documents if relay is self.relay and ex.slot else None
        read: Read | None = None
        ask: Any = None if store is None else usage.asker(  # only where the store acts
            self.clients.get(upstream), upstream.base_url, upstream.api_key, TIMEOUT_S)
        try:
            if store is not None and store.head is not None and len(body) >= store.min_tokens:
                tokens = await usage.prompt_tokens(ask, ex.label, doc)
                read = None if tokens is None else \
                    await store.before(ask, upstream.generation, tokens)
                if read is not None and read.restored and ex.ticket is not None:
                    ex.ticket.restored = read.restored
            await relay.exchange(ex, scope, send, body, path, upstream)
        finally:
            if ex.slot:
                try:  # the answer went out; the next request waits for the slot's save
                    if store is not None and read is not None and ex.status == 200 \
                            and ex.ending is None:
                        saved = await store.after(ask, read)
                        if ex.ticket is not None:
                            ex.ticket.saved = saved
                finally:
                    admission.done()

    async def _models(self, send: Send, route: Verdict, t0: float) -> None:
        """/v1/models (and llama-server's /models) with companions: the chat model's list and
        each companion's, in one answer. A companion that is not ready is listed with its
        state, so that a client sees what is configured."""
        try:
            up = await self.admission.admit(False)
        except Refusal as r:
            await self.replies.error(send, r.status, r.message, route.label, t0, retry=r.retry,
                                     reason=r.reason)
            return
        listing = await self._ask_models(up, route.upstream_path)
        if listing is None:
            await self.replies.error(send, 502, "llama-server did not list its model.",
                                     route.label, t0, reason="upstream")
            return
        for c in self.routes.companions:
            st = c.supervisor.status()
            theirs = await self._ask_models(up_, route.upstream_path) \
                if (up_ := st.ready_upstream) is not None else None
            entries = [dict(e, role=c.info.role) for e in _listed(theirs, "data")]
            if not isinstance(listing.get("data"), list):
                listing["data"] = []
            listing["data"].extend(entries or [{
                "id": c.info.name, "object": "model", "owned_by": "llamacpp",
                "role": c.info.role, "status": {"value": st.state.value}}])
            if isinstance(listing.get("models"), list):
                listing["models"].extend(_listed(theirs, "models"))
        body = json.dumps(listing).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        self.replies.record(route.label, 200, t0)

    async def _ask_models(self, up: Upstream | None, path: str) -> dict[str, Any] | None:
        if up is None:
            return None
        try:
            r = await self.clients.get(up).get(
                up.base_url + path, headers={"authorization": f"Bearer {up.api_key}"},
                timeout=self.config.backend_metrics_timeout_s)
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as err:
            log.debug("%s of %s unreadable: %s", path, up.base_url, err)
            return None
        return data if isinstance(data, dict) else None

    def _no_webui(self) -> str:
        why = self.info.webui_why or "the build's manifest records no web UI"
        return f"this llama-server has no web UI ({why})"

    def _decide_depth(self, label: str, doc: object, body: bytes
                      ) -> tuple[DepthDecision | None, bytes]:
        """The draft depth for a generation request, and the body that carries it (the
        client's own bytes when the policy sends nothing)."""
        if self.depth is None or label not in depth_policy.GENERATION_ROUTES \
                or not isinstance(doc, dict):
            return None, body
        decision = self.depth.decide(doc)
        if decision.depth is not None:
            body = depth_policy.inject(body, decision.depth, decision.p_min)
        return decision, body


def _listed(answer: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The entries of a model list's `key` that are objects; [] for anything else."""
    items = (answer or {}).get(key)
    return [e for e in items if isinstance(e, dict)] if isinstance(items, list) else []


def _once(count: Callable[[], Awaitable[int | None]]) -> Callable[[], Awaitable[int | None]]:
    """A prompt counted once per request: the first call asks llama-server's tokenizer, every
    later or concurrent call (the queue, the stall check, the status page, the audit after a
    cut) awaits that one answer, a failure (None) included. A caller that gives up (a timeout)
    leaves the count running for the others."""
    task: asyncio.Task[int | None] | None = None

    def call() -> Awaitable[int | None]:
        nonlocal task
        if task is None:
            task = asyncio.ensure_future(count())
        return asyncio.shield(task)

    return call
