"""Time to ready: `mtpwrap up` against llama-server started by hand, in the same run.

For each round, alternately:
  direct   spawn llama-server with the same flags; time until /health is 200, and until a
           one-token completion answers (what mtpwrap calls ready)
  mtpwrap  spawn `python -m mtpwrap up`; time until the front's /readyz is 200; from its state
           file, the time between llama-server's spawn and READY inside mtpwrap

Prints each round and the medians side by side; the headline is mtpwrap's /readyz time minus
llama-server's own /health time (target: <= 0.5 s).

    python benchmarks/ready_time.py [--binary PATH] [--model PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEMO_ARGS = ["-c", "4096", "-np", "2", "--metrics", "--no-webui"]
POLL = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(url: str, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(POLL)
    return None


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def direct(binary: Path, model: Path) -> tuple[float, float]:
    port, key = free_port(), secrets.token_urlsafe(16)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            *DEMO_ARGS]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, "LLAMA_API_KEY": key},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t_health = poll(f"http://127.0.0.1:{port}/health", t0 + 120)
        if t_health is None:
            raise SystemExit("llama-server never answered /health")
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=60,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": "Hello", "n_predict": 1, "cache_prompt": False})
        r.raise_for_status()
        t_token = time.monotonic()
    finally:
        stop(proc)
    return t_health - t0, t_token - t0


def via_mtpwrap(binary: Path, model: Path) -> tuple[float, float, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "MTPWRAP_HOME": home, "PYTHONPATH": str(REPO)}
        t0, wall0 = time.monotonic(), time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mtpwrap", "up", "--profile", "cpu-demo", "--binary",
             str(binary), "--model", str(model), "--port", str(port)],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            t_ready = poll(f"http://127.0.0.1:{port}/readyz", t0 + 120)
            if t_ready is None:
                raise SystemExit("mtpwrap never became ready")
            state = json.loads((Path(home) / "state" / "instance.json").read_text())
            inside = state["ready_since"] - state["child_started_at"]
            before = state["child_started_at"] - wall0
        finally:
            stop(proc)
    return t_ready - t0, inside, before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from mtpwrap import build, models

    binary = args.binary or build.find_binary()
    model = args.model or models.ensure_demo_model()
    print(f"binary {binary}\nmodel  {model}\n")
    print(f"{'round':>5} {'direct /health':>15} {'direct 1 token':>15} {'mtpwrap /readyz':>16} "
          f"{'up->spawn':>10} {'spawn->READY':>13} {'readyz - health':>16}")
    rows = []
    for i in range(args.rounds):
        h, tok = direct(binary, model)
        ready, inside, before = via_mtpwrap(binary, model)
        rows.append((h, tok, ready, before, inside, ready - h))
        print(f"{i + 1:>5} {h:>14.3f}s {tok:>14.3f}s {ready:>15.3f}s {before:>9.3f}s "
              f"{inside:>12.3f}s {ready - h:>15.3f}s")
    med = [statistics.median(c) for c in zip(*rows, strict=True)]
    print(f"{'med':>5} {med[0]:>14.3f}s {med[1]:>14.3f}s {med[2]:>15.3f}s {med[3]:>9.3f}s "
          f"{med[4]:>12.3f}s {med[5]:>15.3f}s")
    print(f"\nmtpwrap time to ready minus llama-server's own (/health 200), median of rounds: "
          f"{med[5]:.3f} s (target <= 0.5 s)")
    print(f"  up->spawn: Python start-up, imports, settings, checks before llama-server starts "
          f"({med[3]:.3f} s); spawn->READY includes the one-token readiness generation")
    print(f"  os.getloadavg() at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs "
          f"(a busy machine inflates every column)")


if __name__ == "__main__":
    main()
