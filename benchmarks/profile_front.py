"""Where the front's CPU time goes under streaming load: cProfile of the front process.

The front runs as `mtpwrap up` serves it (benchmarks/proxy_overhead.py `_front`, uvicorn with
the front's own connection layer) over the synthetic SSE upstream, under cProfile; this process
sends streamed chat requests at each concurrency, stops the front with SIGINT (a clean uvicorn
exit, so cProfile writes its file) and prints the functions with the most own time and the
front's CPU time per relayed chunk.

    python benchmarks/profile_front.py [--levels 8,32] [--requests 96] [--top 25] [--cpu-only]
                                       [--upstream unix|tcp]

BENCH_UVICORN_HTTP=h11 and BENCH_UVICORN_LOOP=uvloop|asyncio measure the alternatives.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po


def profile_level(upstream: po.Target, concurrency: int, requests: int, top: int,
                  interval_ms: float, profile: bool = True) -> None:
    out = Path(tempfile.mkdtemp(prefix="front-profile-")) / f"c{concurrency}.prof"
    port = po.free_port()
    prof = ["-m", "cProfile", "-o", str(out)] if profile else []
    front = po.spawn([po.PY, *prof, po.__file__, "_front", upstream.arg, str(port),
                      str(concurrency)])
    url = f"http://127.0.0.1:{port}"
    po.wait_http(url + "/livez", 60)
    body = {"model": "x", "stream": True, "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}]}
    asyncio.run(po.run_load(url + "/v1/chat/completions", min(concurrency, 4), 1, body))
    cpu0 = _cpu_seconds(front.pid)
    t0 = time.perf_counter()
    res = asyncio.run(po.run_load(url + "/v1/chat/completions", concurrency,
                                  max(1, requests // concurrency), body))
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds(front.pid) - cpu0
    os.kill(front.pid, signal.SIGINT)
    front.wait(60)
    setup = ", ".join(f"{k}={os.environ[k]}" for k in ("BENCH_UVICORN_HTTP", "BENCH_UVICORN_LOOP")
                      if os.environ.get(k)) or "as `mtpwrap up` serves it"
    print(f"\n== c={concurrency} ({setup}{', under cProfile' if profile else ''}): {res.ok} "
          f"streams, {res.tokens} chunks in {wall:.1f} s; front CPU {cpu:.2f} s = "
          f"{cpu / max(1, res.tokens) * 1e6:.0f} µs per chunk ({cpu / wall * 100:.0f}% of one "
          f"core); upstream {interval_ms:g} ms/chunk ==")
    if not profile:
        return
    text = io.StringIO()
    stats = pstats.Stats(str(out), stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:start + top + 1]))
    print(f"(full profile: {out}; open with `python -m pstats {out}`)")


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="8,32")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--cpu-only", action="store_true",
                    help="no cProfile: only the front's CPU time per chunk")
    ap.add_argument("--upstream", choices=("unix", "tcp"), default="unix",
                    help="where the synthetic upstream listens (default: a UNIX socket)")
    args = ap.parse_args()
    where = po.new_target(args.upstream, Path(tempfile.mkdtemp(prefix="front-profile-")),
                          "synthetic")
    upstream = po.spawn([po.PY, po.__file__, "_synthetic", where.arg,
                         str(args.interval_ms / 1000)])
    try:
        po.wait_target(where, "/health", 30)
        for c in (int(x) for x in args.levels.split(",")):
            profile_level(where, c, args.requests, args.top, args.interval_ms,
                          profile=not args.cpu_only)
    finally:
        po.stop(upstream)


if __name__ == "__main__":
    main()
