"""Inside a machine with no network: run by tests/test_bundle_real.py under `unshare -rn` (a
network namespace of its own with nothing but loopback), with an empty HOME and no MTPWRAP_*
variable. Installs the bundle with its install.sh, serves the carried build with `up`, asks it
through the official `openai` client, stops it, and configures a build from the carried source.
Prints one JSON object of what it saw."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import wait_for

#: what the installed commands see: not this checkout (the driver imports tests.helpers from it)
CLEAN = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(argv: list[str], timeout: float) -> dict[str, object]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=CLEAN)
    return {"rc": done.returncode, "out": done.stdout[-4000:], "err": done.stderr[-4000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--prefix", type=Path, required=True)
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    seen: dict[str, object] = {}
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    seen["links"] = subprocess.run(["ip", "-o", "link"], capture_output=True,
                                   text=True).stdout.split("\n")
    seen["routes"] = subprocess.run(["ip", "-4", "route"], capture_output=True,
                                    text=True).stdout.strip()
    seen["install"] = run(["sh", str(args.bundle / "install.sh"), "--prefix",
                           str(args.prefix)], 600)
    mtpwrap = str(args.prefix / "bin" / "mtpwrap")
    if seen["install"]["rc"] != 0:  # type: ignore[index]
        print(json.dumps(seen))
        return 0
    log = Path(os.environ["HOME"]) / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen([mtpwrap, "up", "--profile", "cpu-demo", "--host", "127.0.0.1",
                               "--port", str(args.port)], stdout=out, stderr=subprocess.STDOUT,
                              env=CLEAN)
    base = f"http://127.0.0.1:{args.port}"

    def ready() -> bool:
        if up.poll() is not None:
            raise RuntimeError("mtpwrap up ended: " + log.read_text()[-3000:])
        try:
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("mtpwrap up ready", ready, timeout=180)
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="demo", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "Name the capital of France."}])
        seen["chat"] = {"content": reply.choices[0].message.content,
                        "completion_tokens": reply.usage.completion_tokens if reply.usage
                        else None}
        seen["status"] = run([mtpwrap, "status", "--json"], 60)
    finally:
        up.send_signal(signal.SIGTERM)
        seen["up_rc"] = up.wait(timeout=60)
        seen["up_log"] = log.read_text()[-3000:]
    seen["configure"] = run([mtpwrap, "build", "--cpu", "--configure-only", "--json"], 600)
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
