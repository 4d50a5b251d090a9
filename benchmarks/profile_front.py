"""Where the front's CPU time goes under streaming load: cProfile of the front process, and
its CPU per relayed chunk next to nginx's and HAProxy's on the same upstream.

The front runs as `mtpwrap up` serves it (benchmarks/proxy_overhead.py `_front`, uvicorn with
the front's own connection layer) over the synthetic SSE upstream, under cProfile; this process
sends streamed chat requests at each concurrency, stops the front with SIGINT (a clean uvicorn
exit, so cProfile writes its file) and prints the functions with the most own time and the
front's CPU time per relayed chunk.

`--cpu-only`: no cProfile; the front, nginx and HAProxy (as proxy_overhead.py configures them,
each skipped when not installed) relay the same load in turn, `--rounds` times interleaved, and
each one's CPU time per relayed chunk (user + system of all its processes, from psutil) is
printed side by side: on this machine a wake-up from idle alone costs tens of µs of CPU, so the
proxies written in C say what the kernel and the machine take, and the front's excess over them
is its own.

    python benchmarks/profile_front.py [--levels 8,32] [--requests 96] [--top 25]
                                       [--tokens 100] [--cpu-only [--rounds 3]
                                        [--loops asyncio] [--per chunk|stream]]
                                       [--upstream unix|tcp]

BENCH_UVICORN_HTTP=h11 and BENCH_EVENT_LOOP=uvloop|asyncio measure the alternatives.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po


def profile_level(upstream: po.Target, concurrency: int, requests: int, top: int,
                  interval_ms: float, tokens: int = 100) -> None:
    out = Path(tempfile.mkdtemp(prefix="front-profile-")) / f"c{concurrency}.prof"
    port = po.free_port()
    prof = ["-m", "cProfile", "-o", str(out)]
    front = po.spawn([po.PY, *prof, po.__file__, "_front", upstream.arg, str(port),
                      str(concurrency)])
    url = f"http://127.0.0.1:{port}"
    po.wait_http(url + "/livez", 60)
    body = {**_BODY, "max_tokens": tokens}
    asyncio.run(po.run_load(url + "/v1/chat/completions", min(concurrency, 4), 1, body))
    cpu0 = _cpu_seconds(front.pid)
    t0 = time.perf_counter()
    res = asyncio.run(po.run_load(url + "/v1/chat/completions", concurrency,
                                  max(1, requests // concurrency), body))
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds(front.pid) - cpu0
    os.kill(front.pid, signal.SIGINT)
    front.wait(60)
    setup = ", ".join(f"{k}={os.environ[k]}" for k in ("BENCH_UVICORN_HTTP", "BENCH_EVENT_LOOP")
                      if os.environ.get(k)) or "as `mtpwrap up` serves it"
    print(f"\n== c={concurrency} ({setup}, under cProfile): {res.ok} "
          f"streams, {res.tokens} chunks in {wall:.1f} s; front CPU {cpu:.2f} s = "
          f"{cpu / max(1, res.tokens) * 1e6:.0f} µs per chunk ({cpu / wall * 100:.0f}% of one "
          f"core); upstream {interval_ms:g} ms/chunk ==")
    text = io.StringIO()
    stats = pstats.Stats(str(out), stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:start + top + 1]))
    print(f"(full profile: {out}; open with `python -m pstats {out}`)")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its children (nginx's workers, say)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        t = p.cpu_times()
        total += t.user + t.system
    return total


_BODY = {"model": "x", "stream": True, "max_tokens": 100,
         "messages": [{"role": "user", "content": "hi"}]}


def side_by_side(upstream: po.Target, levels: list[int], requests: int, rounds: int,
                 interval_ms: float, loops: list[str], tokens: int = 100,
                 per: str = "chunk") -> None:
    """CPU per relayed chunk (or per stream) of the front, nginx and HAProxy on the same load,
    interleaved; one more front per event loop in `loops` (a column `mtpwrap/<loop>`)."""
    body = {**_BODY, "max_tokens": tokens}
    work = Path(tempfile.mkdtemp(prefix="front-cpu-"))
    procs: list[Any] = []
    pids: dict[str, int] = {}
    try:
        urls = po.start_paths(upstream, max(levels), work, procs, pids)
        for kind in loops:
            front, furl = po.start_front(upstream, max(levels), env={"BENCH_EVENT_LOOP": kind})
            procs.append(front)
            urls[f"mtpwrap/{kind}"] = (furl, None)
            pids[f"mtpwrap/{kind}"] = front.pid
        names = list(pids)
        print(f"\n== CPU per relayed {per}, µs: median (min-max) of {rounds} interleaved rounds; "
              f"synthetic upstream {interval_ms:g} ms/chunk, {tokens} chunks per stream, on "
              f"{upstream.socket or 'TCP'} ==")
        print("conc " + "".join(f"{n:>22}" for n in names) + "   mtpwrap vs nginx")
        for c in levels:
            got: dict[str, list[float]] = {n: [] for n in names}
            for r in range(rounds):
                for name in po.rotated(names, r):
                    target = urls[name][0] + "/v1/chat/completions"
                    asyncio.run(po.run_load(target, min(c, 4), 1, body))  # warm
                    cpu0 = _cpu_seconds(pids[name])
                    res = asyncio.run(po.run_load(target, c, max(1, requests // c), body))
                    count = res.tokens if per == "chunk" else res.ok
                    got[name].append((_cpu_seconds(pids[name]) - cpu0) / max(1, count) * 1e6)
            cells = "".join(f"{statistics.median(v):>8.0f} ({min(v):4.0f}-{max(v):4.0f})    "
                            for v in got.values())
            ratio = (f"{statistics.median(got['mtpwrap']) / statistics.median(got['nginx']):.1f}×"
                     if "nginx" in got else "n/a")
            print(f"{c:>4} {cells}{ratio:>8}", flush=True)
    finally:
        for p in reversed(procs):
            po.stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="8,32")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--cpu-only", action="store_true",
                    help="no cProfile: the CPU per chunk of the front, nginx and HAProxy")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --cpu-only: interleaved rounds per level")
    ap.add_argument("--upstream", choices=("unix", "tcp"), default="unix",
                    help="where the synthetic upstream listens (default: a UNIX socket)")
    ap.add_argument("--tokens", type=int, default=100,
                    help="chunks per stream (2 shows the cost of a request)")
    ap.add_argument("--per", choices=("chunk", "stream"), default="chunk",
                    help="with --cpu-only: CPU per relayed chunk, or per stream")
    ap.add_argument("--loops", default="",
                    help="with --cpu-only: also the front on these event loops, comma-separated "
                         "(asyncio, uvloop), beside the one `mtpwrap up` uses")
    args = ap.parse_args()
    where = po.new_target(args.upstream, Path(tempfile.mkdtemp(prefix="front-profile-")),
                          "synthetic")
    upstream = po.spawn([po.PY, po.__file__, "_synthetic", where.arg,
                         str(args.interval_ms / 1000)])
    try:
        po.wait_target(where, "/health", 30)
        levels = [int(x) for x in args.levels.split(",")]
        if args.cpu_only:
            side_by_side(where, levels, args.requests, args.rounds, args.interval_ms,
                         [k for k in args.loops.split(",") if k], args.tokens, args.per)
        for c in levels if not args.cpu_only else []:
            profile_level(where, c, args.requests, args.top, args.interval_ms, args.tokens)
    finally:
        po.stop(upstream)


if __name__ == "__main__":
    main()
