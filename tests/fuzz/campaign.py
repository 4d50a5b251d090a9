"""The front's fuzz campaign: `make fuzz` (the whole of it) and the CI smoke (90 s, fixed seed).

One `mtpwrap up` with the demo profile, API keys and the real llama-server; then, in phases:

1. seeds — every file of tests/fuzz/seeds/ (llama.cpp's reported crashes, Python's own traps,
   and every failure an earlier campaign found), each with the answer it must get;
2. bodies — hypothesis-generated request bodies (tests/fuzz/cases.py) on 13 routes, each answer
   judged by tests/fuzz/oracle.py;
3. schema — schemathesis requests from OpenAI's and Anthropic's own OpenAPI documents
   (tests/fuzz/schema.py), valid and invalid, judged by the same oracle;
4. raw — mutated HTTP/1.1 requests over a socket, judged by two parsers (tests/fuzz/raw.py);
5. faults — stateful scenarios through a fault-injecting relay between a front and a second
   real llama-server (tests/fuzz/faults.py): no 5xx but 502/504, those only under a fault,
   every stream ended, the front recovered after each; then an operator's faults on a `mtpwrap
   up` of their own (tests/fuzz/operator.py): parallel streams closed early on keys with token
   budgets, a hung NVML, a reload and a restart while streams run.

After each phase: the front must be ready, its open file descriptors back to where they stood
after the warm-up (± 2), its RSS grown by at most 16 MiB, llama-server generating nothing for
anyone. At the end the log must hold no traceback. Failures are grouped by class; the smallest
body of each class is shrunk further (keys dropped, values simplified, while the class stays)
and, with `--save-found`, written to tests/fuzz/seeds/ as a new seed.

Usage: python -m tests.fuzz.campaign [--seconds S] [--bodies N] [--schema N] [--raw N] [--faults N]
           [--seed N] [--out DIR] [--save-found]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz import cases, faults, operator, oracle, raw, schema, seeds
from tests.helpers import wait_for

KEY = "fuzz-key-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]
PROFILE = """\
description: the demo profile for the fuzz campaign (8 tokens unless a request asks)
hardware:
  requires_gpu: false
model: SmolLM2-135M-Instruct.Q4_1.gguf
context: 4096
kv:
  k: [f16]
  v: [f16]
spec:
  kind: none
gpu_layers: 0
slots: 2
flash_attn: auto
extra_args: ["--n-predict", "8"]
"""


def profile(threads: int | None = None) -> str:
    """The campaign's profile, with llama-server's `threads` if not the default."""
    return PROFILE + (f"threads: {threads}\n" if threads else "")


CONFIG = """\
proxy:
  max_predict: 64
  header_timeout_s: 2
  idle_timeout_s: 3
  queue_timeout_s: 120
  max_connections: 512
"""


@dataclass
class Failure:
    klass: str
    count: int = 0
    smallest: dict[str, Any] | None = None
    size: int = 1 << 62


@dataclass
class Phase_:
    name: str
    tried: int = 0
    seconds: float = 0.0
    failures: dict[str, Failure] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)
    slowest: list[tuple[float, str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def timed(self, seconds: float, route: str, what: str) -> None:
        with self._lock:  # the senders' threads
            self.slowest.append((round(seconds, 2), route, what))
            self.slowest.sort(reverse=True)
            del self.slowest[5:]

    def fail(self, klass: str, seed: dict[str, Any], size: int) -> None:
        f = self.failures.setdefault(klass, Failure(klass))
        f.count += 1
        if size < f.size:
            f.smallest, f.size = seed, size

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class Target:
    """The instance under test: `mtpwrap up` in a process of its own (`threads`: llama-server's,
    if not the default)."""

    def __init__(self, work: Path, threads: int | None = None) -> None:
        from mtpwrap.build.manifest import load_manifest
        from mtpwrap.models import known
        from mtpwrap.proc import free_loopback_port
        from tests.helpers import Instance

        work.mkdir(parents=True, exist_ok=True)
        (work / "fuzz.yaml").write_text(profile(threads))
        (work / "mtpwrap.yaml").write_text(CONFIG)
        self.binary = binary = Path(os.environ.get("MTPWRAP_BINARY")
                                    or load_manifest().binary("llama-server"))
        self.model = known.ensure_demo_model()
        self.log = work / "up.log"
        self.inst = Instance(work / "home", free_loopback_port(), binary,
                             self.model, log=self.log,
                             profile=str(work / "fuzz.yaml"), MTPWRAP_API_KEYS=KEY,
                             MTPWRAP_CONFIG=str(work / "mtpwrap.yaml"))
        self.base = self.inst.base
        self.port = self.inst.port
        self.inst.wait_ready(180)
        self.client = httpx.Client(base_url=self.base, timeout=120,
                                   headers={"authorization": f"Bearer {KEY}"})
        self.pid = self.inst.proc.pid

    def usage(self) -> tuple[int, int]:
        """The front's open fds (its idle connections to llama-server included: the pool closes
        them within its expiry) and its RSS."""
        p = psutil.Process(self.pid)
        return p.num_fds(), p.memory_info().rss

    def upstream(self) -> int:
        """The front's connections to llama-server (UNIX sockets) open now."""
        return len(psutil.Process(self.pid).net_connections(kind="unix"))

    def close(self) -> str:
        self.client.close()
        self.inst.proc.terminate()
        with contextlib.suppress(Exception):
            self.inst.proc.wait(60)
        self.inst.close()
        return self.log.read_text(errors="replace")


def _send(t: Target, route: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    r = t.client.post(route, content=body, headers={"content-type": "application/json"})
    return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content


def _verdict(t: Target, route: str, body: bytes) -> str | None:
    try:
        status, headers, content = _send(t, route, body)
    except httpx.HTTPError as err:
        return f"no answer on {route}: {type(err).__name__}"
    return oracle.verdict(route, status, headers, content)


# --------------------------------------------------------------------------- shrinking

def _smaller(doc: Any) -> Iterator[Any]:
    """Simpler variants of a JSON value, simplest first: one change each."""
    if isinstance(doc, dict):
        for k in list(doc):
            yield {kk: v for kk, v in doc.items() if kk != k}
        for k, v in doc.items():
            for s in _smaller(v):
                yield {**doc, k: s}
    elif isinstance(doc, list):
        for i in range(len(doc)):
            yield doc[:i] + doc[i + 1:]
        for i, v in enumerate(doc):
            for s in _smaller(v):
                yield doc[:i] + [s] + doc[i + 1:]
    elif isinstance(doc, str) and doc:
        yield ""
        if len(doc) > 1:
            yield doc[: len(doc) // 2]
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool) and doc not in (0, 1):
        yield 0
        yield 1
    elif doc is not None and not isinstance(doc, bool):
        yield None


def shrink(route: str, doc: Any, klass: str, still: Callable[[Any], bool],
           budget: int = 150) -> Any:
    """Greedy: take the first simpler variant that keeps the class, until none does or the
    request budget is spent."""
    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for cand in _smaller(doc):
            tries += 1
            if still(cand):
                doc, improved = cand, True
                break
            if tries >= budget:
                break
    return doc


# --------------------------------------------------------------------------- phases

def phase_seeds(t: Target) -> Phase_:
    ph = Phase_("seeds")
    t0 = time.monotonic()
    for s in seeds.load():
        ph.tried += 1
        status, headers, content = _send(t, s.route, s.body)
        bad = oracle.verdict(s.route, status, headers, content)
        want = {"4xx": range(400, 500), "2xx": range(200, 300), "any": range(100, 600)}[
            s.expect]
        if bad is None and status not in want:
            bad = f"seed {s.name}: {status}, expected {s.expect}"
        if bad is None and s.needle and s.needle not in content.decode("utf-8", "replace"):
            bad = f"seed {s.name}: the message lacks {s.needle!r}"
        ph.count(str(status))
        if bad is not None:
            ph.fail(bad, {"seed": s.name}, 0)
        if not t.inst.ready():
            ph.fail(f"seed {s.name} left the front or llama-server not ready", {"seed": s.name},
                    0)
            t.inst.wait_ready(120)
    ph.seconds = time.monotonic() - t0
    return ph


#: cases drawn per hypothesis run, then sent at once by WORKERS threads (most are refused at the
#: front in milliseconds; the rest queue for llama-server's slots)
BATCH = 50
WORKERS = 8


def _draw(strategy: Any, n: int, seed: int) -> list[Any]:
    """`n` examples of a strategy, reproducibly from `seed`."""
    out: list[Any] = []

    def keep(x: Any) -> None:
        out.append(x)

    run = given(x=strategy)(keep)
    run = settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                   suppress_health_check=list(HealthCheck))(run)
    hypothesis_seed(seed)(run)()
    return out


def _judged(t: Target, ph: Phase_, batch: list[Any], what: Callable[[Any], str]
            ) -> list[tuple[Any, str | None]]:
    """Each request of `batch` (with .route and .body) sent, WORKERS at a time, and judged."""
    def one(req: Any) -> tuple[Any, str | None]:
        c0 = time.monotonic()
        bad = _verdict(t, req.route, req.body)
        ph.timed(time.monotonic() - c0, req.route, what(req))
        return req, bad

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(one, batch))


def phase_bodies(t: Target, n: int, seconds: float, seed: int) -> Phase_:
    ph = Phase_("bodies")
    t0 = time.monotonic()
    batch_no = 0
    while time.monotonic() < t0 + seconds and ph.tried < n:
        batch = _draw(cases.cases(), min(BATCH, n - ph.tried), seed * 1000 + batch_no)
        batch_no += 1
        for case, bad in _judged(t, ph, batch, lambda c: f"{c.what}: "
                                 f"{c.body[:160].decode('utf-8', 'replace')}"):
            ph.tried += 1
            ph.count(case.route)
            if bad is not None:
                ph.fail(bad, case.as_seed(), len(case.body))
    ph.seconds = time.monotonic() - t0
    for f in ph.failures.values():
        if f.smallest is None or "body" not in f.smallest:
            continue
        route = f.smallest["route"]
        klass = f.klass

        def still(doc: Any, route: str = route, klass: str = klass) -> bool:
            body = json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
            return _verdict(t, route, body) == klass
        f.smallest = {**f.smallest, "body": shrink(route, f.smallest["body"], klass, still)}
    return ph


def phase_schema(t: Target, n: int, seconds: float, seed: int) -> Phase_:
    ph = Phase_("schema")
    t0 = time.monotonic()
    batch_no = 0
    while time.monotonic() < t0 + seconds and ph.tried < n:
        batch = _draw(schema.requests(), min(BATCH, n - ph.tried), seed * 1000 + 500 + batch_no)
        batch_no += 1
        for req, bad in _judged(t, ph, batch, lambda r: f"{r.mode}: "
                                f"{r.body[:160].decode('utf-8', 'replace')}"):
            ph.tried += 1
            ph.count(f"{req.route} {req.mode}")
            if bad is not None:
                ph.fail(bad, req.as_seed(), len(req.body))
    ph.seconds = time.monotonic() - t0
    return ph


def _raw_case(t: Target, data: bytes) -> tuple[str, str | None]:
    kind, same = raw.judge(data)
    ans = raw.send_raw("127.0.0.1", t.port, data, wait_s=0.3 if kind == "incomplete" else 5.0,
                       expect=max(1, same) if kind == "agree-ok" else 1)
    return kind, raw.raw_verdict(kind, same, ans)


def phase_raw(t: Target, n: int, seconds: float, seed: int) -> Phase_:
    ph = Phase_("raw")
    rng = random.Random(seed)
    t0 = time.monotonic()
    key = KEY.encode()
    with ThreadPoolExecutor(WORKERS * 6) as pool:  # most of a raw case's time is waiting
        while ph.tried < n and time.monotonic() < t0 + seconds:
            batch = [raw.mutate(rng, rng.choice(raw.SEEDS).replace(b"{key}", key))
                     for _ in range(min(BATCH * 10, n - ph.tried))]
            results = pool.map(lambda dw: _raw_case(t, dw[0]), batch)
            for (data, what), (kind, bad) in zip(batch, results, strict=True):
                ph.tried += 1
                ph.count(kind)
                if bad is not None:
                    ph.fail(bad, {"raw_hex": data.hex(), "what": what}, len(data))
    ph.seconds = time.monotonic() - t0
    return ph


#: the share of the fault phase's time the operator's cases take (each takes 5-30 s)
OPERATOR_SHARE = 0.3


def phase_faults(binary: Path, model: Path, work: Path, n: int, seconds: float,
                 seed: int, n_operator: int = 1_000, threads: int | None = None) -> Phase_:
    ph = Phase_("faults")
    t0 = time.monotonic()
    ops, bad, kinds, log = operator.run_operator(work / "operator", binary, model, n_operator,
                                                 seed, seconds * OPERATOR_SHARE, threads)
    ph.tried += ops
    for kind, count in kinds.items():
        ph.outcomes[f"operator {kind}"] = count
    for b in bad:
        ph.fail(b.split(" [")[0], {"scenario": b}, len(b))
    if (tracebacks := log.count("Traceback (most recent call last)")):
        ph.fail(f"{tracebacks} traceback(s) in the operator instance's log", {}, 0)
    with faults.rig(binary, model, work) as r:
        relayed, bad = faults.run_scenarios(
            r, n, seed, max(10.0, seconds - (time.monotonic() - t0)))
        ph.tried += relayed
        ph.outcomes["relay scenarios"] = relayed
        for b in bad:
            ph.fail(b.split(" [")[0], {"scenario": b}, len(b))
        busy, held = r.settled(0)
        relay = r.relay
    ph.leaks = {"llama_server_processing": busy, "upstream_connections": held,
                "left_after_the_front": relay.open, "ready": not busy}
    if relay.open:
        ph.fail(f"{relay.open} upstream connection(s) left open after the front stopped", {}, 0)
    ph.seconds = time.monotonic() - t0
    return ph


# --------------------------------------------------------------------------- the run

def check_leaks(t: Target, ph: Phase_, start: tuple[int, int]) -> None:
    # Connections the clients left open close within the idle timeout (3 s), the pooled ones
    # to llama-server within their expiry (2 s): wait for it. httpx drops an expired idle
    # connection only when its pool is used again, so each look first has the front scrape
    # llama-server's /metrics through that pool (a run failed on 3 such idle fds).
    def back() -> bool:
        t.inst.processing(KEY)
        return t.usage()[0] <= start[0] + 2

    with contextlib.suppress(TimeoutError):
        wait_for("fds back", back, 15, every=0.5)
    fds, rss = t.usage()
    busy = t.inst.processing(KEY)
    ph.leaks = {"fds": [start[0], fds], "rss_mib": [round(start[1] / 2**20, 1),
                                                    round(rss / 2**20, 1)],
                "upstream_connections": t.upstream(), "llama_server_processing": busy,
                "ready": t.inst.ready()}
    if fds > start[0] + 2:
        ph.fail(f"{fds - start[0]} file descriptors more than after the warm-up", {}, 0)
    if rss > start[1] + 16 * 2**20:
        ph.fail(f"RSS grew by {(rss - start[1]) / 2**20:.0f} MiB", {}, 0)
    if busy:
        ph.fail(f"llama-server still processing {busy:g} request(s)", {}, 0)
    if not ph.leaks["ready"]:
        ph.fail("not ready at the end of the phase", {}, 0)


def run(out: Path, seconds: float, n_bodies: int, n_schema: int, n_raw: int, n_faults: int,
        seed: int, save_found: bool = False, threads: int | None = None) -> dict[str, Any]:
    """The phases in `seconds`, each to a deadline from the start: bodies to 34 % of it, schema
    to 36 %, raw to 58 %, faults the rest; shrinking a phase's failures comes out of the next
    one's time. At this machine's rates (bodies 70-84/s, raw 55/s, faults 0.8-1.1/s) 20,000
    bodies, 10,000 raw cases and 300 fault scenarios just fit 840 s:
    docs/measurements/2026-12-02-fuzz-campaign.md. `threads`: the instances' llama-servers'
    (the CI smoke's is 1: two on two busy cores make a token take seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    t = Target(out / "instance", threads)
    started = time.monotonic()
    phases: list[Phase_] = []
    try:
        for body in (b'{"prompt": "Hi", "n_predict": 2}', b'{"content": "Hi"}'):
            _send(t, "/completion", body)
        _send(t, "/tokenize", b'{"content": "Hi"}')
        start = t.usage()
        ph = phase_seeds(t)
        check_leaks(t, ph, start)
        phases.append(ph)
        ph = phase_bodies(t, n_bodies, seconds * 0.34, seed)
        check_leaks(t, ph, start)
        phases.append(ph)
        ph = phase_schema(t, n_schema, max(5.0, seconds * 0.36 - (time.monotonic() - started)),
                          seed)
        check_leaks(t, ph, start)
        phases.append(ph)
        ph = phase_raw(t, n_raw, max(5.0, seconds * 0.58 - (time.monotonic() - started)), seed)
        check_leaks(t, ph, start)
        phases.append(ph)
    finally:
        log = t.close()
    phases.append(phase_faults(t.binary, t.model, out / "faults", n_faults,
                               max(10.0, seconds - (time.monotonic() - started)), seed,
                               threads=threads))
    tracebacks = log.count("Traceback (most recent call last)")
    report = {
        "seed": seed, "seconds_budget": seconds, "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "load": os.getloadavg(),
        "phases": [{"name": p.name, "tried": p.tried, "seconds": round(p.seconds, 1),
                    "per_second": round(p.tried / p.seconds, 1) if p.seconds else 0,
                    "outcomes": p.outcomes, "leaks": p.leaks, "slowest": p.slowest,
                    "failures": [{"class": f.klass, "count": f.count, "smallest": f.smallest}
                                 for f in sorted(p.failures.values(), key=lambda f: -f.count)]}
                   for p in phases],
        "tracebacks_in_log": tracebacks,
    }
    if save_found:
        found = []
        for p in phases:
            if p.name not in ("bodies", "schema"):
                continue
            for f in p.failures.values():
                if f.smallest and "route" in f.smallest:
                    found.append(str(seeds.save_found(seeds.SEEDS, f.klass, f.smallest)))
        report["saved_seeds"] = found
    (out / "fuzz-report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return report


def failures(report: dict[str, Any]) -> list[str]:
    out = [f"{p['name']}: {f['class']} (×{f['count']})" for p in report["phases"]
           for f in p["failures"]]
    if report["tracebacks_in_log"]:
        out.append(f"{report['tracebacks_in_log']} traceback(s) in the log")
    return out


def describe(report: dict[str, Any]) -> str:
    lines = [f"fuzz campaign, seed {report['seed']}, {report['cores']} cores "
             f"({report['cpu']}), load {', '.join(f'{x:.2f}' for x in report['load'])}",
             f"{'phase':<8} {'cases':>7} {'s':>7} {'cases/s':>8} {'failures':>9}  leaks"]
    for p in report["phases"]:
        lk = p["leaks"]
        lines.append(f"{p['name']:<8} {p['tried']:>7} {p['seconds']:>7.1f} "
                     f"{p['per_second']:>8.1f} {sum(f['count'] for f in p['failures']):>9}  "
                     + ", ".join(f"{k} {v}" for k, v in lk.items()))
        for f in p["failures"]:
            lines.append(f"    {f['count']:>6} × {f['class']}")
            if f["smallest"]:
                example = json.dumps(f["smallest"], ensure_ascii=False)[:200]
                lines.append(f"           e.g. {example}")
    lines.append(f"tracebacks in the log: {report['tracebacks_in_log']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.campaign", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=840, help="time for the phases")
    ap.add_argument("--bodies", type=int, default=20_000, help="body cases at most")
    ap.add_argument("--schema", type=int, default=5_000, help="schemathesis cases at most")
    ap.add_argument("--raw", type=int, default=10_000, help="raw HTTP cases at most")
    ap.add_argument("--faults", type=int, default=1_000, help="fault scenarios at most")
    ap.add_argument("--seed", type=int, default=None, help="default: random, and logged")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--save-found", action="store_true",
                    help="write each new failure class's shrunk body to tests/fuzz/seeds/")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    out = a.out or REPO / "build" / f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"fuzz campaign: seed {seed}, results in {out}", flush=True)
    report = run(out, a.seconds, a.bodies, a.schema, a.raw, a.faults, seed, a.save_found)
    print(describe(report))
    bad = failures(report)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
