"""Three real nodes (`mtpwrap up --profile cpu-demo`) behind the real HAProxy configured by
`mtpwrap fleet haproxy`, watched by the real Prometheus configured by `mtpwrap fleet prometheus`
with the shipped rules:

- requests spread over every node, and HAProxy's per-node counts agree;
- every query of the Grafana dashboard and every rule evaluates on live data;
- a node drained with SIGTERM (what `systemctl stop` sends) finishes its stream while every new
  request succeeds elsewhere, a node's own 503 being retried by HAProxy;
- a SIGKILLed node costs no request sent after the kill; HAProxy and Prometheus both notice.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, require_tool
from tests.fleet_harness import LocalFleet, answers, chat, wait_for

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "deploy" / "grafana" / "mtpwrap-fleet.json"
#: panels that have no data on the CPU demo (no GPU, no speculation), by design.
EMPTY_ON_CPU_DEMO = {"Speculative acceptance", "GPU memory used"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
          demo_model: Path) -> Iterator[LocalFleet]:
    require_tool("haproxy", "haproxy")
    require_tool("prometheus", "prometheus")
    # A check every 2 s, two to fall: a node leaves the rotation within about 4 s by its
    # checks alone, which leaves the test time to catch HAProxy before it has noticed.
    with LocalFleet(tmp_path_factory.mktemp("fleet"), llama_server_bin, demo_model, 3,
                    check_interval_s=2.0, MTPWRAP_DRAIN_S="60") as f:
        f.start_prometheus(scrape_interval_s=1.0)
        yield f


def burst(base: str, n: int = 6) -> list[httpx.Response]:
    """n requests at once, so that every node, the least busy first, gets some."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: chat(base, max_tokens=16), range(n)))


def moved_away(fleet: LocalFleet, name: str) -> int:
    """Requests HAProxy retried or redispatched away from node `name`."""
    row = fleet.servers()[name]
    return int(row["wretr"] or 0) + int(row["wredis"] or 0)


def test_requests_spread_and_dashboard_and_rules_evaluate(fleet: LocalFleet) -> None:
    served: Counter[str] = Counter()
    for _ in range(6):
        r = chat(fleet.base)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        served[r.headers["x-mtpwrap-node"]] += 1
    with httpx.stream("POST", f"{fleet.base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 16,
            "stream": True}) as s:
        assert s.status_code == 200 and "data: [DONE]" in s.read().decode()
        served[s.headers["x-mtpwrap-node"]] += 1
    assert set(served) == set(fleet.names), served
    rows = fleet.servers()
    assert {n: int(rows[n]["hrsp_2xx"]) for n in fleet.names} == dict(served)

    # Prometheus has scraped the requests above once its count of them is complete.
    wait_for("Prometheus scraped every request", lambda: [r["value"][1] for r in fleet.query(
        'sum(mtpwrap_requests_total{status="200"})')] == ["7"], 30)
    wait_for("the recording rules count three serving nodes", lambda: bool(fleet.query(
        "mtpwrap:nodes_serving == 3")), 10)

    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            result = fleet.query(expr)  # an invalid expression fails the API call
            if panel["title"] not in EMPTY_ON_CPU_DEMO:
                assert result, f"{panel['title']!r}: {expr} returned no data"

    groups = fleet.prom("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 10 and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]


def test_drain_then_kill_loses_no_new_request(fleet: LocalFleet) -> None:
    # --- drain: a stream is in flight on node A when A gets SIGTERM.
    with httpx.stream("POST", f"{fleet.base}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
            "max_tokens": 48, "stream": True, "temperature": 0,
            "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        a = stream.headers["x-mtpwrap-node"]
        lines = stream.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: "))
        node_a = fleet.nodes[a]
        node_a.proc.send_signal(signal.SIGTERM)
        wait_for(f"{a} draining", lambda: answers(f"{node_a.base}/readyz", 503), 5, 0.01)
        assert fleet.status_of(a).startswith("UP")  # still in rotation: HAProxy has not seen it

        replies = burst(fleet.base)
        assert [r.status_code for r in replies] == [200] * len(replies)
        assert a not in {r.headers["x-mtpwrap-node"] for r in replies}
        assert moved_away(fleet, a) > 0  # A answered 503 and HAProxy retried elsewhere

        rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(next(ln for ln in reversed(rest) if ln.startswith("data: {"))[6:])
        assert last["choices"][0]["finish_reason"] == "length"
    wait_for(f"HAProxy takes {a} out", lambda: fleet.status_of(a).startswith("DOWN"), 10)
    assert node_a.proc.wait(30) == 0

    # --- kill: node B vanishes with no warning.
    b, c = (n for n in fleet.names if n != a)
    before = moved_away(fleet, b)
    fleet.nodes[b].proc.kill()
    fleet.nodes[b].proc.wait(10)
    replies = burst(fleet.base)
    assert [r.status_code for r in replies] == [200] * len(replies)
    assert {r.headers["x-mtpwrap-node"] for r in replies} == {c}
    assert moved_away(fleet, b) > before  # refused connections went to C
    wait_for(f"HAProxy takes {b} out", lambda: fleet.status_of(b).startswith("DOWN"), 10)

    def down_alert_pending() -> bool:
        alerts = fleet.prom("alerts")["alerts"]
        return any(x["labels"]["alertname"] == "MtpwrapNodeDown"
                   and x["labels"].get("node") == b for x in alerts)

    wait_for("Prometheus sees the fleet shrink", lambda: bool(fleet.query(
        "mtpwrap:nodes_serving == 1")), 15)
    wait_for(f"MtpwrapNodeDown pending for {b}", down_alert_pending, 15)
    assert chat(fleet.base).headers["x-mtpwrap-node"] == c
