"""Ops endpoints of the front: /livez, /readyz, /healthz.

- `/livez`: 200 whenever mtpwrap's own event loop answers; never looks at the child, so a slow
  model load or a crash loop does not get mtpwrap itself killed by a liveness probe.
- `/readyz`: 200 only when the child is READY and the front is not draining; otherwise 503 with
  `{"status": <state>, "reason": ...}` and `Retry-After`. It is the chat model's readiness: a
  companion that is down does not take the node out of a balancer. `/readyz?model=NAME` is one
  companion's (or, with the chat model's name or `chat`, the chat model's).
- `/healthz`: one JSON document for people (always 200): state, profile, build, model, context,
  uptime, restarts, last error, GPU memory and temperature (with how current they are:
  `gpu_read`), queue and in-flight counts; for a key with the admin scope (or when the front
  has no keys) the command llama-server runs, with the reason for each flag (`command`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mtpwrap.front import audit
from mtpwrap.front.gpu import GpuView
from mtpwrap.supervision.state import State, SupervisorStatus

if TYPE_CHECKING:
    from mtpwrap.front.app import Front


async def livez(_request: Request) -> Response:
    return JSONResponse({"status": "alive"})


def readiness(front: Front) -> tuple[bool, dict[str, Any]]:
    return _readiness(front, front.supervisor.status())


def companion_readiness(front: Front, name: str) -> tuple[bool, dict[str, Any]] | None:
    """One companion's readiness; None when no companion has that name."""
    c = front.routes.get(name)
    if c is None:
        return None
    return _readiness(front, c.supervisor.status(), {"model": name})


def _readiness(front: Front, st: SupervisorStatus, named: dict[str, str] | None = None
               ) -> tuple[bool, dict[str, Any]]:
    """Ready: the child READY and the front not draining; `named`: the companion's name, in the
    answer after its status."""
    named = named or {}
    if front.draining or front.leaving:
        return False, {"status": "draining", "reason": "mtpwrap is shutting down", **named}
    if (up := st.ready_upstream) is None:
        return False, {"status": st.state.value, **named,
                       "reason": st.reason or f"child is {st.state.value}"}
    return True, {"status": "ready", **named, "generation": up.generation}


def make_readyz(front: Front) -> Callable[[Request], Awaitable[Response]]:
    async def readyz(request: Request) -> Response:
        name = request.query_params.get("model")
        answer = None if name in (None, "chat", front.info.model) else \
            companion_readiness(front, str(name))
        if name not in (None, "chat", front.info.model) and answer is None:
            names = ", ".join(["chat", *(c.name for c in front.routes.companions)])
            return JSONResponse({"status": "unknown", "reason": f"no model {name!r} here; "
                                 f"ask for one of {names}"}, status_code=404)
        ok, body = answer if answer is not None else readiness(front)
        headers = {} if ok else {"Retry-After": str(front.config.retry_after_s)}
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    return readyz


def gpu_rows(view: GpuView) -> list[dict[str, Any]]:
    """The GPUs as /healthz and /status.json list them."""
    return [{"index": g.index, "name": g.name, "memory_used_bytes": g.memory_used,
             "memory_total_bytes": g.memory_total, "temperature_c": g.temperature_c}
            for g in view.readings]


def health_document(front: Front, gpu: GpuView) -> dict[str, Any]:
    """The /healthz document; `gpu` is what the front's gauge gave (`await front.gpu.view()`)."""
    st = front.supervisor.status()
    now = time.time()
    ready, _ = readiness(front)
    info = front.info
    up = st.upstream
    return {
        "state": st.state.value,
        "ready": ready,
        "draining": front.draining,
        "reason": st.reason,
        "profile": info.profile,
        "model": info.model,
        "context": info.context,
        "binary": info.binary,
        "uptime_s": round(now - st.started_at, 1) if st.started_at else None,
        "child_uptime_s": round(now - st.child_started_at, 1) if st.child_started_at else None,
        "ready_for_s": round(now - st.ready_since, 1) if st.ready_since else None,
        "restarts": st.restarts,
        "step_down": {"step": st.step, "note": st.step_note},
        "last_error": st.last_exit or (st.reason if st.state in (State.FAILED, State.BACKOFF)
                                       else None),
        "child_pid": st.pid,
        "generation": up.generation if up is not None else None,
        # how the front reaches llama-server: its UNIX socket, or loopback TCP, and why
        "upstream": {"transport": ("unix" if up.socket else "tcp") if up is not None
                     else info.upstream, "socket": up.socket if up is not None else None,
                     "why": info.upstream_why},
        "requests": {
            "in_flight": front.inflight,
            "queued": front.queued,
            "max_concurrency": front.config.max_concurrency,
            "queue_size": front.config.queue_size,
        },
        "gpu": gpu_rows(gpu),
        # how current "gpu" is: fresh, stale (NVML has not answered since) or unavailable
        "gpu_read": gpu.to_dict(),
        "profile_reason": info.profile_reason,
        "commit": info.commit,
        "kv": info.kv,
        "speculation": info.speculation_type,
        "near_edge": info.near_edge,
        "memory_plan": info.memory_plan,
        "log_file": info.log_file,
        "webui": info.webui,
        "build_lacks": list(info.lacks),
        "documents": info.documents,
        # the document store: where, how full, how many full-context documents it holds
        "store": front.documents.summary() if front.documents is not None else None,
        "reload": dict(front.reload) if front.reload is not None else None,
        "spec_policy": front.depth.snapshot() if front.depth is not None else None,
        "companions": [c.health() for c in front.routes.companions],
    }


def admin_asks(front: Front) -> bool:
    """Whether the request being answered may see what only an admin sees (the running
    command line): its key has the admin scope, or the front has no keys at all."""
    ticket = audit.current.get()
    if ticket is not None and ticket.api_key is not None:
        return "admin" in ticket.api_key.scopes
    return not front.access.keys


def make_healthz(front: Front) -> Callable[[Request], Awaitable[Response]]:
    async def healthz(_request: Request) -> Response:
        doc = health_document(front, await front.gpu.view())
        if admin_asks(front):
            doc["command"] = front.supervisor.status().command
        return JSONResponse(doc)

    return healthz
