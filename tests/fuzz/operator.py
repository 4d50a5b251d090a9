"""The fault phase's operator cases, on a `mtpwrap up` of their own (the real llama-server, named
keys with token budgets in a key file, the audit trail in files, and a stand-in NVML that hangs
on demand — `tests/fakes/stalling_nvml`, the one fault here the real thing cannot show when
asked):

- budget: a burst of parallel streams on a key with a token budget, each closed by its client
  after a few chunks (or read to its end). Every request gets a status (200, or 429 naming the
  budget with `Retry-After`); each has one audit line with the status its client saw; a cut
  stream is charged what llama-server computed (its prompt and its completion both above 0,
  never 0); the key's token counter on /metrics is the sum of its lines; and the budget is
  overrun by at most one request's charge (a request is admitted while what is spent and
  reserved is under the budget, so the last one admitted may straddle it — never two).
- nvml: NVML hangs (every call blocks) while streams run: /healthz goes stale within its bound
  and answers within 3 s, /livez within 1 s, the streams end with their done marker; when
  NVML answers again the reading is fresh.
- reload / restart: `mtpwrap reload` (SIGHUP, with a new key added to the key file) or
  `mtpwrap restart` (SIGUSR2) while streams run: every request ends, once, with a status its
  client saw (a reload: 200 and the done marker; a restart: that, or an error event, or a 503
  with `Retry-After`), none hangs; the instance is ready again and the new key is served.

After each case llama-server is generating nothing for anyone.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import REPO, audit_lines, wait_for

STALLING_NVML = REPO / "tests" / "fakes" / "stalling_nvml"
ADMIN = "ops-admin-key-0123456789"
#: the budgeted keys: one per budget case, each with a budget of its own (tokens an hour)
TIGHT = 400
#: what a case's requests ask: up to 48 tokens each (the profile's max_predict is 64)
BODY = {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
        "max_tokens": 48, "stream": True}
#: a request's bound: the slowest answer of 48 tokens on two busy cores is well inside it
REQUEST_S = 120.0
KINDS = ("budget", "budget", "nvml", "reload", "restart")


def tight_key(i: int) -> str:
    return f"ops-tight-{i:04d}-0123456789"


def key_file(budgets: list[int]) -> str:
    lines = [f"{ADMIN} name=ops-admin"]
    lines += [f"{tight_key(i)} name=tight-{i} scopes=inference tokens_per_hour={b}"
              for i, b in enumerate(budgets)]
    return "\n".join(lines) + "\n"


@dataclass
class Outcome:
    """What one request's client saw."""

    status: int | None = None
    ended: str = "no answer"      # done, error-event, closed (by the client), cut, no answer
    chunks: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""


def stream(base: str, key: str, body: dict[str, Any], close_after: int | None = None
           ) -> Outcome:
    """One stream; `close_after`: the client closes it after that many data events."""
    out = Outcome()
    try:
        with httpx.Client(base_url=base, timeout=REQUEST_S,
                          headers={"authorization": f"Bearer {key}"}) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            out.headers = {k.lower(): v for k, v in r.headers.items()}
            if r.status_code != 200:
                out.text = r.read().decode("utf-8", "replace")
                out.ended = "answer"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.ended = "done"
                    return out
                if line.startswith('data: {"error"'):
                    out.ended = "error-event"
                    return out
                out.chunks += 1
                if close_after is not None and out.chunks >= close_after:
                    out.ended = "closed"
                    return out  # leaving the block closes the connection mid-stream
            out.ended = "cut"
    except httpx.HTTPError as err:
        out.ended = f"no answer: {type(err).__name__}"
    return out


def parallel(calls: list[Callable[[], Outcome]], timeout: float = REQUEST_S + 30
             ) -> list[Outcome | None]:
    """Each call in a thread of its own; None for one still running after `timeout` (hung)."""
    results: list[Outcome | None] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return results


class Ops:
    """The operator cases' instance: `mtpwrap up` with the key file and the stalling NVML."""

    def __init__(self, work: Path, binary: Path, model: Path, budgets: list[int],
                 threads: int | None = None) -> None:
        from mtpwrap.proc import free_loopback_port
        from tests.fuzz.campaign import CONFIG, profile
        from tests.helpers import Instance, cli_env

        work.mkdir(parents=True, exist_ok=True)
        (work / "fuzz.yaml").write_text(profile(threads))
        (work / "mtpwrap.yaml").write_text(CONFIG)
        self.keys = work / "keys"
        self.keys.write_text(key_file(budgets))
        self.keys.chmod(0o600)
        self.budgets = budgets
        self.stall = work / "nvml-stall"
        self.home = work / "home"
        # an empty home: an earlier run's audit lines and budget spend under the same key names
        # would be taken for this run's
        shutil.rmtree(self.home, ignore_errors=True)
        self.log = work / "up.log"
        pythonpath = str(STALLING_NVML) + os.pathsep + cli_env()["PYTHONPATH"]
        self.inst = Instance(self.home, free_loopback_port(), binary, model, log=self.log,
                             profile=str(work / "fuzz.yaml"), MTPWRAP_API_KEY_FILE=str(self.keys),
                             MTPWRAP_CONFIG=str(work / "mtpwrap.yaml"),
                             FAKE_NVML_STALL=str(self.stall), PYTHONPATH=pythonpath)
        self.base = self.inst.base
        self.inst.wait_ready(180)
        self.admin = httpx.Client(base_url=self.base, timeout=30,
                                  headers={"authorization": f"Bearer {ADMIN}"})
        self.added = 0

    def key_tokens(self, name: str) -> float:
        text = self.admin.get("/metrics").text
        return sum(float(m.group(1)) for m in re.finditer(
            rf'^mtpwrap_key_tokens_total\{{key="{name}",kind="[a-z]+"\}} (\S+)$', text, re.M))

    def lines(self, name: str, n: int) -> list[dict[str, Any]]:
        """The key's audit lines, once there are `n`."""
        def mine(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in records if r.get("key") == name]

        return mine(audit_lines(self.home / "audit", lambda rs: len(mine(rs)) >= n, 60))

    def close(self) -> str:
        self.stall.unlink(missing_ok=True)
        self.admin.close()
        self.inst.proc.terminate()
        with contextlib.suppress(Exception):
            self.inst.proc.wait(60)
        self.inst.close()
        return self.log.read_text(errors="replace")


# --------------------------------------------------------------------------- the cases

def case_budget(o: Ops, i: int, rng: random.Random) -> list[str]:
    """A burst of 2-4 parallel streams on tight key i, some closed early by their clients."""
    key, name, limit = tight_key(i), f"tight-{i}", o.budgets[i]
    n = rng.choice((2, 3, 4))
    cuts = [rng.choice((None, 1, 2, 3, 5, 8)) for _ in range(n)]
    got = parallel([lambda c=c: stream(o.base, key, BODY, c) for c in cuts])
    bad: list[str] = []
    where = f"[budget {limit}, cuts {cuts}]"
    if any(g is None for g in got):
        return [f"a request on a budgeted key hung {where}"]
    outs = [g for g in got if g is not None]
    for g in outs:
        if g.status == 429:
            if "retry-after" not in g.headers or not all(
                    part in g.text for part in (repr(name), f"{limit} tokens per hour",
                                                "it resets at")):
                bad.append(f"a budget's 429 without Retry-After, the key, the budget or when "
                           f"it resets {where}")
        elif g.status != 200 or g.ended not in ("done", "closed"):
            bad.append(f"{g.status} {g.ended} on a budgeted key {where}")
    lines = o.lines(name, n)
    # the audit says 499 for a stream its client closed (one that ended before the close is
    # a 200)
    saw = sorted((g.status or 0, g.ended == "closed") for g in outs)
    said = sorted((x["status"] if x["status"] != 499 else 200, x["status"] == 499)
                  for x in lines)
    if len(lines) != n or any(a[0] != b[0] or (b[1] and not a[1]) for a, b in zip(
            saw, said, strict=False)):
        bad.append(f"the audit's statuses {sorted(x['status'] for x in lines)} are not what "
                   f"the clients saw {saw} {where}")
    for x in lines:
        if x["status"] in (200, 499) and not (x["prompt_tokens"] and x["completion_tokens"]):
            bad.append(f"a {'cut' if x['tokens_from'] == 'cut' else 'whole'} stream charged "
                       f"{x['prompt_tokens']} prompt and {x['completion_tokens']} completion "
                       f"tokens {where}")
    charges = [(x["prompt_tokens"] or 0) + (x["completion_tokens"] or 0) for x in lines]
    if (counted := o.key_tokens(name)) != sum(charges):
        bad.append(f"the key's counter says {counted:g} tokens, its audit lines {sum(charges)}")
    if charges and sum(charges) - limit > max(charges):
        bad.append(f"the budget overrun by more than one request: {charges} on {limit} {where}")
    return bad


def case_nvml(o: Ops, rng: random.Random) -> list[str]:
    """NVML hangs while streams run: the probes and the streams answer within their bounds."""
    bad: list[str] = []
    o.stall.touch()
    try:
        with contextlib.suppress(TimeoutError):
            wait_for("the GPU read stale", lambda: o.admin.get("/healthz", timeout=3).json()
                     ["gpu_read"]["state"] == "stale", 20)
        streams = rng.choice((1, 2))
        got: list[Outcome | None] = []

        def streams_run() -> None:
            got.extend(parallel([lambda: stream(o.base, ADMIN, BODY)
                                 for _ in range(streams)]))

        t = threading.Thread(target=streams_run, daemon=True)
        t.start()
        for _ in range(3):
            t0 = time.monotonic()
            try:
                live = httpx.get(o.base + "/livez", timeout=5).status_code
                live_s = time.monotonic() - t0
                t0 = time.monotonic()
                health = o.admin.get("/healthz", timeout=5)
                health_s = time.monotonic() - t0
            except httpx.HTTPError as err:
                bad.append(f"a probe unanswered while NVML hung: {type(err).__name__}")
                break
            if live != 200 or live_s > 1.0:
                bad.append(f"/livez {live} in {live_s:.2f}s while NVML hung")
            if health.status_code != 200 or health_s > 3.0:
                bad.append(f"/healthz {health.status_code} in {health_s:.2f}s while NVML hung")
            elif health.json()["gpu_read"]["state"] != "stale":
                bad.append(f"/healthz says the GPU read is {health.json()['gpu_read']['state']} "
                           "while NVML hung")
            time.sleep(rng.uniform(0.1, 0.5))  # the probes' pace, as a monitor's
        t.join(REQUEST_S + 30)
        if t.is_alive() or any(g is None for g in got):
            bad.append("a stream hung while NVML hung")
        for g in got:
            if g is not None and (g.status != 200 or g.ended != "done"):
                bad.append(f"a stream ended {g.status} {g.ended} while NVML hung")
    finally:
        o.stall.unlink(missing_ok=True)
    try:
        wait_for("the GPU read fresh again", lambda: o.admin.get("/healthz", timeout=3).json()
                 ["gpu_read"]["state"] == "fresh", 20)
    except TimeoutError:
        bad.append("the GPU read not fresh again after NVML answered")
    return bad


def case_reload(o: Ops, rng: random.Random, restart: bool) -> list[str]:
    """`mtpwrap reload` (a key added) or `mtpwrap restart` while 1-3 streams run."""
    what = "restart" if restart else "reload"
    n = rng.choice((1, 2, 3))
    delay = rng.choice((0.0, 0.2, 0.5, 1.0))
    new_key = f"ops-added-{o.added:04d}-0123456789"
    results: list[Outcome | None] = []
    t = threading.Thread(target=lambda: results.extend(
        parallel([lambda: stream(o.base, ADMIN, BODY) for _ in range(n)])), daemon=True)
    t.start()
    time.sleep(delay)  # the signal lands while the streams are queued, reading or answering
    if not restart:
        o.keys.write_text(o.keys.read_text() + f"{new_key} name=added-{o.added}\n")
        o.added += 1
    o.inst.proc.send_signal(signal.SIGUSR2 if restart else signal.SIGHUP)
    t.join(REQUEST_S + 40)
    bad: list[str] = []
    where = f"[{n} stream(s), signal after {delay:g}s]"
    if t.is_alive() or len(results) != n or any(g is None for g in results):
        bad.append(f"a stream hung across a {what} {where}")
    for g in results:
        if g is None:
            continue
        fine = (g.status == 200 and g.ended == "done") or (
            restart and ((g.status == 200 and g.ended == "error-event")
                         or (g.status == 503 and "retry-after" in g.headers)))
        if not fine:
            bad.append(f"a stream ended {g.status} {g.ended} across a {what} {where}")
    try:
        wait_for(f"ready after the {what}", o.inst.ready, 120)
    except TimeoutError:
        return [*bad, f"not ready 120 s after a {what}"]
    if not restart:
        try:
            wait_for("the added key served", lambda: httpx.post(
                o.base + "/tokenize", json={"content": "hi"}, timeout=30,
                headers={"authorization": f"Bearer {new_key}"}).status_code == 200, 30)
        except TimeoutError:
            bad.append(f"the key a reload added is not served {where}")
    return bad


def run_operator(work: Path, binary: Path, model: Path, n: int, seed: int,
                 seconds: float, threads: int | None = None
                 ) -> tuple[int, list[str], dict[str, int], str]:
    """Up to `n` operator cases (or `seconds`), drawn from `seed`: (how many ran, the broken
    promises, the cases by kind, the instance's log). `threads`: llama-server's, if not the
    default."""
    rng = random.Random(seed)
    budgets = [rng.choice((60, 100, 150, TIGHT)) for _ in range(max(1, n))]
    o = Ops(work, binary, model, budgets, threads)
    bad: list[str] = []
    kinds: dict[str, int] = {}
    done = 0
    end = time.monotonic() + seconds
    try:
        order = list(KINDS)  # each kind once first, then drawn
        while done < n and time.monotonic() < end:
            kind = order.pop(0) if order else rng.choice(KINDS)
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "budget":
                found = case_budget(o, done, rng)
            elif kind == "nvml":
                found = case_nvml(o, rng)
            else:
                found = case_reload(o, rng, restart=kind == "restart")
            bad += [f"{kind}: {b}" for b in found]
            with contextlib.suppress(TimeoutError):
                wait_for("llama-server idle", lambda: o.inst.processing(ADMIN) == 0, 30, every=0.2)
            if o.inst.processing(ADMIN):
                bad.append(f"{kind}: llama-server still generating after the case")
            done += 1
    finally:
        log = o.close()
    return done, bad, kinds, log


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.fuzz.operator [--cases N] [--seed N] [--out DIR]`: the operator's cases
    alone, on the build's llama-server and the demo model."""
    import argparse
    import sys

    from mtpwrap.build.manifest import load_manifest
    from mtpwrap.models import known

    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=900)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "fuzz-operator")
    a = ap.parse_args(argv)
    manifest = load_manifest()
    binary = Path(os.environ.get("MTPWRAP_BINARY") or (
        manifest.binary("llama-server") if manifest else "llama-server"))
    t0 = time.monotonic()
    done, bad, kinds, log = run_operator(a.out, binary, known.ensure_demo_model(), a.cases,
                                         a.seed, a.seconds)
    print(f"{done} cases in {time.monotonic() - t0:.1f} s ({kinds}); load "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{log.count('Traceback (most recent call last)')} traceback(s) in the log")
    print("\n".join(bad) or "no broken promise")
    sys.stdout.flush()
    return 1 if bad or "Traceback" in log else 0


if __name__ == "__main__":
    raise SystemExit(main())
