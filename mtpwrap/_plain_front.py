"""A minimal HTTP front, used only when `mtpwrap.proxy` is not installed.

It offers `/livez`, `/readyz`, `/healthz` and plain forwarding (streaming included) with the
internal key swapped in; requests that arrive during a restart wait for readiness up to a
timeout, then get 503 with Retry-After. The full front (auth, limits, queue, stall handling,
metrics) lives in `mtpwrap.proxy`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
        "authorization", "upgrade", "te", "trailer", "proxy-authorization"}


class PlainFront:
    def __init__(self, supervisor: Any, api_keys: tuple[str, ...], info: dict[str, Any],
                 queue_timeout_s: float = 30.0) -> None:
        self.supervisor = supervisor
        self.api_keys = api_keys
        self.info = info
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self._draining = False
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                         trust_env=False)
        self.app = Starlette(routes=[
            Route("/livez", self._livez), Route("/readyz", self._readyz),
            Route("/healthz", self._healthz),
            Route("/{path:path}", self._forward, methods=["GET", "POST", "PUT", "DELETE",
                                                          "OPTIONS", "PATCH"]),
        ])

    async def _livez(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def _readyz(self, request: Request) -> Response:
        st = self.supervisor.status()
        ok = st.state.value == "ready" and not self._draining
        return JSONResponse({"ready": ok, "state": st.state.value, "reason": st.reason},
                            status_code=200 if ok else 503)

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({**self.info, **self.supervisor.status().to_dict(),
                             "inflight": self.inflight})

    def _authorized(self, request: Request) -> bool:
        if not self.api_keys:
            return True
        got = request.headers.get("authorization", "")
        token = got[7:] if got.lower().startswith("bearer ") else ""
        return any(hmac.compare_digest(token.encode(), k.encode()) for k in self.api_keys)

    async def _forward(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, 401)
        if self._draining:
            return JSONResponse({"error": {"message": "shutting down", "code": 503}}, 503,
                                headers={"Retry-After": "5"})
        up = await self.supervisor.wait_ready(self.queue_timeout_s)
        if up is None:
            st = self.supervisor.status()
            return JSONResponse({"error": {"message": f"not ready: {st.reason}", "code": 503}},
                                503, headers={"Retry-After": "5"})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["authorization"] = f"Bearer {up.api_key}"
        body = await request.body()
        self.inflight += 1
        try:
            req = self._client.build_request(request.method, up.base_url + request.url.path,
                                             params=request.query_params, headers=headers,
                                             content=body)
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            self.inflight -= 1
            return JSONResponse({"error": {"message": f"upstream: {type(exc).__name__}",
                                           "code": 502}}, 502)

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    yield (b'data: {"error":{"message":"upstream closed the stream",'
                           b'"type":"server_error","code":502}}\n\n')

        async def done() -> None:
            self.inflight -= 1
            await resp.aclose()

        out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(body_iter(), status_code=resp.status_code, headers=out,
                                 background=BackgroundTask(done))

    async def drain(self, timeout: float) -> None:
        self._draining = True
        end = time.monotonic() + timeout
        while self.inflight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await self._client.aclose()
