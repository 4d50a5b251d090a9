"""Fleet report: one, two and three nodes behind HAProxy, side by side, in one run.

Each configuration is a real fleet on loopback (tests/fleet_harness.py: `mtpwrap up --profile
cpu-demo` nodes with one llama.cpp thread each, HAProxy from `mtpwrap fleet haproxy`). The same
bounded load goes through HAProxy: `--requests` chat requests of `--max-tokens` tokens, at most
`--concurrency` at a time. Printed: requests/s, generated tokens/s (the aggregate), latency
p50/p95, failures, and, for three nodes, the same load with one node SIGKILLed after the first
quarter (with the seconds HAProxy took to take it out), then with another one drained by
SIGTERM after the first quarter.

On one machine the nodes share its cores, so three nodes measure HAProxy's spreading and
fail-over, not three GPUs' worth of speed.

    python benchmarks/fleet_report.py [--requests 24] [--concurrency 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mtpwrap.build import builder  # noqa: E402
from mtpwrap.models import known as models  # noqa: E402
from tests.fleet_harness import LocalFleet, chat, wait_for  # noqa: E402


def run_load(fleet: LocalFleet, requests: int, concurrency: int, max_tokens: int,
             kill_after: int | None = None, victim: str = "",
             sig: signal.Signals = signal.SIGKILL) -> dict[str, float]:
    done = 0
    lock = threading.Lock()
    latencies: list[float] = []
    tokens = failures = 0
    out_s: list[float] = []

    def watch() -> None:  # seconds from the signal until HAProxy has the node DOWN
        out_s.append(wait_for(f"HAProxy takes {victim} out",
                              lambda: fleet.status_of(victim).startswith("DOWN"), 120, 0.05))

    def one(_: int) -> None:
        nonlocal done, tokens, failures
        t0 = time.monotonic()
        try:
            r = chat(fleet.base, max_tokens=max_tokens, text="Write a short poem about rivers.")
            ok = r.status_code == 200
            n = r.json()["usage"]["completion_tokens"] if ok else 0
        except Exception:
            ok, n = False, 0
        with lock:
            done += 1
            latencies.append(time.monotonic() - t0)
            tokens += n
            failures += 0 if ok else 1
            if kill_after is not None and done == kill_after:
                fleet.nodes[victim].proc.send_signal(sig)
                watcher.start()

    watcher = threading.Thread(target=watch)
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    wall = time.monotonic() - t0
    if watcher.ident is not None:
        watcher.join()
    lat = sorted(latencies)
    return {"requests/s": requests / wall, "tokens/s": tokens / wall,
            "p50 s": statistics.median(lat), "p95 s": lat[max(0, round(0.95 * len(lat)) - 1)],
            "failed": failures, "wall s": wall,
            "node out s": out_s[0] if out_s else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    binary = Path(builder.ensure_built(variant="cpu").to_dict()["binaries"]["llama-server"]["path"])
    model = models.ensure_demo_model()
    results: dict[str, dict[str, float]] = {}
    for n in (1, 2, 3):
        with tempfile.TemporaryDirectory() as work, \
                LocalFleet(Path(work), binary, model, n, MTPWRAP_DRAIN_S="60") as fleet:
            chat(fleet.base)  # warm-up
            results[f"{n} node{'s' * (n > 1)}"] = run_load(
                fleet, args.requests, args.concurrency, args.max_tokens)
            if n == 3:
                results["3, 1 killed"] = run_load(
                    fleet, args.requests, args.concurrency, args.max_tokens,
                    kill_after=args.requests // 4, victim="n1")
                results["2, 1 drained"] = run_load(
                    fleet, args.requests, args.concurrency, args.max_tokens,
                    kill_after=args.requests // 4, victim="n2", sig=signal.SIGTERM)
    cols = list(results)
    print(f"{args.requests} requests x {args.max_tokens} tokens, concurrency "
          f"{args.concurrency}, through HAProxy")
    print(f"{'':<12}" + "".join(f"{c:>20}" for c in cols))
    for key in next(iter(results.values())):
        print(f"{key:<12}" + "".join(f"{results[c][key]:>20.2f}" for c in cols))


if __name__ == "__main__":
    main()
