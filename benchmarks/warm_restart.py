"""Warm restart: time to first token after `mtpwrap restart`, with and without the document store.

Two instances of `mtpwrap up` run one after the other on the same binary and model, one with
`persist.enabled: true`, one with `false`. For each prompt length: a prompt of that many tokens
(prefilled once, not timed), `mtpwrap restart`, then the same prompt plus a question, streamed;
the time from sending it to its first token and the prompt tokens llama-server processed
(`timings.prompt_n`) are printed side by side, with the save and restore rates of the store.

    python benchmarks/warm_restart.py [--binary PATH] [--model PATH] [--lengths 400,800,1500]

Defaults: the built CPU llama-server and the demo model, on the cpu-demo profile with one slot
(the store serves a launch of one; 4,096 tokens, so lengths stay below that). On a GPU pass a
one-slot profile and a model whose context holds the lengths you ask for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mtpwrap import proc
from mtpwrap.proc import free_loopback_port

REPO = Path(__file__).resolve().parent.parent
QUESTION = " Question: which clause names the latest day?"


def text_of(tokens: int) -> str:
    """Roughly `tokens` tokens of varied legal-sounding text (about 21 tokens a clause); each
    length starts differently, so no prompt reuses another's cache."""
    n = max(1, tokens // 21)
    return f"Contract {tokens}. " + " ".join(
        f"Clause {i}: the party of part {i % 5} shall deliver item {i * 7} by day {i % 28 + 1}."
        for i in range(n))


class Up:
    def __init__(self, home: Path, binary: str, model: str, profile: str, persist: bool) -> None:
        self.port = free_loopback_port()
        self.base = f"http://127.0.0.1:{self.port}"
        if profile == "cpu-demo":  # one slot: the document store serves a launch of one
            import yaml

            demo = yaml.safe_load((REPO / "profiles" / "cpu-demo.yaml").read_text())
            profile = str(home / "cpu-demo-1-slot.yaml")
            Path(profile).write_text(yaml.safe_dump({**demo, "name": "cpu-demo-1-slot",
                                                     "slots": 1}))
        cfg = home / "mtpwrap.yaml"
        cfg.write_text(json.dumps({
            "profile": profile, "model": model, "binary": binary, "port": self.port,
            "persist": {"enabled": persist, "min_tokens": 64},
            "proxy": {"queue_timeout_s": 300}}))
        self.env = {**os.environ, "MTPWRAP_HOME": str(home), "MTPWRAP_CONFIG": str(cfg),
                    "PYTHONPATH": str(REPO)}
        self.home = home
        self.up = proc.start([sys.executable, "-m", "mtpwrap", "up"], env=self.env,
                             stdout=(home / "up.log").open("w"), stderr=proc.STDOUT)
        self.wait_ready()

    def wait_ready(self, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.up.poll() is not None:
                sys.exit(f"mtpwrap up exited; see {self.home / 'up.log'}")
            try:
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        sys.exit("not ready in time")

    def restart(self) -> None:
        r = proc.run([sys.executable, "-m", "mtpwrap", "restart"], env=self.env, timeout=900)
        if r.returncode != 0:
            sys.exit(f"restart failed: {r.stderr.strip()}")

    def store(self) -> dict:
        """The document store's last save and restore, from /healthz."""
        return httpx.get(self.base + "/healthz", timeout=30).json().get("store") or {}

    def first_token(self, prompt: str) -> tuple[float, int]:
        """Seconds to the first streamed token, and prompt tokens processed."""
        t0 = time.perf_counter()
        ttft = None
        processed = -1
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True,
                "cache_prompt": True}
        with httpx.stream("POST", self.base + "/completion", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                doc = json.loads(line[6:])
                if "timings" in doc:
                    processed = int(doc["timings"]["prompt_n"])
        return ttft or float("nan"), processed

    def close(self) -> None:
        proc.run([sys.executable, "-m", "mtpwrap", "down"], env=self.env, timeout=120)
        self.up.stop(30)


def run(binary: str, model: str, profile: str, lengths: list[int], persist: bool
        ) -> dict[int, dict]:
    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="warm-restart-") as tmp:
        up = Up(Path(tmp), binary, model, profile, persist)
        try:
            for n in lengths:
                prompt = text_of(n)
                _, full = up.first_token(prompt)  # the prefill a restart would lose
                up.restart()
                ttft, processed = up.first_token(prompt + QUESTION)
                rep = up.store()
                saved = rep.get("last_save") or {}
                restored = rep.get("last_restore") or {}
                mb = (saved.get("bytes") or 0) / 2**20
                out[n] = {"prompt": full, "ttft": ttft, "processed": processed,
                          "save_mbs": mb * 1000 / saved["ms"] if saved.get("ms") else None,
                          "restore_mbs": (mb * 1000 / restored["ms"]
                                          if restored.get("ms") else None),
                          "mb": mb}
        finally:
            up.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", help="llama-server (default: the built CPU one)")
    ap.add_argument("--model", help="model (default: the demo model)")
    ap.add_argument("--profile", default="cpu-demo")
    ap.add_argument("--lengths", default="400,800,1500")
    a = ap.parse_args()
    if a.binary is None:
        from mtpwrap.build import builder

        a.binary = str(builder.ensure_built(variant="cpu").binary("llama-server"))
    if a.model is None:
        from mtpwrap.models import known as models

        a.model = str(models.ensure_demo_model())
    lengths = [int(x) for x in a.lengths.split(",")]
    cold = run(a.binary, a.model, a.profile, lengths, persist=False)
    warm = run(a.binary, a.model, a.profile, lengths, persist=True)

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    print(f"binary {a.binary}\nmodel  {a.model}\n")
    print(f"{'prompt tok':>10} | {'TTFT cold s':>11} {'TTFT warm s':>11} {'speed-up':>8} | "
          f"{'processed cold':>14} {'warm':>5} | {'state MB':>11} {'save MB/s':>9} "
          f"{'restore MB/s':>12}")
    for n in lengths:
        c, w = cold[n], warm[n]
        print(f"{w['prompt']:>10} | {c['ttft']:>11.3f} {w['ttft']:>11.3f} "
              f"{c['ttft'] / w['ttft']:>7.1f}x | {c['processed']:>14} {w['processed']:>5} | "
              f"{w['mb']:>11.1f} {f(w['save_mbs'], '.0f'):>9} {f(w['restore_mbs'], '.0f'):>12}")


if __name__ == "__main__":
    main()
