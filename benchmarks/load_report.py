"""Load report for the front (docs/reliability.md, last section), in one run:

1. a concurrency ladder (1, 2, 4, 8, 2×slots) of streamed chat requests against the real
   llama-server with the demo model, directly and through mtpwrap: time to first token and
   inter-token latency p50/p95/p99, tokens/s, errors by class;
2. a forced kill of the child in the middle of a proxied run at 2×slots: every request sent must
   end in exactly one known class (completed with [DONE], error event, 503/429 with Retry-After,
   502) — "unaccounted" (a stream that ended without [DONE] and without an error, or a hang)
   must be 0.

The front runs in its own process with a small restarting supervisor (below) that implements
the supervisor contract over one llama-server child: when the child dies, the state goes to
STARTING, a new child is spawned, and READY comes back once /health answers.

    python benchmarks/load_report.py [--slots 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from proxy_overhead import (
    INTERNAL_KEY,
    PY,
    REPO,
    free_port,
    run_load,
    start_llama,
    stop,
    summary,
    wait_http,
)

from mtpwrap import proc

DIRECT = {"authorization": f"Bearer {INTERNAL_KEY}"}


class RestartingSupervisor:
    """One llama-server child, restarted whenever it exits (the contract's methods only)."""

    def __init__(self, port: int, slots: int) -> None:

        self.port, self.slots = port, slots
        self.state, self.reason, self.restarts, self.generation = "starting", None, 0, 0
        self.t0 = time.time()
        self.child_t0: float | None = None
        self.proc: proc.Process | None = None
        self.changed = asyncio.Event()

    def _set(self, state: str, reason: str | None = None) -> None:
        self.state, self.reason = state, reason
        self.changed.set()
        self.changed = asyncio.Event()

    def status(self):
        from mtpwrap.supervision.state import State, SupervisorStatus, Upstream

        up = (Upstream(f"http://127.0.0.1:{self.port}", INTERNAL_KEY, self.generation)
              if self.state == "ready" else None)
        return SupervisorStatus(state=State(self.state), reason=self.reason,
                                restarts=self.restarts, started_at=self.t0,
                                child_started_at=self.child_t0, ready_since=None, last_exit=None,
                                pid=self.proc.pid if self.proc else None, upstream=up)

    async def wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while self.state != "ready":
            if self.state in ("failed", "stopped"):
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return None
        return self.status().upstream

    def report_stall(self, generation: int, reason: str) -> None:
        print(f"stall: {reason}", file=sys.stderr)

    def add_listener(self, cb) -> None:
        pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._set("starting")
            self.generation += 1
            self.proc = await loop.run_in_executor(None, self._spawn)
            self.child_t0 = time.time()
            self._set("ready")
            code = await loop.run_in_executor(None, self.proc.wait)
            self._set("starting", f"child exited ({code})")
            self.restarts += 1

    def _spawn(self) -> proc.Process:
        return start_llama(self.port, self.slots)


def supervised_front_main(port: int, slots: int) -> None:
    import uvicorn

    sys.path.insert(0, str(REPO))
    from mtpwrap.config.objects import ProxyConfig
    from mtpwrap.front.app import Front
    from mtpwrap.front.info import ServeInfo

    async def main() -> None:
        sup = RestartingSupervisor(free_port(), slots)
        cfg = ProxyConfig(max_concurrency=slots * 2, queue_size=slots * 4,
                          queue_timeout_s=60, retry_after_s=2)
        front = Front(sup, cfg, ServeInfo(profile="load-report"))
        runner = asyncio.ensure_future(sup.run())
        server = uvicorn.Server(front.server_config(host="127.0.0.1", port=port))
        try:
            await server.serve()
        finally:
            runner.cancel()
            if sup.proc:
                stop(sup.proc)

    asyncio.run(main())


async def kill_run(url: str, concurrency: int, per_worker: int, body: dict,
                   kill_after: float) -> dict:
    """Proxied load with a SIGKILL of the child after `kill_after` seconds; classify each."""
    outcomes: dict[str, int] = {}
    sent = 0
    from proxy_overhead import Result, one_stream

    res = Result()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits,
                                 trust_env=False) as client:
        async def worker() -> None:
            nonlocal sent
            for _ in range(per_worker):
                sent += 1
                try:
                    kind = await asyncio.wait_for(
                        one_stream(client, url + "/v1/chat/completions", body, res, {}), 180)
                except asyncio.TimeoutError:
                    kind = "hung"
                outcomes[kind] = outcomes.get(kind, 0) + 1

        async def killer() -> None:
            await asyncio.sleep(kill_after)
            h = (await client.get(url + "/healthz")).json()
            os.kill(h["child_pid"], signal.SIGKILL)
            print(f"  killed child pid {h['child_pid']} at t={kill_after:.1f}s")

        t0 = time.perf_counter()
        await asyncio.gather(killer(), *(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        h = (await client.get(url + "/healthz")).json()
    unaccounted = outcomes.get("no_done_unexplained", 0) + outcomes.get("hung", 0)
    return {"sent": sent, "outcomes": outcomes, "unaccounted": unaccounted,
            "restarts": h["restarts"], "wall_s": wall,
            "adds_up": sum(outcomes.values()) == sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    slots = args.slots
    ladder = sorted({1, 2, 4, 8, 2 * slots})
    body = {"model": "x", "stream": True, "max_tokens": args.tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a short story about a harbour."}]}
    procs = []
    report: dict = {"ladder": [], "kill": None, "slots": slots}
    try:
        fport = free_port()
        procs.append(proc.start([PY, __file__, "_front", str(fport), str(slots)]))
        furl = f"http://127.0.0.1:{fport}"
        wait_http(furl + "/readyz", 240)
        # The direct path gets its own child with the same settings (the front's child listens
        # on a port private to the front process); only one path is loaded at a time.
        dport = free_port()
        procs.append(start_llama(dport, slots))
        durl = f"http://127.0.0.1:{dport}"
        print(f"== load ladder: streamed chat, {args.tokens} tokens, {slots} slots ==")
        print(f"{'conc':>4} {'path':>8} {'TTFT p50/p95/p99 ms':>22} {'ITL p50/p95/p99 ms':>22} "
              f"{'tok/s':>8} {'ok':>4} errors")
        for c in ladder:
            per = max(1, 8 // c) if c < 8 else 1
            for path, url, h in (("direct", durl, DIRECT), ("mtpwrap", furl, {})):
                r = asyncio.run(run_load(url + "/v1/chat/completions", c, per, body, h))
                s = summary(r)
                tt = [s["ttft_p50_ms"], s["ttft_p95_ms"], s["ttft_p99_ms"]]
                it = [s["itl_p50_ms"], s["itl_p95_ms"], s["itl_p99_ms"]]
                print(f"{c:>4} {path:>8} {'/'.join(f'{x:.0f}' for x in tt):>22} "
                      f"{'/'.join(f'{x:.1f}' for x in it):>22} {s['tokens_per_s']:8.1f} "
                      f"{s['ok']:>4} {s['errors'] or ''}")
                report["ladder"].append({"concurrency": c, "path": path, **s})
        stop(procs.pop())  # the direct child: free the CPU for the kill run
        print(f"\n== forced kill of the child during a proxied run at {2 * slots} ==")
        k = asyncio.run(kill_run(furl, 2 * slots, 3, body, kill_after=2.0))
        print(f"  sent {k['sent']}  outcomes {k['outcomes']}  restarts {k['restarts']}  "
              f"unaccounted {k['unaccounted']}  adds up: {k['adds_up']}")
        report["kill"] = k
    finally:
        for p in reversed(procs):
            stop(p)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_front":
        supervised_front_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
