"""Prometheus exposition for one front: its own counters, the supervisor, the child, the GPU.

Every Front owns a private `CollectorRegistry` (never the process-global one), so several fronts
in one process (tests, benchmarks) do not collide. llama-server's own `/metrics` page is fetched
at scrape time and re-exported with `llamacpp:` replaced by `mtpwrap_backend_`; speculative
acceptance and tokens/s are derived from it.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from mtpwrap import promtext
from mtpwrap.decide import acceptance
from mtpwrap.decide.hardware import GpuReading
from mtpwrap.front.gpu import GpuView
from mtpwrap.supervision.state import State, SupervisorStatus

log = logging.getLogger("mtpwrap.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BACKEND_PREFIX = "mtpwrap_backend_"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1, 2.5, 5)


class GapSeries:
    """One route's bucket counts (the last one +Inf) and sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe_many(self, values: list[float]) -> None:
        """A request's values at once (its inter-chunk gaps, when it ends)."""
        counts, bounds, where = self.counts, self.bounds, bisect.bisect_left
        for v in values:
            counts[where(bounds, v)] += 1
        self.total += sum(values)


class GapHistogram:
    """A Prometheus histogram of every relayed chunk's gap, taken per request (`observe_many`).

    prometheus_client's Histogram walks its buckets in Python under a lock on every observation
    (several µs, more than the rest of the front's own per-chunk work); here the counts are plain
    integers written only from the event loop and read at scrape time, which runs on the same
    loop, so no lock is needed. Exposed exactly like a Histogram of the same name and buckets.
    """

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        self._series: dict[str, GapSeries] = {}

    def labels(self, route: str) -> GapSeries:
        series = self._series.get(route)
        if series is None:
            series = self._series[route] = GapSeries(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["route"])
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for route, s in self._series.items():
            cumulative = itertools.accumulate(s.counts)
            family.add_metric([route], list(zip(les, (float(c) for c in cumulative),
                                                strict=True)), s.total)
        yield family


def _companion_families(rows: list[dict[str, object]]) -> Iterator[Metric]:
    """Each companion's supervisor, labelled by its name (`model`) and role."""
    if not rows:
        return
    g = GaugeMetricFamily("mtpwrap_companion_state", "1 for each companion's current state",
                          labels=["model", "role", "state"])
    c = CounterMetricFamily("mtpwrap_companion_restarts", "Companion restarts since start",
                            labels=["model", "role"])
    busy = GaugeMetricFamily("mtpwrap_companion_forwarding", "Requests a companion is "
                             "computing now", labels=["model", "role"])
    queued = GaugeMetricFamily("mtpwrap_companion_queue_depth", "Requests waiting for a "
                               "companion's slot", labels=["model", "role"])
    for row in rows:
        name, role = str(row["name"]), str(row["role"])
        for s in State:
            g.add_metric([name, role, s.value], 1.0 if row["state"] == s.value else 0.0)
        c.add_metric([name, role], float(row["restarts"]))  # type: ignore[arg-type]
        busy.add_metric([name, role], float(row["forwarding"]))  # type: ignore[arg-type]
        queued.add_metric([name, role], float(row["queued"]))  # type: ignore[arg-type]
    yield from (g, c, busy, queued)


class _LiveCollector:
    """Values read at scrape time: supervisor status, backend page, GPU (the readings the
    front's gauge holds: the scrape awaited them, off the loop, before it rendered)."""

    def __init__(self, status: Callable[[], SupervisorStatus],
                 front_stats: Callable[[], dict[str, float]],
                 companions: Callable[[], list[dict[str, object]]],
                 gpu: Callable[[], GpuView] = GpuView):
        self._status = status
        self._gpu = gpu
        self._front_stats = front_stats
        self._companions = companions
        self.backend_families: list[Metric] = []
        self.backend_up = 0.0

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        g = GaugeMetricFamily("mtpwrap_supervisor_state", "1 for the supervisor's current state",
                              labels=["state"])
        for s in State:
            g.add_metric([s.value], 1.0 if st.state is s else 0.0)
        yield g
        yield CounterMetricFamily("mtpwrap_supervisor_restarts", "Child restarts since start",
                                  value=float(st.restarts))
        yield CounterMetricFamily("mtpwrap_supervisor_illegal_transitions",
                                  "State changes the transition table does not allow, refused "
                                  "(each one a bug, with an error line in the log)",
                                  value=float(st.illegal_transitions))
        yield GaugeMetricFamily("mtpwrap_step_down", "Step-down rung of the running launch after "
                                "out-of-memory starts (0: the configured launch)",
                                value=float(st.step))
        up = st.upstream
        yield GaugeMetricFamily("mtpwrap_child_generation", "Generation of the running child",
                                value=float(up.generation) if up is not None else 0.0)
        for name, value in self._front_stats().items():
            yield GaugeMetricFamily(f"mtpwrap_{name}", name.replace("_", " "), value=value)

        yield from _companion_families(self._companions())
        yield GaugeMetricFamily("mtpwrap_backend_up", "1 when the child's /metrics page was read",
                                value=self.backend_up)
        yield from self.backend_families
        yield from _derived(self.backend_families)
        gpu = self._gpu()
        yield GaugeMetricFamily("mtpwrap_gpu_reading_fresh", "1 when the GPU gauges below were "
                                "read from NVML within the cache's age; 0 when NVML has not "
                                "answered in time or is unavailable (the gauges are left out)",
                                value=1.0 if gpu.state == "fresh" else 0.0)
        if gpu.state == "fresh":
            yield from _gpu_families(gpu.readings)


def _sample_values(families: Iterable[Metric], name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for fam in families:
        for s in fam.samples:
            if s.name == name:
                out.append((s.labels, s.value))
    return out


def _derived(families: list[Metric]) -> Iterator[Metric]:
    """Speculative acceptance and tokens/s from the re-exported backend counters."""
    p = BACKEND_PREFIX

    def total(name: str) -> float | None:
        vals = _sample_values(families, p + name) or _sample_values(families, p + name + "_total")
        return sum(v for _, v in vals) if vals else None

    drafted = total("spec_decode_num_draft_tokens_total")
    accepted = total("spec_decode_num_accepted_tokens_total")
    drafts = total("spec_decode_num_drafts_total")
    ratio = acceptance.rate(drafted or 0, accepted)
    if ratio is not None:
        yield GaugeMetricFamily("mtpwrap_spec_acceptance_ratio",
                                "Accepted draft tokens / drafted tokens (llama.cpp's acceptance)",
                                value=ratio)
    per_pos = (_sample_values(families, p + "spec_decode_num_accepted_tokens_per_pos_total")
               or _sample_values(families, p + "spec_decode_num_accepted_tokens_per_pos"))
    if per_pos and drafts:
        g = GaugeMetricFamily(
            "mtpwrap_spec_acceptance_by_position",
            "Drafts whose token at this position was accepted / drafts (per-position acceptance)",
            labels=["position"],
        )
        for labels, v in sorted(per_pos, key=lambda lv: int(lv[0].get("position", "0") or 0)):
            g.add_metric([labels.get("position", "")], v / drafts)
        yield g
    tokens = total("tokens_predicted_total")
    seconds = total("tokens_predicted_seconds_total")
    if tokens is not None and seconds:
        yield GaugeMetricFamily("mtpwrap_decode_tokens_per_second",
                                "Generated tokens / generation seconds since the child started",
                                value=tokens / seconds)


#: (metric, help, reading, scale): the GPU gauges, each from one field of GpuReading
_GPU_GAUGES: tuple[tuple[str, str, Callable[[GpuReading], float | None], float], ...] = (
    ("mtpwrap_gpu_memory_used_bytes", "GPU memory in use", lambda r: r.memory_used, 1.0),
    ("mtpwrap_gpu_memory_total_bytes", "GPU memory in total", lambda r: r.memory_total, 1.0),
    ("mtpwrap_gpu_utilization_ratio", "GPU busy fraction (0..1)",
     lambda r: r.utilization_gpu, 0.01),
    ("mtpwrap_gpu_temperature_celsius", "GPU temperature", lambda r: r.temperature_c, 1.0),
    ("mtpwrap_gpu_power_watts", "GPU power draw", lambda r: r.power_w, 1.0),
    ("mtpwrap_gpu_power_limit_watts", "GPU power limit", lambda r: r.power_limit_w, 1.0),
)


def _gpu_families(samples: Sequence[GpuReading]) -> Iterator[Metric]:
    """The GPU gauges; a family no GPU has a reading for is left out."""
    for name, doc, read, scale in _GPU_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["gpu"])
        for s in samples:
            if (v := read(s)) is not None:
                g.add_metric([str(s.index)], float(v) * scale)
        if g.samples:
            yield g
    g = GaugeMetricFamily("mtpwrap_gpu_throttle", "1 for each active throttle reason",
                          labels=["gpu", "reason"])
    for s in samples:
        for r in s.throttle_reasons:
            g.add_metric([str(s.index), r], 1.0)
    if g.samples:
        yield g


def parse_backend(text: str) -> list[Metric]:
    """llama-server's exposition with `llamacpp:` names moved under `mtpwrap_backend_`."""
    out: list[Metric] = []
    for fam in promtext.families(text):
        name = BACKEND_PREFIX + fam.name.split(":", 1)[-1].replace(":", "_")
        m = Metric(name, fam.documentation, fam.type, fam.unit)
        for s in fam.samples:
            sname = BACKEND_PREFIX + s.name.split(":", 1)[-1].replace(":", "_")
            m.add_sample(sname, s.labels, s.value, s.timestamp, s.exemplar)
        out.append(m)
    return out


class FrontMetrics:
    """The front's instruments, all on one private registry."""

    def __init__(self, status: Callable[[], SupervisorStatus],
                 front_stats: Callable[[], dict[str, float]],
                 companions: Callable[[], list[dict[str, object]]] = list,
                 gpu: Callable[[], GpuView] = GpuView):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("mtpwrap_requests", "Requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.duration = Histogram("mtpwrap_request_duration_seconds",
                                  "Arrival to last byte sent", ["route"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mtpwrap_time_to_first_token_seconds",
                              "Arrival to first streamed event from the child", ["route"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = GapHistogram("mtpwrap_inter_token_seconds",
                                "Gap between consecutive streamed chunks from the child",
                                _ITL_BUCKETS)
        r.register(self.itl)
        self.queue_wait = Histogram("mtpwrap_queue_wait_seconds", "Time spent waiting in the queue",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.shed = Counter("mtpwrap_shed", "Requests refused without forwarding (overload, "
                            "not ready, draining, queue timeout)", ["reason"], registry=r)
        self.cancelled = Counter("mtpwrap_cancelled", "Requests cut short, by cause",
                                 ["reason"], registry=r)
        self.upstream_errors = Counter(
            "mtpwrap_upstream_errors", "Failures talking to the child, and its 500s by class",
            ["kind", "class"], registry=r)
        self.refused = Counter("mtpwrap_refused", "Requests refused by policy", ["reason"],
                               registry=r)
        self.reloads = Counter("mtpwrap_reloads", "Reloads and restarts of llama-server asked "
                               "for by the operator, by outcome (ok, refused, failed)",
                               ["outcome"], registry=r)
        # Usage by key name: the names are the configured ones (and "-" for requests without
        # a key), so the label sets stay as few as the key file's lines.
        self.key_requests = Counter("mtpwrap_key_requests", "Requests by key name and status "
                                    "class (2xx, 4xx, 5xx)", ["key", "status"], registry=r)
        self.key_tokens = Counter("mtpwrap_key_tokens", "Tokens by key name, prompt or "
                                  "completion (llama-server's usage)", ["key", "kind"],
                                  registry=r)
        self.key_refused = Counter("mtpwrap_key_refused", "Requests refused by the front, by "
                                   "key name and reason", ["key", "reason"], registry=r)
        self.model_requests = Counter("mtpwrap_model_requests", "Requests by the model that "
                                      "answered them (the chat model's file, or a companion's "
                                      "name) and status class", ["model", "status"],
                                      registry=r)
        self.audit_unwritten = Counter(
            "mtpwrap_audit_unwritten", "Audit lines not written to the trail, by reason "
            "(queue_full and shutdown: the line is in the service's log instead; write_failed: "
            "the sink refused it)", ["reason"], registry=r)
        self.reread_tokens = Counter(
            "mtpwrap_reread_tokens", "Prompt tokens the chat model read again, of requests "
            "that read more than proxy.reread_threshold_tokens, by cause (front/rereads.py)",
            ["cause"], registry=r)
        self.audit_queue = Gauge("mtpwrap_audit_queue_lines", "Audit lines queued for the "
                                 "writer thread and not yet written", registry=r)
        self.live = _LiveCollector(status, front_stats, companions, gpu)
        r.register(self.live)
        # Pre-create label sets that dashboards alert on, so they read 0 instead of absent.
        for reason in ("overload", "not_ready", "draining", "queue_timeout"):
            self.shed.labels(reason)
        for outcome in ("ok", "refused", "failed"):
            self.reloads.labels(outcome)
        for reason in ("client_disconnect", "slow_reader", "stall", "upstream_error"):
            self.cancelled.labels(reason)
        for reason in ("queue_full", "shutdown", "write_failed"):
            self.audit_unwritten.labels(reason)

    def set_backend(self, text: str | None) -> None:
        if text is None:
            self.live.backend_up, self.live.backend_families = 0.0, []
            return
        try:
            self.live.backend_families = parse_backend(text)
            self.live.backend_up = 1.0
        except Exception as err:
            log.warning("could not parse the child's /metrics page: %s", err)
            self.live.backend_up, self.live.backend_families = 0.0, []

    def render(self) -> bytes:
        return generate_latest(self.registry)


