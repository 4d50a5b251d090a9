"""Time to ready: what `mtpwrap up` adds on top of llama-server's own start-up.

Each round starts `python -m mtpwrap up` and polls the front's /readyz from outside. The same
run's instance file says when llama-server was spawned, when its /health first said 200 (its
own idea of ready) and when mtpwrap declared READY (a generated token). So, per run:

  mtpwrap   `up` started -> /readyz 200 seen by the client
  own       llama-server spawned -> its /health 200            (llama-server's own time)
  overhead  mtpwrap - own: Python start-up and checks before the spawn, the one-token
            readiness generation, the front noticing                 (target: <= 0.5 s)

For reference each round also starts llama-server directly with the same flags (spawn ->
/health 200, and -> a first generated token). On a busy machine every column grows; the
same-run overhead is the figure that compares like with like.

    python benchmarks/ready_time.py [--binary PATH] [--model PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mtpwrap import proc
from mtpwrap.proc import free_loopback_port as free_port

REPO = Path(__file__).resolve().parent.parent
POLL = 0.01




def poll(url: str, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(POLL)
    return None


def direct(binary: Path, model: Path) -> tuple[float, float]:
    """llama-server alone, with the argv `up --profile cpu-demo` gives it."""
    from mtpwrap.decide import profiles, resolve
    from mtpwrap.supervision.inputs import find_server

    port, key = free_port(), secrets.token_urlsafe(16)
    r = resolve.resolve(profiles.load_profile("cpu-demo"), snapshot=None,
                        caps=find_server(binary)[1], model=model, binary=binary,
                        plan=False)
    spec = r.render(port=port, api_key=key)
    t0 = time.monotonic()
    srv = proc.start_server(spec.argv, base_url=f"http://127.0.0.1:{port}", env=spec.env,
                       timeout=120, poll_s=POLL)
    try:
        t_health = time.monotonic()
        r2 = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=60,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"prompt": "Hello", "n_predict": 1, "cache_prompt": False})
        r2.raise_for_status()
        t_token = time.monotonic()
    finally:
        srv.stop()
    return t_health - t0, t_token - t0


def via_mtpwrap(binary: Path, model: Path, explicit: bool) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as home:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "MTPWRAP_HOME": home, "PYTHONPATH": path}
        t0, wall0 = time.monotonic(), time.time()
        # Without --binary, `up` uses the build's manifest (capabilities recorded at build
        # time), as a deployment does; --binary makes it probe the binary's --help first.
        chosen = ["--binary", str(binary)] if explicit else []
        up = proc.start(
            [sys.executable, "-m", "mtpwrap", "up", "--profile", "cpu-demo", *chosen,
             "--model", str(model), "--port", str(port)],
            env=env, cwd=REPO, stdout=proc.DEVNULL, stderr=proc.DEVNULL)
        try:
            t_ready = poll(f"http://127.0.0.1:{port}/readyz", t0 + 120)
            if t_ready is None:
                raise SystemExit("mtpwrap never became ready")
            seen = wall0 + (t_ready - t0)
            st = json.loads((Path(home) / "state" / "instance.json").read_text())
        finally:
            up.stop(20)
    spawn, health, ready = st["child_started_at"], st["child_health_ok_at"], st["ready_since"]
    return {"mtpwrap": seen - wall0, "own": health - spawn, "pre_spawn": spawn - wall0,
            "probe": ready - health, "notice": seen - ready}


PRE_SPAWN = """
import time, sys
from mtpwrap import cli
from mtpwrap.commands import up
from mtpwrap.config import settings
from mtpwrap.supervision import instance
from mtpwrap.service import startup
s = settings.load_settings({"profile": "cpu-demo", "model": sys.argv[1]})
instance.read_instance()
startup.load_runtime(s)
print(time.process_time())
"""


def pre_spawn_cpu(model: Path) -> float:
    """CPU seconds (user + system) `up` spends before it can spawn llama-server: interpreter
    start-up, imports, settings, profile, argv. Unlike wall time, a busy machine barely
    changes it."""
    with tempfile.TemporaryDirectory() as home:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        out = proc.run([sys.executable, "-c", PRE_SPAWN, str(model)], cwd=REPO,
                       env={**os.environ, "MTPWRAP_HOME": home, "PYTHONPATH": path},
                       timeout=300, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from mtpwrap.build.binary import find_binary
    from mtpwrap.models import known as models

    binary = args.binary or find_binary()
    model = args.model or models.ensure_demo_model()
    print(f"binary {binary}\nmodel  {model}\n")
    cols = ["direct /health", "direct 1 tok", "mtpwrap", "own", "overhead", "pre-spawn",
            "probe", "notice"]
    print("round " + " ".join(f"{c:>14}" for c in cols))
    rows = []
    for i in range(args.rounds):
        h, tok = direct(binary, model)
        m = via_mtpwrap(binary, model, explicit=args.binary is not None)
        row = [h, tok, m["mtpwrap"], m["own"], m["mtpwrap"] - m["own"], m["pre_spawn"],
               m["probe"], m["notice"]]
        rows.append(row)
        print(f"{i + 1:>5} " + " ".join(f"{v:>13.3f}s" for v in row))
    med = [statistics.median(c) for c in zip(*rows, strict=True)]
    print("  med " + " ".join(f"{v:>13.3f}s" for v in med))
    print(f"\nmtpwrap time to ready minus llama-server's own, same run, median: {med[4]:.3f} s "
          f"(target <= 0.5 s)")
    print(f"  = pre-spawn {med[5]:.3f} s (Python, imports, settings, profile, memory plan) "
          f"+ probe {med[6]:.3f} s (one generated token) + notice {med[7]:.3f} s")
    cpu = statistics.median(pre_spawn_cpu(model) for _ in range(5))
    print(f"CPU time before the spawn (load-independent), median of 5: {cpu:.3f} s")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
