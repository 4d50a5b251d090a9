"""The draft depth each request gets: per request class, from the client, the profile's table or
what the front has learned from earlier responses.

Sources, first that applies:
1. `client`: the request carries its own `speculative.*` fields; they are never touched;
2. `learned` (spec.adapt on, the class observed): the depth that maximises the modelled speedup
   (acceptance.modelled_speedup with the profile's step cost) at the class's estimated α, or no
   speculation when even the best depth is below break-even;
3. `profile`: the profile's spec.policy entry for the class;
4. `default`: nothing is sent; the server's configured depth applies.
A class whose depth is 0 still speculates on a share of its requests (`probe`, spec.adapt's
probe_share), so that it is observed again and can come back.

α is estimated per class from each response's `timings.draft_n` and `draft_n_accepted`: the
acceptance rate r at depth k gives 1 + r·k tokens per verification step, and
acceptance.alpha_for_tokens_per_step solves that for α (drafts that stop early make this an
underestimate). The estimate is an exponentially weighted average over drafted tokens.

The state is a fixed set of per-class records, touched only from the event loop: no locks.
Acting needs a llama-server that honours a request's own depth (patch 0001 upstream, 0006 on
the TurboQuant + MTP fork; found by build/spec_probe). Elsewhere — a binary the probe found
`ignored` or one never probed — every decision is `unsupported`, no body is changed, and
/healthz says why (`unsupported_reason`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from mtpwrap.decide import acceptance
from mtpwrap.decide.profile_types import ClassPolicy, SpecAdapt
from mtpwrap.decide.request_class import CLASSES, classify
from mtpwrap.front.info import ServeInfo

HEADER = b"x-mtpwrap-spec"
#: the routes whose requests generate text (and accept speculative.* fields)
GENERATION_ROUTES = frozenset({
    "/completion", "/completions", "/v1/completions", "/chat/completions",
    "/v1/chat/completions", "/responses", "/v1/responses", "/v1/messages", "/infill",
})
#: drafted tokens a class needs before its estimate is used
MIN_DRAFTED = 16


@dataclass(frozen=True)
class DepthDecision:
    cls: str
    depth: int | None  # what the request was given; None: nothing sent (client's or server's)
    p_min: float | None
    source: str  # client | learned | probe | profile | default | unsupported
    effective_depth: int | None  # the depth the drafts were made at, as far as known
    #: for `unsupported`: why, as one token (probe-ignored, not-probed); /healthz has the sentence
    why: str | None = None

    def header(self) -> bytes:
        shown = self.effective_depth if self.effective_depth is not None else "server"
        why = f" why={self.why}" if self.why else ""
        return f"class={self.cls} depth={shown} source={self.source}{why}".encode()


@dataclass
class _ClassState:
    alpha: float | None = None
    drafted: int = 0
    accepted: int = 0
    requests: int = 0
    depth: int | None = None  # the learned depth, once there is an estimate
    sources: dict[str, int] = field(default_factory=dict)


def best_depth(alpha: float, max_depth: int, adapt: SpecAdapt) -> tuple[int, float]:
    """(depth, modelled speedup): the depth in 1..max_depth with the best modelled speedup, or
    (0, 1.0) when none beats no speculation."""
    best, speed = 0, 1.0
    for k in range(1, max_depth + 1):
        s = acceptance.modelled_speedup(alpha, k, adapt.overhead, adapt.per_draft)
        if s > speed:
            best, speed = k, s
    return best, speed


def alpha_from_response(drafted: int, accepted: int, depth: int) -> float | None:
    """α from one response's draft counts at draft depth `depth`."""
    ratio = acceptance.rate(drafted, accepted)
    if ratio is None or drafted < 0 or depth < 1:
        return None
    return acceptance.alpha_for_tokens_per_step(1.0 + min(1.0, ratio) * depth, depth)


def client_fields(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k.startswith("speculative.")}


def inject(body: bytes, depth: int, p_min: float | None) -> bytes:
    """The body with `"speculative.n_max": depth` (and p_min) added as the object's first keys;
    every other byte is the client's."""
    fields = {"speculative.n_max": depth}
    if p_min is not None:
        fields["speculative.p_min"] = p_min  # type: ignore[assignment]
    text = json.dumps(fields, separators=(",", ":"))[1:-1].encode()
    start = body.index(b"{") + 1
    rest = body[start:]
    empty = rest.strip() == b"}"
    return body[:start] + text + (b"" if empty else b",") + rest


class DepthPolicy:
    """Decides each generation request's draft depth and learns from its response."""

    def __init__(self, *, supported: bool, server_depth: int | None,
                 table: dict[str, ClassPolicy] | None = None,
                 adapt: SpecAdapt | None = None, metrics: DepthMetrics | None = None,
                 reason: str | None = None, why: str | None = None) -> None:
        self.supported = supported
        #: why a request's own depth cannot be given, when it cannot: a sentence for /healthz
        #: and a token for the response header
        self.reason = reason if not supported else None
        self.why = (why or "not-probed") if not supported else None
        self.server_depth = server_depth
        self.max_depth = server_depth or 8
        self.table = dict(table or {})
        self.adapt = adapt or SpecAdapt()
        self.state = {c: _ClassState() for c in CLASSES}
        self.metrics = metrics
        if metrics is not None:
            for c in CLASSES:
                self._publish(c)

    # ------------------------------------------------------------------ deciding

    def _probe_now(self, st: _ClassState) -> bool:
        share = self.adapt.probe_share
        if share <= 0:
            return False
        every = max(1, round(1 / share))
        return st.requests % every == 0

    def decide(self, doc: Any) -> DepthDecision:
        cls = classify(doc)
        st = self.state[cls]
        st.requests += 1
        if not self.supported:
            return self._count(st, DepthDecision(cls, None, None, "unsupported", self.server_depth,
                                                 self.why))
        given = client_fields(doc) if isinstance(doc, dict) else {}
        if given:
            n_max = given.get("speculative.n_max")
            eff = n_max if isinstance(n_max, int) and not isinstance(n_max, bool) else None
            if eff is not None and self.server_depth is not None:
                eff = min(eff, self.server_depth)
            return self._count(st, DepthDecision(cls, None, None, "client",
                                            eff if eff is not None else self.server_depth))
        static = self.table.get(cls)
        if self.adapt.enabled and st.depth is not None:
            depth, p_min, source = st.depth, static.p_min if static else None, "learned"
        elif static is not None:
            depth, p_min, source = static.depth, static.p_min, "profile"
        else:
            return self._count(st, DepthDecision(cls, None, None, "default", self.server_depth))
        if depth == 0 and self.adapt.enabled and self._probe_now(st):
            depth, source = max(1, min(2, self.max_depth)), "probe"
        depth = min(depth, self.max_depth)
        return self._count(st, DepthDecision(cls, depth, p_min, source, depth))

    def _count(self, st: _ClassState, d: DepthDecision) -> DepthDecision:
        st.sources[d.source] = st.sources.get(d.source, 0) + 1
        if self.metrics is not None:
            self.metrics.requests.labels(d.cls, d.source).inc()
        return d

    # ------------------------------------------------------------------ learning

    def observe(self, d: DepthDecision, drafted: int, accepted: int) -> None:
        """One response's timings.draft_n / draft_n_accepted for a request decided as `d`."""
        if d.source == "unsupported":
            return
        st = self.state[d.cls]
        st.drafted += max(0, drafted)
        st.accepted += max(0, min(accepted, drafted))
        if self.metrics is not None and drafted > 0:
            self.metrics.drafted.labels(d.cls).inc(drafted)
            self.metrics.accepted.labels(d.cls).inc(max(0, min(accepted, drafted)))
        depth = d.effective_depth
        sample = alpha_from_response(drafted, accepted, depth or 0)
        if sample is not None:
            weight = 1.0 - math.pow(0.5, drafted / self.adapt.half_life_tokens)
            st.alpha = sample if st.alpha is None else st.alpha + weight * (sample - st.alpha)
        if self.adapt.enabled and st.alpha is not None and st.drafted >= MIN_DRAFTED:
            st.depth, _ = best_depth(st.alpha, self.max_depth, self.adapt)
        self._publish(d.cls)

    def _publish(self, cls: str) -> None:
        if self.metrics is None:
            return
        st = self.state[cls]
        if st.alpha is not None:
            self.metrics.alpha.labels(cls).set(st.alpha)
        chosen = self.current_depth(cls)
        self.metrics.depth.labels(cls).set(-1 if chosen is None else chosen)

    def current_depth(self, cls: str) -> int | None:
        """The depth the class's next request would get (None: the server's own)."""
        st = self.state[cls]
        if self.adapt.enabled and st.depth is not None:
            return st.depth
        static = self.table.get(cls)
        return static.depth if static is not None else None

    # ------------------------------------------------------------------ showing

    def snapshot(self) -> dict[str, Any]:
        """For /healthz: the table as it stands, per class."""
        classes: dict[str, Any] = {}
        for cls in CLASSES:
            st = self.state[cls]
            static = self.table.get(cls)
            classes[cls] = {
                "depth": self.current_depth(cls),
                "source": ("learned" if self.adapt.enabled and st.depth is not None
                           else "profile" if static is not None else "default"),
                "profile_depth": static.depth if static is not None else None,
                "alpha": None if st.alpha is None else round(st.alpha, 4),
                "acceptance": (None if (r := acceptance.rate(st.drafted, st.accepted)) is None
                               else round(r, 4)),
                "drafted": st.drafted, "accepted": st.accepted, "requests": st.requests,
                "by_source": dict(st.sources),
            }
        return {"status": "active" if self.supported else "unsupported",
                **({} if self.supported else {"reason": self.reason}),
                "adapt": self.adapt.enabled,
                "server_depth": self.server_depth, "classes": classes}


#: the header's token for a probe result that leaves the policy unsupported
_WHY = {"ignored": "probe-ignored", "unknown": "not-probed"}


def unsupported_reason(info: ServeInfo) -> str | None:
    """Why this launch cannot give a request its own draft depth; None when it can."""
    detail = f" ({info.per_request_depth_detail})" if info.per_request_depth_detail else ""
    depth = info.speculation.depth if info.speculation is not None else None
    server = f"the server's depth {depth}" if depth is not None else "the server's own depth"
    if info.per_request_depth == "honoured":
        return None
    if info.per_request_depth == "ignored":
        return (f"this llama-server ignores a request's own speculative.n_max{detail}, so every "
                f"request drafts at {server}; per-class depth needs a llama-server built with "
                "the per-request-speculative patch (upstream llama.cpp through `mtpwrap build`)")
    return (f"it is not known whether this llama-server honours a request's own "
            f"speculative.n_max{detail or ' (no probe recorded by `mtpwrap build`)'}, so the "
            f"front sends none and every request drafts at {server}")


def for_launch(info: ServeInfo, registry: CollectorRegistry | None = None
               ) -> DepthPolicy | None:
    """The policy for a front serving `info`, its instruments on `registry` when given; None
    when the launch does not speculate."""
    section = info.speculation
    if section is None or not info.speculates:
        return None
    return DepthPolicy(supported=info.per_request_depth == "honoured",
                       reason=unsupported_reason(info), why=_WHY.get(info.per_request_depth),
                       server_depth=section.depth,
                       table=dict(section.policy), adapt=section.adapt,
                       metrics=DepthMetrics(registry) if registry is not None else None)


class DepthMetrics:
    """The policy's instruments, on the front's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:

        self.requests = Counter(
            "mtpwrap_spec_requests", "Generation requests by request class and the source of "
            "their draft depth (client, learned, probe, profile, default, unsupported)",
            ["request_class", "source"], registry=registry)
        self.drafted = Counter(
            "mtpwrap_spec_drafted_tokens", "Draft tokens llama-server reported (timings.draft_n)",
            ["request_class"], registry=registry)
        self.accepted = Counter(
            "mtpwrap_spec_accepted_tokens", "Accepted draft tokens llama-server reported "
            "(timings.draft_n_accepted)", ["request_class"], registry=registry)
        self.alpha = Gauge(
            "mtpwrap_spec_alpha", "Estimated per-position draft acceptance α of the class",
            ["request_class"], registry=registry)
        self.depth = Gauge(
            "mtpwrap_spec_depth", "Draft depth the class's next request gets (0 off, -1 the "
            "server's own)", ["request_class"], registry=registry)
