"""What the HTTP front costs: direct vs through mtpwrap, in one run.

Two upstreams:
- synthetic: a tiny uvicorn app that emits SSE chunks at a fixed rate, so any difference in
  inter-token latency between direct and proxied is the front's own cost;
- real: llama-server (CPU build) with the demo model.

Each upstream is reached four ways: directly, through nginx (proxy_buffering off, keep-alive
upstream), through HAProxy 2.6 (`option http-no-delay`) and through mtpwrap's front; nginx and
HAProxy are started by this script with configurations it writes (loopback only) and skipped,
saying so, when not installed. Rounds are interleaved (every path once per round, rotating order)
and medians with their spread are printed.

For each upstream and concurrency (1, 8, 32) it measures, on every path, time to first token
(request sent → first `data:` event), inter-token latency p50/p99 (gaps between consecutive
`data:` events of one stream, pooled over streams) and aggregate tokens/s (events with content /
wall time). The front and each upstream run in their own processes; the load generator is an
asyncio httpx client in this process.

    python benchmarks/proxy_overhead.py [--skip-real] [--skip-synthetic] [--rounds N (5)]
                                        [--levels 1,8,32] [--real-threads N]
                                        [--upstream unix|tcp] [--json OUT]

`--upstream unix` (the default, as `mtpwrap up` runs llama-server) puts each upstream on a UNIX
socket in a 0700 directory; every path reaches that same socket: the direct client and the
front through mtpwrap's upstream client, nginx with `server unix:PATH`, HAProxy with
`server s1 unix@PATH`. `--upstream tcp` puts them on a loopback port instead.

`--audit` adds a fifth path, `audited`: a second mtpwrap front with a named key that has budgets
(high enough never to refuse) and the audit trail written to a file, beside the plain front
(keys and the trail off), so their tokens/s stand side by side in one run.

The llama-server binary and model come from MTPWRAP_BINARY / MTPWRAP_DEMO_MODEL, else from
mtpwrap's build and models modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mtpwrap import proc
from mtpwrap import upstream as upstream_client
from mtpwrap.proc import free_loopback_port as free_port

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
INTERNAL_KEY = "bench-internal-key-0123456789"




def wait_http(url: str, timeout: float = 120, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout} s")


def spawn(args: list[str], env: dict | None = None, log: Path | None = None) -> proc.Process:
    out = open(log, "wb") if log else proc.DEVNULL  # noqa: SIM115
    return proc.start(args, env={**os.environ, **(env or {})}, stdout=out, stderr=proc.STDOUT)


def stop(p: proc.Process | None) -> None:
    if p is not None:
        p.stop(10)


# ------------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Target:
    """Where an upstream listens: a UNIX socket, or a loopback port."""

    socket: str | None = None
    port: int | None = None

    @property
    def base_url(self) -> str:
        return "http://localhost" if self.socket else f"http://127.0.0.1:{self.port}"

    @property
    def nginx(self) -> str:
        return f"unix:{self.socket}" if self.socket else f"127.0.0.1:{self.port}"

    @property
    def haproxy(self) -> str:
        return f"unix@{self.socket}" if self.socket else f"127.0.0.1:{self.port}"

    @property
    def arg(self) -> str:
        return f"unix:{self.socket}" if self.socket else str(self.port)

    @classmethod
    def parse(cls, text: str) -> Target:
        return cls(socket=text[5:]) if text.startswith("unix:") else cls(port=int(text))


def new_target(kind: str, work: Path, name: str) -> Target:
    if kind == "tcp":
        return Target(port=free_port())
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Target(socket=str(work / f"{name}.sock"))


def wait_target(t: Target, path: str, timeout: float = 60, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    with upstream_client.client(t.socket, base_url=t.base_url, timeout=1) as c:
        while time.monotonic() < deadline:
            try:
                if c.get(path, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{t.base_url}{path} ({t.socket or t.port}) did not answer 200 in time")


def synthetic_main(where: Target, interval: float) -> None:
    """The synthetic upstream: OpenAI-style chat chunks every `interval` seconds."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens", 64))

        async def events():
            for i in range(n):
                chunk = {"id": "chatcmpl-synthetic", "object": "chat.completion.chunk",
                         "created": 0, "model": "synthetic",
                         "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                      "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(interval)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_r: Request):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", health)])
    if where.socket:
        uvicorn.run(app, uds=where.socket, log_level="warning", access_log=False)
    else:
        uvicorn.run(app, host="127.0.0.1", port=where.port or 0, log_level="warning",
                    access_log=False)


class StaticSupervisor:
    """A child that is always ready at one address (the contract's Supervisor methods)."""

    def __init__(self, where: Target, api_key: str) -> None:
        from mtpwrap.supervision.state import Upstream

        self.up = Upstream(where.base_url, api_key, 1, where.socket)
        self.t0 = time.time()

    def status(self):
        from mtpwrap.supervision.state import State, SupervisorStatus

        return SupervisorStatus(state=State.READY, reason=None, restarts=0, started_at=self.t0,
                                child_started_at=self.t0, ready_since=self.t0, last_exit=None,
                                pid=None, upstream=self.up)

    async def wait_ready(self, timeout: float):
        return self.up

    def report_stall(self, generation: int, reason: str) -> None:
        print(f"stall reported: {reason}", file=sys.stderr)

    def add_listener(self, cb) -> None:
        pass


AUDIT_KEY = "bench-client-key-0123456789"


def front_main(upstream: Target, port: int, concurrency: int, audit_dir: str = "") -> None:
    """mtpwrap's front over a fixed upstream, served like `mtpwrap up` serves it; with
    `audit_dir`, behind a named key with budgets and with the audit trail in that directory."""
    import uvicorn

    sys.path.insert(0, str(REPO))
    from mtpwrap.config.objects import AuditConfig, ProxyConfig
    from mtpwrap.front import loop as event_loop
    from mtpwrap.front.app import Front
    from mtpwrap.front.info import ServeInfo

    keys = ((f"{AUDIT_KEY} name=bench rpm=100000000 tokens_per_hour=100000000000 "
             "tokens_per_day=100000000000",) if audit_dir else ())
    cfg = ProxyConfig(max_concurrency=concurrency, queue_size=concurrency * 2, api_keys=keys)
    audit = AuditConfig(sink="file", dir=audit_dir) if audit_dir else None
    front = Front(StaticSupervisor(upstream, INTERNAL_KEY), cfg, ServeInfo(profile="bench"),
                  audit)
    kw = {}
    if os.environ.get("BENCH_UVICORN_HTTP"):
        kw["http"] = os.environ["BENCH_UVICORN_HTTP"]
    server = uvicorn.Server(front.server_config(host="127.0.0.1", port=port, **kw))
    event_loop.run(server.serve(), kind=os.environ.get("BENCH_EVENT_LOOP", "auto"))


# ------------------------------------------------------------------------------- load


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    ok: int = 0

    def err(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, res: Result,
                     headers: dict) -> str:
    """Run one streamed chat request; return its outcome class."""
    t0 = time.perf_counter()
    last = None
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                res.err(f"http_{r.status_code}")
                return f"http_{r.status_code}"
            buf = b""
            async for chunk in r.aiter_raw():
                now = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        continue
                    if data.startswith(b'{"error"'):
                        res.err("error_event")
                        return "error_event"
                    if b'"content"' not in data:
                        continue
                    if last is None:
                        res.ttft.append(now - t0)
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.tokens += 1
    except httpx.HTTPError as e:
        res.err(type(e).__name__)
        return type(e).__name__
    if not done:
        res.err("no_done_unexplained")
        return "no_done_unexplained"
    res.ok += 1
    return "ok"


async def run_load(url: str, concurrency: int, per_worker: int, body: dict,
                   headers: dict | None = None, socket: str | None = None) -> Result:
    """`concurrency` workers each sending `per_worker` streams to `url` (over the UNIX socket
    `socket`, when given, through mtpwrap's upstream client)."""
    res = Result()
    async with upstream_client.async_client(socket, timeout=httpx.Timeout(300, connect=10),
                                            max_connections=concurrency + 4) as client:
        async def worker() -> None:
            for _ in range(per_worker):
                await one_stream(client, url, body, res, headers or {})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.wall = time.perf_counter() - t0
    return res


def summary(res: Result) -> dict:
    return {
        "ttft_p50_ms": pct(res.ttft, 50) * 1e3, "ttft_p99_ms": pct(res.ttft, 99) * 1e3,
        "itl_p50_ms": pct(res.itl, 50) * 1e3, "itl_p95_ms": pct(res.itl, 95) * 1e3,
        "itl_p99_ms": pct(res.itl, 99) * 1e3,
        "itl_mean_ms": (statistics.fmean(res.itl) * 1e3) if res.itl else float("nan"),
        "ttft_p95_ms": pct(res.ttft, 95) * 1e3,
        "tokens_per_s": res.tokens / res.wall if res.wall else 0.0,
        "tokens": res.tokens, "ok": res.ok, "errors": res.errors, "wall_s": res.wall,
    }


DIRECT_HEADERS = {"authorization": f"Bearer {INTERNAL_KEY}"}

#: The ways a client reaches the same upstream: straight, through the two proxies operators
#: compare with, and through mtpwrap's front. nginx and HAProxy forward the client's
#: Authorization header as it is, so they get the internal key like the direct path.
PATHS = ("direct", "nginx", "haproxy", "mtpwrap", "audited")


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compare(name: str, urls: dict[str, tuple[str, str | None]], levels: list[int], per_worker,
            body: dict, rounds: int) -> list[dict]:
    """Interleaved rounds: each round runs every path once, in an order that rotates, so a
    noisy moment of a shared machine does not land on one path only."""
    rows = []
    paths = [p for p in PATHS if p in urls]
    print(f"\n== {name}: {', '.join(paths)}; {rounds} interleaved rounds, medians (min-max) ==")
    print(f"{'conc':>4} {'path':>8} {'tok/s':>18} {'vs direct':>9} {'vs nginx':>9} "
          f"{'TTFT p50':>9} {'ITL p50':>9} {'ITL p99':>9} errors")
    for c in levels:
        n = per_worker(c)
        for p in paths:  # warm connections and the prompt cache
            asyncio.run(run_load(urls[p][0], min(c, 4), 1, body, _headers(p), urls[p][1]))
        runs: dict[str, list[dict]] = {p: [] for p in paths}
        for r in range(rounds):
            for p in rotated(paths, r):
                runs[p].append(summary(asyncio.run(
                    run_load(urls[p][0], c, n, body, _headers(p), urls[p][1]))))
        med = {p: {k: _med([x[k] for x in runs[p]]) for k in
                   ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")} for p in paths}
        for p in paths:
            tps = [x["tokens_per_s"] for x in runs[p]]
            errors: dict[str, int] = {}
            for x in runs[p]:
                for k, v in x["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            vs_d = med[p]["tokens_per_s"] / med["direct"]["tokens_per_s"] * 100
            vs_n = (med[p]["tokens_per_s"] / med["nginx"]["tokens_per_s"] * 100
                    if "nginx" in med else float("nan"))
            print(f"{c:>4} {p:>8} {med[p]['tokens_per_s']:7.1f} ({min(tps):6.1f}-{max(tps):6.1f})"
                  f" {vs_d:8.1f}% {vs_n:8.1f}% {med[p]['ttft_p50_ms']:8.2f}ms "
                  f"{med[p]['itl_p50_ms']:8.3f}ms {med[p]['itl_p99_ms']:8.3f}ms {errors or ''}")
        added = med["mtpwrap"]["itl_p99_ms"] - med["nginx" if "nginx" in med else "direct"][
            "itl_p99_ms"]
        print(f"{c:>4} mtpwrap adds {added:+.3f} ms to the p99 inter-chunk gap of "
              f"{'nginx' if 'nginx' in med else 'direct'}")
        if "audited" in med:
            share = med["audited"]["tokens_per_s"] / med["mtpwrap"]["tokens_per_s"] * 100
            print(f"{c:>4} with the audit trail and budgets on, mtpwrap keeps {share:.1f} % of "
                  "its tokens/s with them off")
        rows.append({"upstream": name, "concurrency": c, "rounds": runs, "median": med})
    return rows


def _headers(path: str) -> dict:
    """The front holds the internal key itself. The direct client asks for the close after
    each stream, as the front does: llama-server ends the connection after a stream without
    saying so, and a request sent on it in that moment fails. nginx and HAProxy keep their
    upstream connections as configured, and meet that race as a 502 or a cut answer."""
    if path == "mtpwrap":
        return {}
    if path == "audited":
        return {"authorization": f"Bearer {AUDIT_KEY}"}
    return {**DIRECT_HEADERS, "connection": "close"} if path == "direct" else DIRECT_HEADERS


# ------------------------------------------------------------------------------- peers


def _peer(name: str, package: str, work: Path) -> str | None:
    """The peer's executable (PATH, else /usr/sbin), or None after saying how to install it."""
    import shutil

    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin")
    if exe is None:
        print(f"{name}: not installed (apt-get install {package}); its rows are skipped")
        return None
    work.mkdir(parents=True, exist_ok=True)
    return exe


def start_nginx(upstream: Target, work: Path) -> tuple[proc.Process, str] | None:
    """nginx as operators configure it for streaming: keep-alive upstream, no buffering."""
    exe = _peer("nginx", "nginx-light", work)
    if exe is None:
        return None
    port = free_port()
    conf = work / "nginx.conf"
    # nginx started by root runs its worker as `nobody`, which the socket's 0700 directory
    # keeps out (as it should): the worker runs as this user, like the front
    import pwd

    user = f"user {pwd.getpwuid(os.getuid()).pw_name};\n" if os.getuid() == 0 else ""
    conf.write_text(f"""daemon off;
{user}worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {work}/body;
  proxy_temp_path {work}/proxy;
  fastcgi_temp_path {work}/fastcgi;
  uwsgi_temp_path {work}/uwsgi;
  scgi_temp_path {work}/scgi;
  upstream up {{ server {upstream.nginx}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
""")
    p = spawn([exe, "-c", str(conf), "-p", str(work)])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, headers=DIRECT_HEADERS)
    except BaseException:
        stop(p)  # not yet in the caller's list: stopped here
        raise
    return p, f"http://127.0.0.1:{port}"


def start_haproxy(upstream: Target, work: Path) -> tuple[proc.Process, str] | None:
    """HAProxy 2.6 with `option http-no-delay`, without which SSE chunks arrive bunched."""
    exe = _peer("haproxy", "haproxy", work)
    if exe is None:
        return None
    port = free_port()
    conf = work / "haproxy.cfg"
    conf.write_text(f"""global
  maxconn 4096
defaults
  mode http
  option http-no-delay
  timeout connect 5s
  timeout client 600s
  timeout server 600s
frontend f
  bind 127.0.0.1:{port}
  default_backend b
backend b
  server s1 {upstream.haproxy} maxconn 1024
""")
    p = spawn([exe, "-db", "-f", str(conf)])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, headers=DIRECT_HEADERS)
    except BaseException:
        stop(p)  # not yet in the caller's list: stopped here
        raise
    return p, f"http://127.0.0.1:{port}"


def start_paths(upstream: Target, concurrency: int, work: Path, procs: list,
                pids: dict[str, int] | None = None,
                audit: bool = False) -> dict[str, tuple[str, str | None]]:
    """Each path's base URL and the socket it is reached on (None: its URL's port); the
    processes started go to `procs`, and each proxy's pid to `pids` when given."""
    urls: dict[str, tuple[str, str | None]] = {"direct": (upstream.base_url, upstream.socket)}
    for name, starter in (("nginx", start_nginx), ("haproxy", start_haproxy)):
        started = starter(upstream, work / name)
        if started is not None:
            procs.append(started[0])
            urls[name] = (started[1], None)
            if pids is not None:
                pids[name] = started[0].pid
    front, furl = start_front(upstream, concurrency)
    procs.append(front)
    urls["mtpwrap"] = (furl, None)
    if pids is not None:
        pids["mtpwrap"] = front.pid
    if audit:
        audited, aurl = start_front(upstream, concurrency, audit_dir=work / "audit")
        procs.append(audited)
        urls["audited"] = (aurl, None)
        if pids is not None:
            pids["audited"] = audited.pid
    return urls


def rotated(paths: list[str], round_: int) -> list[str]:
    """The order of round `round_`: every path once, starting one further each round."""
    k = round_ % len(paths)
    return paths[k:] + paths[:k]


def llama_paths() -> tuple[Path, Path]:
    from mtpwrap.models import known as models

    binary = os.environ.get("MTPWRAP_BINARY")
    if not binary:
        from mtpwrap.build import builder

        binary = str(builder.ensure_built(variant="cpu").binary("llama-server"))
    return Path(binary), models.ensure_demo_model()  # it honours MTPWRAP_DEMO_MODEL


def start_llama(where: Target, slots: int, ctx_per_slot: int = 1024,
                extra: list[str] | None = None, threads: int | None = None) -> proc.Process:
    from mtpwrap.build.probe import probe
    from mtpwrap.decide import launch
    from mtpwrap.decide.endpoint import Endpoint

    binary, model = llama_paths()
    env = {"LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cfg = launch.plain(model, context=slots * ctx_per_slot, slots=slots, threads=threads,
                       why="benchmark upstream")
    spec = launch.render(cfg, probe(binary), binary=binary, api_key=INTERNAL_KEY,
                         endpoint=Endpoint(socket=where.socket, port=where.port),
                         extra=extra or [])
    srv = proc.start_server(spec.argv, base_url=where.base_url, socket=where.socket,
                            env={**env, **spec.env}, timeout=180)
    return srv.process


def start_front(upstream: Target, concurrency: int, env: dict | None = None,
                audit_dir: Path | None = None) -> tuple[proc.Process, str]:
    port = free_port()
    p = spawn([PY, __file__, "_front", upstream.arg, str(port), str(concurrency),
               str(audit_dir or "")], env=env)
    wait_http(f"http://127.0.0.1:{port}/livez", 30)
    return p, f"http://127.0.0.1:{port}"


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--real-levels", default=None, help="concurrency levels for the real server "
                    "(default: --levels)")
    ap.add_argument("--real-tokens", type=int, default=64)
    ap.add_argument("--real-threads", type=int, default=0,
                    help="llama-server's threads (default 0: its own choice, every core; 1 "
                         "leaves a core to the client and the proxy, as a GPU build would)")
    ap.add_argument("--real-streams", type=int, default=8,
                    help="real upstream: streams per path and round at c=1 (at least 2 per "
                         "worker up to c=8, 1 above)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per level")
    ap.add_argument("--interval-ms", type=float, default=10.0,
                    help="synthetic upstream: time between chunks")
    ap.add_argument("--upstream", choices=("unix", "tcp"), default="unix",
                    help="where the upstreams listen (default: a UNIX socket, as `up` runs it)")
    ap.add_argument("--streams", type=int, default=24,
                    help="synthetic upstream: streams per path and round at c=1 (at least 2 "
                         "per worker at higher concurrency)")
    ap.add_argument("--audit", action="store_true",
                    help="add a front with the audit trail and budgets on (path `audited`)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    rows: list[dict] = []
    procs: list[proc.Process] = []
    work = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    # A SIGTERM (from `timeout`, say) still stops every process this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if not args.skip_synthetic:
            st = new_target(args.upstream, work / "sockets", "synthetic")
            procs.append(spawn([PY, __file__, "_synthetic", st.arg,
                                str(args.interval_ms / 1000)]))
            wait_target(st, "/health", 30)
            urls = start_paths(st, max(levels), work / "synthetic", procs, audit=args.audit)
            body = {"model": "x", "stream": True, "max_tokens": 100,
                    "messages": [{"role": "user", "content": "hi"}]}
            rows += compare(f"synthetic ({args.interval_ms:g} ms/chunk)",
                            {k: (v[0] + "/v1/chat/completions", v[1]) for k, v in urls.items()},
                            levels,
                            lambda c: max(2, args.streams // c), body, args.rounds)
        if not args.skip_real:
            rlevels = [int(x) for x in (args.real_levels or args.levels).split(",")]
            lt = new_target(args.upstream, work / "sockets", "llama")
            procs.append(start_llama(lt, max(rlevels), threads=args.real_threads or None))
            urls = start_paths(lt, max(rlevels), work / "real", procs, audit=args.audit)
            body = {"model": "x", "stream": True, "max_tokens": args.real_tokens,
                    "temperature": 0,
                    "seed": 1, "messages": [{"role": "user",
                                             "content": "Write a short story about a lighthouse."}]}
            threads = f"{args.real_threads} thread(s)" if args.real_threads else "its threads"
            rows += compare(f"llama-server (demo model, CPU, {threads})",
                            {k: (v[0] + "/v1/chat/completions", v[1]) for k, v in urls.items()},
                            rlevels,
                            lambda c: max(2 if c <= 8 else 1, args.real_streams // c), body,
                            args.rounds)
    finally:
        for p in reversed(procs):
            stop(p)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_synthetic":
        synthetic_main(Target.parse(sys.argv[2]), float(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_front":
        front_main(Target.parse(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                   sys.argv[5] if len(sys.argv) > 5 else "")
    else:
        main()
