"""`mtpwrap reload` / `restart` on the real llama-server and the demo model: the swap behind
the front, refusals that leave the running child alone, and long contexts carried across the
restart by the document store (`timings.prompt_n` of the next request says how much was recomputed).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mtpwrap import proc
from tests.helpers import REPO, cli_env, run_cli, wait_for, wait_ready, without

pytestmark = pytest.mark.integration

DEMO_PROFILE = REPO / "profiles" / "cpu-demo.yaml"
#: the document store keeps prompts of this many tokens or more (persist.min_tokens, 4,096 by
#: default): low here, so a document of a few hundred tokens is one it keeps
MIN_TOKENS = 256
#: ~550 tokens of varied text (two of the store's 256-token blocks and more): over MIN_TOKENS,
#: and 20 times the question asked after it. Each read of it costs this CPU seconds: no longer.
LONG = " ".join(f"Clause {i}: the party of the {['first', 'second', 'third'][i % 3]} part shall "
                f"deliver item {i * 7} by day {i % 28 + 1}." for i in range(24))


class Served:
    """`mtpwrap up --config FILE` with a profile file the test can change, then reload."""

    def __init__(self, tmp: Path, port: int, binary: Path, model: Path,
                 persist: dict | None = None, **env: str) -> None:
        self.tmp, self.port, self.model = tmp, port, model
        self.profile = tmp / "profile.yaml"
        self.set_profile()
        self.config = tmp / "mtpwrap.yaml"
        self.config.write_text(yaml.safe_dump({
            "profile": str(self.profile), "model": str(model), "binary": str(binary),
            "port": port, "drain_s": 20,
            "supervisor": {"backoff_initial_s": 0.5},
            # A reload on this shared CPU takes a while: queued requests may wait for it.
            "proxy": {"queue_timeout_s": 120},
            "persist": {"min_tokens": MIN_TOKENS, **(persist or {})},
        }))
        self.env = cli_env(MTPWRAP_HOME=str(tmp / "home"), MTPWRAP_CONFIG=str(self.config),
                           **env)
        self.log = tmp / "up.log"
        self.process = proc.start([sys.executable, "-m", "mtpwrap", "up"], env=self.env,
                                  cwd=REPO, stdout=self.log.open("w"), stderr=proc.STDOUT,
                                  text=True)
        self.proc = self.process.popen  # signals to mtpwrap alone, as systemd sends them
        self.base = f"http://127.0.0.1:{port}"
        key = env.get("MTPWRAP_API_KEYS")
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def set_profile(self, **changes: object) -> None:
        # one slot: the document store serves a launch of one (front/store.py)
        data = {**yaml.safe_load(DEMO_PROFILE.read_text()), "slots": 1}
        data.update(changes)
        self.profile.write_text(yaml.safe_dump(data))

    def state(self) -> dict:
        return json.loads((self.tmp / "home" / "state" / "instance.json").read_text())

    def snapshot_dir(self) -> Path:
        return self.tmp / "home" / "documents"

    def wait_ready(self, timeout: float = 120) -> None:
        wait_ready(self.base, self.proc, self.log.read_text, timeout)

    def complete(self, prompt: str, n: int = 4) -> dict:
        r = httpx.post(f"{self.base}/v1/completions", timeout=120, headers=self.auth, json={
            "model": "demo", "prompt": prompt, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def reload(self, command: str = "reload") -> proc.Completed:
        return run_cli(command, env=self.env, timeout=300)

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base}/metrics", timeout=10, headers=self.auth).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        raise AssertionError(f"{name} {labels} not in /metrics")

    def close(self) -> None:
        self.process.kill()


MakeServed = Callable[..., Served]


@pytest.fixture
def make_served(tmp_path: Path, llama_server_bin: Path, demo_model: Path,
                free_port: int) -> Iterator[object]:
    started: list[Served] = []

    def make(persist: dict | None = None, **env: str) -> Served:
        s = Served(tmp_path, free_port, llama_server_bin, demo_model, persist=persist, **env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.close()


def prompt_n(reply: dict) -> int:
    """Prompt tokens llama-server processed for this request (not taken from its cache)."""
    usage = reply["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "timings" in reply:
        return int(reply["timings"]["prompt_n"])
    return int(usage["prompt_tokens"]) - int(cached)


def test_reload_carries_a_long_context_into_the_new_child(make_served: MakeServed) -> None:
    s = make_served()
    s.wait_ready()
    first = s.complete(LONG)
    full = prompt_n(first)
    assert full >= 2 * MIN_TOKENS, first["usage"]  # a document the store keeps
    child = s.state()["child_pid"]
    assert stat.S_IMODE(s.snapshot_dir().stat().st_mode) == 0o700

    # a new command line (a reload that leaves it as it is leaves llama-server running)
    s.set_profile(description="the same demo, reloaded", ubatch=256)
    r = s.reload()
    assert r.returncode == 0, r.stderr
    st = s.state()
    assert st["child_pid"] != child and st["state"] == "ready"
    assert st["reload"]["result"] == "ok" and st["reload"]["generation"] == 1
    again = s.complete(LONG + " Question: which item is due on day 3?")
    assert prompt_n(again) < 0.05 * full, again.get("timings") or again["usage"]
    health = httpx.get(f"{s.base}/healthz", timeout=10).json()
    # kept once, after its first read, and restored into the new child before the question
    assert (health["store"]["saved"], health["store"]["restored"]) == (1, 1), health["store"]
    assert health["store"]["last_restore"]["tokens"] >= full
    assert health["reload"]["result"] == "ok"
    assert s.metric("mtpwrap_reloads_total", outcome="ok") == 1
    out = run_cli("status", env=s.env)
    assert "last reload" in out.stdout and "ok" in out.stdout

    r = run_cli("down", env=s.env, timeout=60)
    assert r.returncode == 0 and s.proc.wait(30) == 0
    # the store outlives the service: the next `up` finds the document
    assert len([p for p in s.snapshot_dir().iterdir() if p.suffix == ".json"]) == 1


def test_reload_without_persistence_recomputes_the_prompt(make_served: MakeServed) -> None:
    s = make_served(persist={"enabled": False})
    s.wait_ready()
    full = prompt_n(s.complete(LONG))
    assert full >= 2 * MIN_TOKENS  # a document the store would keep, were it on
    s.set_profile(ubatch=256)  # a new command line: llama-server is restarted
    r = s.reload()
    assert r.returncode == 0, r.stderr
    again = s.complete(LONG + " Question: which item is due on day 3?")
    assert prompt_n(again) >= full
    assert s.state()["persist_dir"] is None
    assert not s.snapshot_dir().exists()


def test_invalid_reload_is_refused_and_the_child_is_untouched(make_served: MakeServed) -> None:
    s = make_served()
    s.wait_ready()
    child = s.state()["child_pid"]
    s.set_profile(kv={"k": ["f17"], "v": ["f16"]})
    r = s.reload()
    assert r.returncode == 78, r.stderr
    assert "Traceback" not in r.stderr and "f17" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1
    assert (s.state().get("reload") or {}).get("generation", 0) == 0  # never signalled

    # The running instance checks again: a SIGHUP with the same bad profile is refused there.
    os.kill(s.proc.pid, signal.SIGHUP)
    wait_for("the reload's result",
             lambda: (s.state().get("reload") or {}).get("result") not in (None, "running"), 60)
    st = s.state()
    assert st["reload"]["result"] == "refused" and "f17" in st["reload"]["message"]
    assert st["child_pid"] == child and st["state"] == "ready"
    assert s.metric("mtpwrap_reloads_total", outcome="refused") == 1
    assert s.complete("Say hello.")["choices"][0]["text"] is not None


def test_a_new_child_that_does_not_start_brings_the_old_one_back(make_served: MakeServed) -> None:
    s = make_served()
    s.wait_ready()
    bad = s.tmp / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 4096)
    cfg = yaml.safe_load(s.config.read_text())
    cfg["model"] = str(bad)
    s.config.write_text(yaml.safe_dump(cfg))
    r = s.reload()
    assert r.returncode == 1, r.stderr
    assert "previous configuration" in r.stderr and "Traceback" not in r.stderr
    s.wait_ready(60)
    st = s.state()
    assert st["reload"]["result"] == "failed" and st["model"] == str(s.model)
    cmdline = Path(f"/proc/{st['child_pid']}/cmdline").read_bytes().split(b"\0")
    assert str(s.model).encode() in cmdline
    assert s.complete("Say hello.")["choices"]


def test_reload_under_load_fails_no_request(make_served: MakeServed, llama_server_bin: Path,
                                            demo_model: Path) -> None:
    s = make_served()
    s.wait_ready()
    failures: list[str] = []
    refused: list[str] = []
    done = threading.Event()
    finished: list[float] = []

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not done.is_set():
                try:
                    r = c.post(f"{s.base}/v1/completions", json={
                        "model": "demo", "prompt": "Count to five:", "max_tokens": 8,
                        "temperature": 0})
                except httpx.ConnectError as exc:
                    refused.append(str(exc))
                    continue
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                finished.append(time.monotonic())

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        wait_for("the load under way", lambda: len(finished) >= 8, 60)
        s.set_profile(slots=1, context=2048)
        r = s.reload()
        reloaded = time.monotonic()
        wait_for("the load served by the new child",
                 lambda: sum(t > reloaded for t in finished) >= 8, 60)
    finally:
        done.set()
        for t in threads:
            t.join(150)
    assert r.returncode == 0, r.stderr
    assert failures == [] and refused == []
    assert len(finished) >= 8 and any(t > reloaded for t in finished)
    shown = run_cli("args", "--profile", str(s.profile), "--binary", str(llama_server_bin),
                    "--model", str(demo_model), env=s.env)
    assert shown.returncode == 0, shown.stderr
    cmdline = [a.decode() for a in Path(f"/proc/{s.state()['child_pid']}/cmdline")
               .read_bytes().split(b"\0") if a]
    line = next(x for x in shown.stdout.splitlines() if x.startswith(str(llama_server_bin)))
    # The child also gets its internal port and mtpwrap's snapshot directory. Its RAM cache
    # is sized from the RAM available when the service started (a reload keeps that reading);
    # `args` reads the RAM of its own moment, which the load has moved.
    shown_argv, cram = shlex.split(line), ("-cram", "--cache-ram")
    assert {*cram} & {*cmdline} and {*cram} & {*shown_argv}
    assert without(cmdline, "--port", "--slot-save-path", *cram) == without(
        shown_argv, "--port", *cram)
    assert "-np 1" in line and "-c 2048" in line


def test_a_document_kept_before_a_crash_is_restored_after_it(make_served: MakeServed) -> None:
    s = make_served(MTPWRAP_API_KEYS="client-key-0123")
    s.wait_ready()
    full = prompt_n(s.complete(LONG))
    wait_for("the document kept", lambda: any(
        p.suffix == ".json" for p in s.snapshot_dir().iterdir()), 60, every=0.2)
    files = list(s.snapshot_dir().iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    # No client reaches the snapshots: /slots needs the key and stays off even with it, and
    # naming a real snapshot file does not restore (or erase) it.
    assert httpx.get(f"{s.base}/slots", timeout=10).status_code == 401
    assert httpx.get(f"{s.base}/slots", timeout=10, headers=s.auth).status_code == 403
    for action in ("restore", "erase", "save"):
        r = httpx.post(f"{s.base}/slots/0?action={action}", headers=s.auth, timeout=10,
                       json={"filename": files[0].name})
        assert r.status_code == 403, r.text
    assert sorted(s.snapshot_dir().iterdir()) == sorted(files)
    child = s.state()["child_pid"]
    os.kill(child, signal.SIGKILL)
    wait_for("ready again on a new child",
             lambda: s.state()["child_pid"] != child and s.state()["state"] == "ready", 70)
    st = s.state()
    assert st["last_exit"] == "signal 9 (SIGKILL)"
    again = s.complete(LONG + " Question: which item is due on day 3?")
    assert prompt_n(again) < 0.05 * full, again.get("timings") or again["usage"]
    assert httpx.get(f"{s.base}/healthz", timeout=10, headers=s.auth).json()["store"][
        "restored"] == 1
    assert sorted(s.snapshot_dir().iterdir()) == sorted(files)  # kept once, not again


def test_a_reload_puts_the_whole_service_on_the_new_settings(
        tmp_path: Path, isolated_home: Path, llama_server_bin: Path, demo_model: Path,
        free_port: int) -> None:
    """The service run in this process on the real llama-server: a reload that changes the
    supervisor's settings and the drain budget, and not llama-server's command line, leaves
    llama-server running and every part of the service on the new values; the restart policy
    the next crash meets is the new one."""
    import asyncio

    from mtpwrap.config import settings
    from mtpwrap.service import reload as reloading
    from mtpwrap.service import server, startup
    from mtpwrap.supervision import instance
    from mtpwrap.supervision.state import State
    from tests.helpers import until

    cfg = tmp_path / "mtpwrap.yaml"

    def write(drain_s: float, **supervisor: float) -> None:
        cfg.write_text(yaml.safe_dump({
            "profile": "cpu-demo", "model": str(demo_model), "binary": str(llama_server_bin),
            "port": free_port, "drain_s": drain_s, "persist": {"enabled": False},
            "supervisor": supervisor}))

    write(20, backoff_initial_s=0.5, stop_grace_s=10, wedge_s=60, max_failures=5)
    first = settings.load_settings({}, env={}, config=cfg)
    svc = server.Service(startup.load_runtime(first), server.bind_public("127.0.0.1", free_port))
    new = (2.5, 4.0, 30.0, 4)

    def values(c: object) -> tuple[object, ...]:
        return tuple(getattr(c, k) for k in ("backoff_initial_s", "stop_grace_s", "wedge_s",
                                             "max_failures"))

    async def scenario() -> None:
        serving = asyncio.create_task(svc.serve())
        assert await svc.sup.wait_ready(120) is not None, svc.sup.status().reason
        pid = svc.sup.status().pid
        assert pid is not None and values(svc.sup.config) == (0.5, 10.0, 60.0, 5)
        write(7, backoff_initial_s=2.5, stop_grace_s=4, wedge_s=30, max_failures=4)
        svc.handle_reload(reloading.ReloadKind.RELOAD)
        await until("the reload's answer", lambda: svc.reload_state.result not in (
            None, reloading.ReloadOutcome.RUNNING), 120)
        assert svc.reload_state.result is reloading.ReloadOutcome.OK, svc.reload_state.message
        assert reloading.UNCHANGED in str(svc.reload_state.message)
        st = svc.sup.status()
        assert st.pid == pid and st.restarts == 0 and st.state is State.READY
        assert svc.runtime.settings.drain_s == 7
        for c in (svc.config, svc.sup.config, svc.sup._policy.config, svc.runtime.supervisor):
            assert values(c) == new
        await until("the state file's new budgets", lambda: (
            instance.read_instance() or {}).get("stop_grace_s") == 4, 10)
        assert (instance.read_instance() or {})["drain_s"] == 7

        # a crash now: the restart policy it meets is the new one
        backoff: list[str | None] = []
        svc.sup.add_listener(lambda old, state, why: backoff.append(why)
                             if state is State.BACKOFF else None)
        os.kill(pid, signal.SIGKILL)
        await until("the crash's backoff", lambda: bool(backoff), 30)
        assert str(backoff[0]).endswith("restarting in 2.5s"), backoff
        svc.handle_exit(signal.SIGTERM)
        assert await asyncio.wait_for(serving, 60) == 0

    asyncio.run(asyncio.wait_for(scenario(), 300))
