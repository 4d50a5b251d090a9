"""`mtpwrap fleet`: what it writes is accepted by the real HAProxy and Prometheus tools, bad input
gets one sentence and exit 78, and the shipped alert rules behave as promtool evaluates them."""

from __future__ import annotations

import contextlib
import csv
import http.server
import io
import json
import shutil
import ssl
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mtpwrap.proc import free_loopback_port
from tests.helpers import REPO, cli_env, require_tool, run_cli, wait_for

RULES = REPO / "deploy" / "prometheus" / "mtpwrap-rules.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "mtpwrap-rules.test.yml"
#: the header Open WebUI sends with each request of a chat (ENABLE_FORWARD_USER_INFO_HEADERS)
CHAT = "X-OpenWebUI-Chat-Id"


def test_haproxy_config_passes_haproxy_check(tmp_path: Path) -> None:
    require_tool("haproxy", "haproxy")
    out = tmp_path / "haproxy.cfg"
    r = run_cli("fleet", "haproxy", "--node", "gpu1=127.0.0.1:8081", "--node", "[::1]:8082",
                "--admin-socket", str(tmp_path / "admin.sock"), "--check-interval-s", "0.5",
                "--check", "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "server gpu1 127.0.0.1:8081" in text and "server node2 [::1]:8082" in text
    assert "inter 500ms" in text
    assert f"stick on req.hdr({CHAT})" in text and "balance leastconn" in text  # the default
    check = subprocess.run(["haproxy", "-c", "-f", str(out)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0 and "WARNING" not in check.stderr, check.stderr


def test_haproxy_check_reports_what_haproxy_rejects(tmp_path: Path) -> None:
    require_tool("haproxy", "haproxy")
    from mtpwrap.errors import ConfigError
    from mtpwrap.front import fleet

    text = fleet.render_haproxy(fleet.parse_nodes(["127.0.0.1:8081"]), fleet.HaproxyOptions())
    fleet.check_haproxy(text)
    with pytest.raises(ConfigError, match="haproxy -c rejected.*balance"):
        fleet.check_haproxy(text.replace("balance leastconn", "balance fewest"))


def test_check_without_haproxy_says_what_to_install(tmp_path: Path) -> None:
    python_only = tmp_path / "bin"
    python_only.mkdir()
    r = run_cli("fleet", "haproxy", "--node", "127.0.0.1:8081", "--check",
                env=cli_env(PATH=str(python_only)))
    assert r.returncode == 69 and "apt-get install haproxy" in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    ([], "no nodes"),
    (["--node", "10.0.0.5"], "node '10.0.0.5': expected [NAME=]HOST:PORT"),
    (["10.0.0.5"], "node '10.0.0.5': expected [NAME=]HOST:PORT"),
    (["--node", "10.0.0.5:99999"], "port from 1 to 65535"),
    (["--node", "a=10.0.0.5:1", "--node", "a=10.0.0.6:1"], "the name 'a' is given twice"),
    (["--node", "10.0.0.5:1", "--node", "x=10.0.0.5:1"], "the address '10.0.0.5:1' is given"),
    (["10.0.0.5:1", "--node", "10.0.0.5:1,slots=2"], "the address '10.0.0.5:1' is given"),
    (["--node", "bad name=10.0.0.5:1"], "the name 'bad name' must be"),
    (["10.0.0.5:1,slots=0"], "node '10.0.0.5:1,slots=0': slots must be a whole number of at "
                             "least 1, got '0'"),
    (["10.0.0.5:1,slots=four"], "node '10.0.0.5:1,slots=four': slots must be a whole number"),
    (["10.0.0.5:1,weight=257"], "node '10.0.0.5:1,weight=257': weight must be a whole number "
                                "from 0 to 256, got '257'"),
    (["10.0.0.5:1,speed=2"], "node '10.0.0.5:1,speed=2': 'speed=2' is not slots=N or weight=W"),
    (["10.0.0.5:1,slots"], "node '10.0.0.5:1,slots': 'slots' is not slots=N or weight=W"),
    (["10.0.0.5:1,slots=1,slots=2"], "node '10.0.0.5:1,slots=1,slots=2': slots is given twice"),
    (["10.0.0.5:1", "--fall", "0"], "--fall: must be at least 1, got 0"),
    (["10.0.0.5:1", "--bind", "8000"], "--bind '8000': expected HOST:PORT"),
    (["10.0.0.5:1", "--affinity-header", "X Chat"], "--affinity-header 'X Chat': expected a "
                                                    "header name"),
])
def test_bad_input_is_one_sentence_and_exit_78(args: list[str], needle: str) -> None:
    r = run_cli("fleet", "haproxy", *args)
    assert r.returncode == 78, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


INVENTORY = """\
# Two workstations and a node-pool GPU.
- {name: gpu1, host: 10.0.0.5, port: 8080, slots: 4, weight: 3}
- {host: 10.0.0.6, port: 8080, slots: 2, weight: 1}
- {host: "::1", port: 8082, slots: 1, weight: 0}
"""


def test_slots_and_weight_become_maxconn_and_weight(tmp_path: Path) -> None:
    inventory = tmp_path / "fleet.yml"
    inventory.write_text(INVENTORY)
    r = run_cli("fleet", "haproxy", "--inventory", str(inventory), "10.0.0.7:8080,weight=2",
                "b=10.0.0.8:8080,slots=6", "--max-per-node", "5")
    assert r.returncode == 0, r.stderr
    servers = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("server ")]
    assert servers == ["server gpu1 10.0.0.5:8080 maxconn 4 weight 3",
                       "server node2 10.0.0.6:8080 maxconn 2 weight 1",
                       "server node3 [::1]:8082 maxconn 1 weight 0",
                       "server node4 10.0.0.7:8080 weight 2",
                       "server b 10.0.0.8:8080 maxconn 6"]
    # A node without slots keeps the fleet-wide limit, set once for all.
    assert "default-server check" in r.stdout and " maxconn 5 " in r.stdout
    # The same inventory names the same targets for Prometheus.
    r = run_cli("fleet", "prometheus", "--inventory", str(inventory))
    assert r.returncode == 0, r.stderr
    assert "10.0.0.5:8080" in r.stdout and "node: gpu1" in r.stdout and "[::1]:8082" in r.stdout


@pytest.mark.parametrize(("text", "needle"), [
    ("- {host: 10.0.0.5, port: 8080, slots: 4, weight: 1, sltos: 2}",
     "node 1: unknown key 'sltos'; the keys are name, host, port, slots, weight"),
    ("- {host: 10.0.0.5, port: 8080}\n- {port: 8081}", "node 2: the key 'host' is missing"),
    ("- {host: 10.0.0.5}", "node 1: the key 'port' is missing"),
    ("- {host: 10.0.0.5, port: 70000}", "node 1: port must be a whole number from 1 to 65535"),
    ("- {host: 10.0.0.5, port: 1, slots: 0}", "node 1: slots must be a whole number of at least 1"),
    ("- {host: 10.0.0.5, port: 1, slots: true}", "node 1: slots must be a whole number"),
    ("- {host: 10.0.0.5, port: 1, weight: 1.5}", "node 1: weight must be a whole number from 0"),
    ("- {host: 10.0.0.5, port: 1, name: 'a b'}", "node 1: the name 'a b' must be"),
    ("- {host: 'a b', port: 1}", "node 1: the host 'a b' must be a host name or an address"),
    ("- {host: a, port: 1, name: x}\n- {host: b, port: 1, name: x}", "the name 'x' is given twice"),
    ("- 10.0.0.5:8080", "node 1: expected a mapping with host, port"),
    ("host: 10.0.0.5\nport: 8080", "expected a list of nodes"),
    ("[]", "expected a list of nodes"),
    ("- {host: 10.0.0.5, port: [", "fleet.yml':2: not valid YAML"),
])
def test_bad_inventory_is_one_sentence_naming_file_and_key(tmp_path: Path, text: str,
                                                           needle: str) -> None:
    inventory = tmp_path / "fleet.yml"
    inventory.write_text(text + "\n")
    r = run_cli("fleet", "haproxy", "--inventory", str(inventory))
    assert r.returncode == 78, r.stderr
    assert f"--inventory '{inventory}'" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_inventory_is_one_sentence(tmp_path: Path) -> None:
    r = run_cli("fleet", "haproxy", "--inventory", str(tmp_path / "nope.yml"))
    assert r.returncode == 78, r.stderr
    assert f"--inventory '{tmp_path / 'nope.yml'}': no such file" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_nodes_from_the_environment() -> None:
    r = run_cli("fleet", "haproxy", env=cli_env(
        MTPWRAP_FLEET_NODES="a=127.0.0.1:8081 b=127.0.0.1:8082"))
    assert r.returncode == 0, r.stderr
    assert "server a 127.0.0.1:8081" in r.stdout and "server b 127.0.0.1:8082" in r.stdout


def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "key").write_text("k\n")
    out = tmp_path / "prometheus.yml"
    r = run_cli("fleet", "prometheus", "--node", "a=127.0.0.1:8081", "--node",
                "b=127.0.0.1:8082", "--scrape-interval-s", "5", "--key-file",
                str(tmp_path / "key"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    check = subprocess.run([promtool, "check", "config", str(out)], capture_output=True,
                           text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # promtool followed rule_files to the shipped rules and loaded them.
    assert f"{RULES.name}\n  SUCCESS:" in check.stdout, check.stdout


def test_alert_rules_behave_as_specified() -> None:
    promtool = require_tool("promtool", "prometheus")
    r = subprocess.run([promtool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


# --- The rendered configuration at work in the real HAProxy, in front of small loopback
# backends whose misbehaviour is chosen (a node is too slow to start here for each case).

class Backend:
    """A loopback HTTP backend: /readyz is 200; a POST is answered as `mode` says (`ok`: a JSON
    reply naming the backend; `empty`: the connection closed with no answer; `partial`: a 200
    and half a body, then closed; `sse`: `chunks` SSE events `gap_s` apart; `draining`: 503 to
    everything, /readyz included, as mtpwrap's front answers while it drains)."""

    def __init__(self, name: str, mode: str = "ok", chunks: int = 0, gap_s: float = 0.0) -> None:
        self.name, self.mode, self.chunks, self.gap_s = name, mode, chunks, gap_s
        self.posts: list[dict[str, str]] = []  # each POST's headers, names in lower case
        self.options = ""  # added to the NODE argument, such as ",slots=1,weight=5"
        self.active = self.peak = 0  # POSTs being answered now, and the most at once
        lock = threading.Lock()
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(503 if backend.mode == "draining" else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self) -> None:
                with lock:
                    backend.active += 1
                    backend.peak = max(backend.peak, backend.active)
                self.counted = True
                try:
                    self.answer()
                finally:
                    self.done()

            def done(self) -> None:
                # Counted out before the answer's last bytes leave: once the client (HAProxy)
                # has them it may send the next request while this thread is still returning.
                if self.counted:
                    self.counted = False
                    with lock:
                        backend.active -= 1

            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                backend.posts.append({k.lower(): v for k, v in self.headers.items()})
                if backend.mode == "empty":
                    self.close_connection = True
                    return
                if backend.mode == "draining":
                    self.send_response(503)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if backend.mode == "sse":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(backend.chunks):
                        data = f"data: {{\"i\": {i}}}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                        time.sleep(backend.gap_s)  # the backend's pace between chunks
                    self.done()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = json.dumps({"node": backend.name}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if backend.mode == "partial":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.done()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda *a: None  # type: ignore[method-assign] # check resets
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def servers(stats: int) -> dict[str, dict[str, str]]:
    """HAProxy's own view of each server of the `mtpwrap` backend, from its stats page."""
    text = httpx.get(f"http://127.0.0.1:{stats}/stats;csv", timeout=5).text
    return {r["svname"]: r for r in csv.DictReader(io.StringIO(text.lstrip("# ")))
            if r["pxname"] == "mtpwrap" and r["svname"] not in ("FRONTEND", "BACKEND")}


@contextlib.contextmanager
def balancer(tmp_path: Path, backends: list[Backend], *args: str,
             scheme: str = "http", rows: dict[str, dict[str, str]] | None = None,
             stats: int | None = None) -> Iterator[str]:
    """The real HAProxy on `mtpwrap fleet haproxy` for `backends` (its stats page on the port
    `stats`, when given); yields its base URL once every backend is UP."""
    from tests.fleet_harness import start_haproxy, stop

    require_tool("haproxy", "haproxy")
    port, stats = free_loopback_port(), stats or free_loopback_port()
    cfg = tmp_path / "haproxy.cfg"
    r = run_cli("fleet", "haproxy", *[f"{b.name}=127.0.0.1:{b.port}{b.options}" for b in backends],
                "--bind", f"127.0.0.1:{port}", "--metrics-bind", "none",
                "--stats-bind", f"127.0.0.1:{stats}", *args, "--check", "-o", str(cfg))
    assert r.returncode == 0, r.stderr
    base = f"{scheme}://localhost:{port}"
    verify: ssl.SSLContext | bool = True
    if "--tls-cert" in args:
        verify = ssl.create_default_context(cafile=args[args.index("--tls-cert") + 1])
    proc = start_haproxy(cfg, tmp_path / "haproxy.log", f"http://127.0.0.1:{stats}/stats")
    try:
        def all_up() -> bool:
            found = servers(stats)
            if rows is not None:  # HAProxy's own view of each server, for the caller
                rows.update(found)
            return len(found) == len(backends) and all(r["status"] == "UP"
                                                       for r in found.values())

        wait_for("every backend UP", all_up, 20)
        with httpx.Client(base_url=base, verify=verify, timeout=30) as client:
            yield client  # type: ignore[misc]
    finally:
        stop(proc)
        for b in backends:
            b.close()


def test_a_node_gets_no_more_requests_at_once_than_its_slots(tmp_path: Path) -> None:
    """slots=1: three streams at once reach the node one after another (the others wait in
    HAProxy's queue) and all complete; HAProxy itself reports the maxconn and weight given."""
    node = Backend("n1", "sse", chunks=5, gap_s=0.05)
    node.options = ",slots=1,weight=5"
    rows: dict[str, dict[str, str]] = {}
    with balancer(tmp_path, [node], "--max-per-node", "8", rows=rows) as client:
        def stream(_: int) -> int:
            with client.stream("POST", "/v1/chat/completions", json={}) as s:
                return sum(1 for line in s.iter_lines() if line.startswith("data: "))

        with ThreadPoolExecutor(3) as pool:
            events = list(pool.map(stream, range(3)))
    assert events == [5, 5, 5]
    assert len(node.posts) == 3 and node.peak == 1, node.peak
    assert rows["n1"]["slim"] == "1" and rows["n1"]["weight"] == "5", rows["n1"]


def test_a_connection_closed_unanswered_is_retried_on_another_node(tmp_path: Path) -> None:
    bad, good = Backend("bad", "empty"), Backend("good")
    with balancer(tmp_path, [bad, good]) as client:
        replies = [client.post("/v1/chat/completions", json={}) for _ in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
    assert {r.json()["node"] for r in replies} == {"good"}
    assert bad.posts, "leastconn never chose the bad node: the retry was not exercised"


def test_a_response_that_began_is_never_retried(tmp_path: Path) -> None:
    cut, good = Backend("cut", "partial"), Backend("good")
    outcomes = []
    with balancer(tmp_path, [cut, good]) as client:
        for i in range(4):  # each a chat of its own: the default affinity places it by leastconn
            try:
                outcomes.append(client.post("/v1/chat/completions", json={},
                                            headers={CHAT: f"chat-{i}"}).json()["node"])
            except (httpx.HTTPError, json.JSONDecodeError):
                outcomes.append("cut short")
    assert cut.posts, "leastconn never chose the node that cuts its answers"
    assert outcomes.count("cut short") == len(cut.posts)  # its clients saw the cut ...
    assert len(good.posts) == outcomes.count("good")  # ... and nothing was sent twice


@pytest.mark.parametrize(("args", "header"), [
    ((), CHAT), (("--affinity-header", "X-Session-Id"), "X-Session-Id")])
def test_a_chat_stays_on_one_node(tmp_path: Path, args: tuple[str, ...], header: str) -> None:
    """By default Open WebUI's chat id (ENABLE_FORWARD_USER_INFO_HEADERS=true) keeps each chat
    on the node that read its document; requests without it are spread; another header can be
    named."""
    a, b = Backend("a"), Backend("b")
    with balancer(tmp_path, [a, b], *args) as client:
        def node(chat: str | None) -> str:
            headers = {header: chat} if chat else {}
            r = client.post("/v1/chat/completions", json={}, headers=headers)
            return str(r.json()["node"])

        assert len({node(None) for _ in range(6)}) == 2  # no header: spread as before
        for chat in ("chat-1", "chat-2", "chat-3", "chat-4"):
            assert len({node(chat) for _ in range(5)}) == 1, chat
        assert len({node(f"chat-{i}") for i in range(1, 5)}) == 2  # chats spread


def test_without_affinity_a_chat_is_spread(tmp_path: Path) -> None:
    a, b = Backend("a"), Backend("b")
    with balancer(tmp_path, [a, b], "--affinity-header", "none") as client:
        served = {client.post("/v1/chat/completions", json={},
                              headers={CHAT: "chat-1"}).json()["node"] for _ in range(4)}
    assert served == {"a", "b"}


def test_a_chat_whose_node_drains_or_dies_moves_once(tmp_path: Path) -> None:
    """Three chats on three nodes. One node drains (503 to its requests and its /readyz, as
    mtpwrap's front while it drains): its chat's next request is retried on another node,
    which keeps the chat after the drained node is back. Another node dies (refused
    connections): its chat moves once too. The third chat never moves."""
    nodes = [Backend("a"), Backend("b"), Backend("c")]
    stats = free_loopback_port()

    def status(name: str) -> str:
        return servers(stats)[name]["status"]

    with balancer(tmp_path, nodes, "--check-interval-s", "0.2", stats=stats) as client:
        def node(chat: str | None) -> str:
            r = client.post("/v1/chat/completions", json={},
                            headers={CHAT: chat} if chat else {})
            assert r.status_code == 200, (chat, r.status_code)
            return str(r.json()["node"])

        home = {node(f"chat-{i}"): f"chat-{i}" for i in range(3)}
        assert set(home) == {"a", "b", "c"}  # a new chat goes by leastconn: one on each
        drained, dead, kept = nodes
        drained.mode = "draining"
        moved = node(home["a"])  # a's 503 is retried on another node, at once
        assert moved != "a"
        wait_for("HAProxy takes a out", lambda: status("a").startswith("DOWN"), 10)
        drained.mode = "ok"
        wait_for("HAProxy takes a back", lambda: status("a") == "UP", 10)
        assert {node(home["a"]) for _ in range(4)} == {moved}  # moved once, not back
        dead.mode = "empty"  # like a killed process: kept-alive connections close unanswered,
        dead.close()  # and new ones are refused; either is retried elsewhere
        moved_from_b = node(home["b"])
        wait_for("HAProxy takes b out", lambda: status("b").startswith("DOWN"), 10)
        assert moved_from_b in ("a", "c")
        assert {node(home["b"]) for _ in range(4)} == {moved_from_b}
        assert {node(home["c"]) for _ in range(4)} == {"c"}
        assert len(kept.posts) >= 5


def test_tls_termination_and_the_api_key_passed_untouched(tmp_path: Path) -> None:
    openssl = require_tool("openssl", "openssl")
    key, crt, pem = tmp_path / "key.pem", tmp_path / "crt.pem", tmp_path / "fleet.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    pem.write_text(crt.read_text() + key.read_text())
    node = Backend("n1")
    secret = "Bearer sk-Fleet.Key_0123/+=="
    with balancer(tmp_path, [node], "--tls-cert", str(crt.with_name("fleet.pem")),
                  scheme="https") as client:
        r = client.post("/v1/chat/completions", json={}, headers={"Authorization": secret})
        assert r.status_code == 200 and r.json()["node"] == "n1"
        assert r.http_version == "HTTP/1.1" and client.base_url.scheme == "https"
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
            httpx.post(str(client.base_url).replace("https", "http") + "/v1/chat/completions",
                       json={}, timeout=5)
    (headers,) = node.posts
    assert headers["authorization"] == secret
    assert headers["x-forwarded-proto"] == "https"


def test_stats_page_is_on_loopback_only(tmp_path: Path) -> None:
    r = run_cli("fleet", "haproxy", "--node", "127.0.0.1:8081", "--stats-bind", "0.0.0.0:8405")
    assert r.returncode == 78 and "must listen on loopback" in r.stderr, r.stderr
    # The exporter may listen for a remote Prometheus, but it serves no stats page.
    require_tool("haproxy", "haproxy")
    from tests.fleet_harness import start_haproxy, stop

    metrics, stats = free_loopback_port(), free_loopback_port()
    cfg = tmp_path / "haproxy.cfg"
    r = run_cli("fleet", "haproxy", "--node", "127.0.0.1:1", "--bind",
                f"127.0.0.1:{free_loopback_port()}", "--metrics-bind", f"127.0.0.1:{metrics}",
                "--stats-bind", f"127.0.0.1:{stats}", "-o", str(cfg))
    assert r.returncode == 0, r.stderr
    proc = start_haproxy(cfg, tmp_path / "haproxy.log", f"http://127.0.0.1:{stats}/stats")
    try:
        assert httpx.get(f"http://127.0.0.1:{metrics}/stats").status_code == 403
        assert "haproxy_process" in httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
    finally:
        stop(proc)


def test_sse_chunks_are_not_bunched(tmp_path: Path) -> None:
    """`option http-no-delay`: chunks 20 ms apart reach the client 20 ms apart, as directly."""
    def gaps(base: str) -> list[float]:
        stamps = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={}, timeout=30) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.monotonic())
        assert len(stamps) == 40
        return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]

    def bunched(gs: list[float]) -> int:
        """Chunks that arrived with the one before: a buffering proxy (Nagle's algorithm
        against the client's delayed ACK) gives every other chunk a gap of about 0."""
        return sum(g < 0.005 for g in gs)

    node = Backend("n1", "sse", chunks=40, gap_s=0.02)
    direct = gaps(node.base)
    with balancer(tmp_path, [node]) as client:
        through = gaps(str(client.base_url))
    # a loaded machine delays a read now and then, through HAProxy or not: a few bunched chunks
    # and one long gap are the scheduler's, not the proxy's
    assert bunched(through) <= bunched(direct) + 4, (direct, through)
    assert statistics.median(through) < statistics.median(direct) + 0.005, (direct, through)
