"""Three real nodes (`mtpwrap up --profile cpu-demo`, each requiring an API key) behind the real
HAProxy configured by `mtpwrap fleet haproxy`, watched by the real Prometheus configured by
`mtpwrap fleet prometheus` with the shipped rules:

- requests spread over every node, and HAProxy's per-node counts agree; the client's API key
  reaches the nodes untouched (a wrong one is refused by the node, through HAProxy);
- every query of the Grafana dashboard and every rule evaluates on live data;
- a token stream through HAProxy is as smooth as straight from the node (`option http-no-delay`);
- under a bounded load at concurrency 8: one node SIGKILLed and later started again, another
  drained with SIGTERM (what `systemctl stop` sends). Only requests in flight on the killed
  node may fail; the drained node causes no error; HAProxy takes the dead node out within
  ~3 s and back once it is ready; Prometheus fires MtpwrapNodeDown for it.

And two nodes of the tiny hybrid qwen35 (one slot, a shared `persist.dir`) behind HAProxy as
rendered by default: two chats, each with its own ~8K-token document and Open WebUI's chat id
header; each chat's second question re-reads only its question (back to a checkpoint).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.fleet_harness import LocalFleet, answers, chat, p99
from tests.helpers import REPO, require_tool, tiny_hybrid_profile, wait_for

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "deploy" / "grafana" / "mtpwrap.json"
#: panels that have no data on the CPU demo (no GPU, no speculation), by design.
EMPTY_ON_CPU_DEMO = {"Speculative acceptance", "Speculative acceptance by draft position",
                     "GPU memory used", "GPU utilisation", "GPU power"}
KEY = "sk-fleet-Key_0123456789"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
          demo_model: Path) -> Iterator[LocalFleet]:
    require_tool("haproxy", "haproxy")
    require_tool("prometheus", "prometheus")
    # The shipped defaults: a check every second, two to fall, two to rise. MtpwrapNodeDown
    # waits 5 s here instead of a minute, so that the test sees it fire.
    with LocalFleet(tmp_path_factory.mktemp("fleet"), llama_server_bin, demo_model, 3,
                    haproxy_args=("--affinity-header", "X-Session-Id"), api_key=KEY,
                    MTPWRAP_DRAIN_S="60") as f:
        f.start_prometheus(scrape_interval_s=1.0, alert_for={"MtpwrapNodeDown": "5s"})
        yield f


def test_requests_spread_and_dashboard_and_rules_evaluate(fleet: LocalFleet) -> None:
    served: Counter[str] = Counter()
    for _ in range(6):
        r = fleet.chat()
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        served[r.headers["x-mtpwrap-node"]] += 1
    with httpx.stream("POST", f"{fleet.base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 16,
            "stream": True}, headers={"Authorization": f"Bearer {KEY}"}) as s:
        assert s.status_code == 200 and "data: [DONE]" in s.read().decode()
        served[s.headers["x-mtpwrap-node"]] += 1
    assert set(served) == set(fleet.names), served
    rows = fleet.servers()
    assert {n: int(rows[n]["hrsp_2xx"]) for n in fleet.names} == dict(served)
    # The key is the nodes' business: HAProxy passes it on as sent, and the nodes judge it.
    for key in (None, KEY.upper(), KEY[:-1]):
        refused = chat(fleet.base, key=key)
        assert refused.status_code == 401 and "x-mtpwrap-node" in refused.headers, key

    # Prometheus has scraped the requests above once its count of them is complete.
    wait_for("Prometheus scraped every request", lambda: [r["value"][1] for r in fleet.query(
        'sum(mtpwrap_requests_total{status="200"})')] == ["7"], 30)
    wait_for("the recording rules count three serving nodes", lambda: bool(fleet.query(
        "mtpwrap:nodes_serving == 3")), 10)

    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            fleet.query(expr)  # an invalid expression fails the API call
            if panel["title"] not in EMPTY_ON_CPU_DEMO:
                # A scrape can fail on a busy machine (its timeout is the 1 s interval), so a
                # rate may need a few more rounds of samples: poll, bounded.
                wait_for(f"{panel['title']!r}: {expr} returns data",
                         lambda e=expr: bool(fleet.query(e)), 30)

    groups = fleet.prom("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 10 and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]


def test_stream_through_haproxy_is_as_smooth_as_direct(fleet: LocalFleet) -> None:
    """Without `option http-no-delay` HAProxy 2.6 delivered SSE chunks in bunches (p99 gap
    ~215 ms against ~15 ms direct); with it, the gaps through HAProxy are the node's own."""
    def gaps(base: str) -> tuple[list[float], str]:
        stamps: list[float] = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Tell a story about a river."}],
                "max_tokens": 48, "stream": True, "temperature": 0, "ignore_eos": True},
                headers={"Authorization": f"Bearer {KEY}"}) as s:
            assert s.status_code == 200
            node = s.headers.get("x-mtpwrap-node", "direct")
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
        assert len(stamps) >= 40, len(stamps)
        return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)], node

    through, node = gaps(fleet.base)
    direct, _ = gaps(fleet.nodes[node].base)
    print(f"\nSSE inter-chunk p99: direct {p99(direct) * 1000:.0f} ms, "
          f"through HAProxy {p99(through) * 1000:.0f} ms")
    assert p99(through) < 1.5 * p99(direct) + 0.05, (p99(direct), p99(through))


@dataclass
class Outcome:
    start: float
    end: float
    node: str | None  # the X-Mtpwrap-Node that answered, when any did
    stream: bool
    ok: bool
    why: str = ""


class Load:
    """`concurrency` clients sending chat requests back to back, half of them streamed, until
    told to stop (or `limit` requests, or `deadline_s`)."""

    def __init__(self, fleet: LocalFleet, concurrency: int = 8, limit: int = 2000,
                 deadline_s: float = 240) -> None:
        self.fleet, self.limit, self.deadline = fleet, limit, time.monotonic() + deadline_s
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def _next(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self.sent >= self.limit or time.monotonic() > self.deadline:
                return False
            self.sent += 1
            return True

    def _client(self, i: int) -> None:
        stream = i % 2 == 1
        while self._next():
            t0, node, ok, why = time.monotonic(), None, False, ""
            try:
                with httpx.stream("POST", f"{self.fleet.base}/v1/chat/completions",
                                  timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                                  json={"messages": [{"role": "user", "content": "Hi."}],
                                        "max_tokens": 12, "stream": stream,
                                        "temperature": 0}) as r:
                    node = r.headers.get("x-mtpwrap-node")
                    body = r.read().decode()
                    ok = r.status_code == 200 and (not stream or "data: [DONE]" in body)
                    why = "" if ok else f"{r.status_code} {body[-120:]!r}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            with self._lock:
                self.outcomes.append(Outcome(t0, time.monotonic(), node, stream, ok, why))

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return self.outcomes


def test_kill_restart_and_drain_under_load(fleet: LocalFleet) -> None:
    def status(name: str) -> str:
        return fleet.status_of(name)

    a, b, c = fleet.names  # b is killed and started again, a is drained, c stays
    load = Load(fleet)
    try:
        wait_for("the load reaches every node", lambda: {
            o.node for o in list(load.outcomes) if o.ok} == set(fleet.names), 60)

        # --- SIGKILL b's mtpwrap (llama-server dies with it).
        in_flight_on_b = int(fleet.servers()[b]["scur"])
        killed_at = time.monotonic()
        fleet.nodes[b].proc.kill()
        fleet.nodes[b].proc.wait(10)
        removed_s = wait_for(f"HAProxy takes {b} out", lambda: status(b).startswith("DOWN"),
                             10, 0.05)

        def firing() -> bool:
            return any(x["labels"]["alertname"] == "MtpwrapNodeDown"
                       and x["labels"].get("node") == b and x["state"] == "firing"
                       for x in fleet.prom("alerts")["alerts"])

        alert_s = removed_s + wait_for(f"MtpwrapNodeDown firing for {b}", firing, 30, 0.2)

        # --- start b again, on its home and port.
        node_b = fleet.start_node(b, fleet.nodes[b].port)
        ready_s = wait_for(f"{b} ready again", lambda: answers(f"{node_b.base}/readyz"),
                           180, 0.05)
        readded_s = wait_for(f"HAProxy takes {b} back", lambda: status(b) == "UP", 10, 0.05)
        back_at = time.monotonic()
        wait_for(f"{b} serves again", lambda: any(
            o.node == b and o.start > back_at and o.ok for o in list(load.outcomes)), 30)

        # --- SIGTERM a: it drains (its /readyz says 503) and exits once its requests are done.
        drained_at = time.monotonic()
        fleet.nodes[a].proc.send_signal(signal.SIGTERM)
        assert fleet.nodes[a].proc.wait(90) == 0
        wait_for(f"HAProxy takes {a} out", lambda: status(a).startswith("DOWN"), 10, 0.05)
        after_drain = len(load.outcomes)
        wait_for("the load goes on without a", lambda: len(load.outcomes) > after_drain + 16,
                 60)
    finally:
        outcomes = load.stop()

    failed = [o for o in outcomes if not o.ok]
    report = {
        "sent": load.sent, "completed": sum(o.ok for o in outcomes), "failed": len(failed),
        "in flight on the killed node": in_flight_on_b,
        "served by node": dict(Counter(o.node for o in outcomes if o.ok)),
        "kill -> HAProxy DOWN s": round(removed_s, 2),
        "kill -> MtpwrapNodeDown firing s": round(alert_s, 1),
        "restarted node ready -> HAProxy UP s": round(readded_s, 2),
        "restart -> ready s": round(ready_s, 1),
        "failures": [(o.node, o.stream, round(o.start - killed_at, 2),
                      round(o.end - killed_at, 2), o.why) for o in failed],
    }
    print("\nfleet under load:", json.dumps(report, indent=1))
    assert len(outcomes) == load.sent  # every request ended, none hung
    # HAProxy's `scur`, read just before the kill, is in the report only: its sample can miss a
    # stream that is already on b (seen: 0 with one stream 0.5 s in); the client's own record of
    # each request decides.
    for o in failed:  # each one was on b when it died: begun before the kill, ended after it
        assert o.node in (b, None) and o.start < killed_at <= o.end + 0.05, report
    assert not [o for o in outcomes if o.node == a and not o.ok], report  # drain: no error
    assert not [o for o in failed if o.start > drained_at - 0.05], report
    assert removed_s < 3.5, report
    assert readded_s < 4, report  # rise 2 x inter 1 s, and a check's own time


#: what a chat's next question may re-read of its document: the checkpoint spacing (1,024
#: tokens) and a short question in its chat template
REREAD = 1024 + 96


def document(name: str, clauses: int = 200) -> str:
    """About 8K tokens of contract, different for each name (as tests/test_documents_real.py)."""
    return " ".join(f"{name} clause {i}: the party of part {i % 5} shall deliver item {i * 7} "
                    f"by day {i % 28 + 1}." for i in range(clauses))


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny hybrid qwen35 with its MTP head (the flagship's architecture), one slot, one
    thread (the nodes share the machine's cores)."""
    path = tiny_hybrid_profile(tmp_path_factory.mktemp("fleet-documents"), "tiny-fleet")
    yield path
    Path(yaml.safe_load(path.read_text())["model"]).unlink()


def test_each_chat_goes_back_to_the_node_that_read_its_document(
        tmp_path: Path, llama_server_bin: Path, tiny_profile: Path) -> None:
    """Two chats asked in the order a, b, b, a (leastconn alone would send each second question
    to the other node). The default configuration keeps each chat on the node that read its
    document, so its second question re-reads at most the checkpoint spacing; the shared store
    would give the same bound on the other node, by a restore."""
    require_tool("haproxy", "haproxy")
    model = Path(yaml.safe_load(tiny_profile.read_text())["model"])
    with LocalFleet(tmp_path, llama_server_bin, model, 2, profile=str(tiny_profile),
                    MTPWRAP_PERSIST_DIR=str(tmp_path / "shared-store")) as fleet:
        client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        docs = {"chat-a": document("Alpha"), "chat-b": document("Bravo")}
        history: dict[str, list[dict[str, str]]] = {c: [] for c in docs}
        asked: dict[str, list[tuple[str, int, int]]] = {c: [] for c in docs}  # node, read, of

        def ask(chat: str, question: str) -> None:
            messages = history[chat]
            messages.append({"role": "user", "content": question if messages else
                             f"{docs[chat]}\n\nQuestion: {question}"})
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=1, temperature=0,  # type: ignore[arg-type]
                extra_headers={"X-OpenWebUI-Chat-Id": chat, "X-OpenWebUI-User-Id": chat[-1]})
            answer = raw.parse()
            assert answer.usage is not None
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})
            asked[chat].append((raw.headers["x-mtpwrap-node"],
                                int((answer.model_extra or {})["timings"]["prompt_n"]),
                                answer.usage.prompt_tokens))

        for chat, question in (("chat-a", "Which clause names day 9?"),
                               ("chat-b", "Which clause names day 9?"),
                               ("chat-b", "Who delivers item 70?"),
                               ("chat-a", "Who delivers item 70?")):
            ask(chat, question)
        print("\nnode, tokens read, prompt tokens per question:", json.dumps(asked))
        for (node, read, tokens), (again, reread, _) in asked.values():
            assert read >= tokens - 8 and tokens > 6000, asked  # the first reads it whole
            assert reread <= REREAD, asked
            assert again == node, asked  # the chat went back to the node that read it
        assert {nodes[0][0] for nodes in asked.values()} == set(fleet.names), asked
