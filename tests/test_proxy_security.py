"""Security of the front (docs/reliability.md 16–21): keys, allow-list, bad bodies, Host, CORS,
privacy. The upstream here records what reaches it, so each test also proves that a refused
request never got to the child.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import select
import socket
import time

import httpx
import pytest

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front import access
from mtpwrap.front.access import _EXACT
from mtpwrap.front.info import ServeInfo
from tests.fakes.fake_upstream import FakeUpstream
from tests.fakes.front_harness import serve_front

KEY1 = "client-key-0123456789"
KEY2 = "second-key-abcdefghij"
HTTP = httpx.Client(timeout=30)


@pytest.fixture
def fake():
    f = FakeUpstream(mode="json").start()
    yield f
    f.stop()


@pytest.fixture
def front(fake):
    cfg = ProxyConfig(api_keys=(KEY1, KEY2), max_body_bytes=1024 * 1024)
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, sup):
        yield srv


INFERENCE = sorted(p for (m, p), feature in _EXACT.items() if m == "POST" and not feature)


# --------------------------------------------------------------------------- 16: keys


@pytest.mark.parametrize("headers", [
    {},
    {"authorization": "Bearer wrong-key-0123456789"},
    {"authorization": f"Basic {KEY1}"},
    {"authorization": KEY1},
    {"api-key": KEY1},                       # Azure-style header: not accepted
    {"x-api-key": KEY1 + "x"},
    {"authorization": f"Bearer {KEY1[:-1]}"},
], ids=["none", "wrong", "basic", "no-scheme", "api-key-header", "longer", "prefix"])
def test_every_inference_path_needs_a_valid_key(fake, front, headers):
    for path in INFERENCE:
        r = HTTP.post(front.url + path, json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    r = HTTP.post(front.url + f"/v1/chat/completions?api_key={KEY1}", json={}, headers=headers)
    assert r.status_code == 401  # a key in the query string is not a key
    assert fake.seen == []


def test_both_headers_and_every_key_work_and_client_key_never_reaches_child(fake, front):
    for headers in ({"authorization": f"Bearer {KEY1}"}, {"x-api-key": KEY2},
                    {"authorization": f"bearer {KEY2}"}):
        r = HTTP.post(front.url + "/v1/chat/completions", json={}, headers=headers)
        assert r.status_code == 200, headers
    assert len(fake.seen) == 3
    for s in fake.seen:
        assert s.headers["authorization"] == f"Bearer {fake.api_key}"
        assert "x-api-key" not in s.headers
        assert KEY1 not in json.dumps(s.headers) and KEY2 not in json.dumps(s.headers)


def test_probes_are_open_and_ops_pages_need_a_key(front):
    assert HTTP.get(front.url + "/livez").status_code == 200
    assert HTTP.get(front.url + "/readyz").status_code == 200
    assert HTTP.get(front.url + "/healthz").status_code == 401
    assert HTTP.get(front.url + "/metrics").status_code == 401
    ok = HTTP.get(front.url + "/metrics", headers={"x-api-key": KEY1})
    assert ok.status_code == 200 and "mtpwrap_requests_total" in ok.text


def test_key_comparison_is_constant_time(fake, front, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", spy)
    HTTP.post(front.url + "/completion", json={}, headers={"x-api-key": "nope-nope-nope"})
    # every configured key is compared, even after a mismatch (no early exit)
    assert len(calls) == 2


def test_keys_and_prompts_never_reach_the_logs(fake, caplog, tmp_path):
    canary = "CANARY-7f3e-prompt-text"
    log_file = tmp_path / "front.log"
    handler = logging.FileHandler(log_file)
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(handler)
    caplog.set_level(logging.DEBUG)
    try:
        cfg = ProxyConfig(api_keys=(KEY1,), max_body_bytes=4096)
        with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
            good = {"authorization": f"Bearer {KEY1}"}
            body = {"messages": [{"role": "user", "content": canary}]}
            HTTP.post(srv.url + "/v1/chat/completions", json=body, headers=good)
            HTTP.post(srv.url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY1}wrong"})
            HTTP.post(srv.url + "/v1/chat/completions", content=canary + "{", headers=good)
            HTTP.post(srv.url + "/v1/chat/completions", content=canary * 500, headers=good)
            fake.mode = "sse"
            HTTP.post(srv.url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=good)
            fake.mode = "reset"
            HTTP.post(srv.url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=good)
    finally:
        root.removeHandler(handler)
        handler.close()
    text = "\n".join(r.getMessage() for r in caplog.records) + log_file.read_text()
    assert caplog.records, "nothing was logged at all; the check would prove nothing"
    assert "/v1/chat/completions" in text
    for secret in (canary, KEY1, fake.api_key, "tok1"):
        assert secret not in text


# --------------------------------------------------------------------------- 17: allow-list


@pytest.mark.parametrize("method,path", [
    ("POST", "/slots/0?action=save"), ("POST", "/slots/0?action=restore"),
    ("POST", "/props"), ("GET", "/lora-adapters"), ("POST", "/lora-adapters"),
    ("GET", "/backend/metrics"), ("GET", "/"), ("GET", "/slots"),
])
def test_dangerous_paths_are_refused_unless_enabled(fake, front, method, path):
    r = HTTP.request(method, front.url + path, json={}, headers={"x-api-key": KEY1})
    assert r.status_code == 403
    assert "proxy.enable_paths" in r.json()["error"]["message"]
    assert fake.seen == []


def test_enabled_feature_is_forwarded(fake):
    cfg = ProxyConfig(api_keys=(KEY1,), enable_paths=("slots", "backend-metrics"))
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
        h = {"x-api-key": KEY1}
        assert HTTP.get(srv.url + "/slots", headers=h).status_code == 200
        r = HTTP.get(srv.url + "/backend/metrics", headers=h)
        assert r.status_code == 200 and "llamacpp:" in r.text
        assert HTTP.post(srv.url + "/props", json={}, headers=h).status_code == 403
    assert [s.path for s in fake.seen] == ["/slots", "/metrics"]


@pytest.mark.parametrize("raw", [
    b"/v1/../slots", b"/v1/%2e%2e/slots", b"/v1/%2E%2E/slots", b"//slots", b"/slots%2f",
    b"/%73lots", b"/v1/models/../../slots", b"/./slots", b"/v1\\..\\slots", b"/slots;x",
    b"/v1/chat/completions/../../slots/0?action=save", b"/props%00",
])
def test_path_tricks_fail(fake, front, raw):
    s = socket.create_connection(("127.0.0.1", front.port))
    s.sendall(b"GET " + raw + b" HTTP/1.1\r\nHost: localhost\r\nX-Api-Key: " + KEY1.encode()
              + b"\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        part = s.recv(65536)
        if not part:
            break
        data += part
    s.close()
    status = int(data.split(b" ", 2)[1]) if data else 400
    assert status in (400, 404), data[:200]
    assert fake.seen == []


# --------------------------------------------------------------------------- 18: bodies


def test_body_over_limit_is_413_before_forwarding(fake, front):
    big = b"{" + b" " * (1024 * 1024 + 10) + b"}"
    r = HTTP.post(front.url + "/v1/chat/completions", content=big,
                  headers={"x-api-key": KEY1, "content-type": "application/json"})
    assert r.status_code == 413
    assert fake.seen == []


def test_chunked_body_is_read_only_up_to_the_limit(fake, front):
    """A body without Content-Length is refused while it arrives; memory stays bounded."""
    s = socket.create_connection(("127.0.0.1", front.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Api-Key: "
              + KEY1.encode() + b"\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Type: application/json\r\n\r\n")
    piece = b"x" * 65536
    sent = 0
    answer = b""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sent < 200 * 1024 * 1024:
        r, w, _ = select.select([s], [s], [], 1)
        if r:
            answer = s.recv(4096)
            break
        if w:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                break
            sent += len(piece)
    if not answer:
        # The front answered and closed while a piece was still being sent: the 413 is in the
        # receive buffer behind the broken send.
        s.settimeout(2)
        with contextlib.suppress(OSError):
            answer = s.recv(4096)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    # the front stopped reading near the limit: what was sent is the limit plus socket buffers
    assert sent < 16 * 1024 * 1024
    assert fake.seen == []


@pytest.mark.parametrize("body,needle", [
    (b'{"messages": [}', "not valid JSON"),
    (b"{\"a\": \"\xc3\x28\"}", "not valid UTF-8"),
    (b'{"prompt": "x", "n_discard": -1}', "n_discard"),
    (b'{"prompt": "x", "n_probs": 1000000}', "n_probs must be 0..100"),
    (b'{"messages": [], "top_logprobs": 5000}', "top_logprobs"),
    (b'{"prompt": "x", "id_slot": -7}', "id_slot"),
    (b'{"prompt": "x", "n_keep": -2}', "n_keep"),
])
def test_bad_bodies_get_400_with_a_clear_message(fake, front, body, needle):
    r = HTTP.post(front.url + "/completion", content=body,
                  headers={"x-api-key": KEY1, "content-type": "application/json"})
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert fake.seen == []


def test_sane_values_of_guarded_fields_pass(fake, front):
    r = HTTP.post(front.url + "/completion", headers={"x-api-key": KEY1},
                  json={"prompt": "x", "n_probs": 5, "id_slot": -1, "n_discard": 0, "n_keep": -1})
    assert r.status_code == 200 and len(fake.seen) == 1


# --------------------------------------------------------------------------- 19: Host, CORS


def test_unexpected_host_is_421(fake, front):
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.nip.io"):
        r = HTTP.post(front.url + "/v1/chat/completions", json={},
                      headers={"x-api-key": KEY1, "host": host})
        assert r.status_code == 421, host
    # probes answer any Host (balancers and kubelets send an address); nothing else does
    assert HTTP.get(front.url + "/livez", headers={"host": "evil.example"}).status_code == 200
    assert HTTP.get(front.url + "/healthz", headers={"host": "evil.example",
                                                      "x-api-key": KEY1}).status_code == 421
    for host in ("localhost", f"127.0.0.1:{front.port}", "[::1]:80"):
        r = HTTP.post(front.url + "/v1/chat/completions", json={},
                      headers={"x-api-key": KEY1, "host": host})
        assert r.status_code == 200, host


def test_no_permissive_cors(fake, front):
    pre = HTTP.options(front.url + "/v1/chat/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert pre.status_code in (401, 405)
    assert not any(k.lower().startswith("access-control") for k in pre.headers)
    r = HTTP.post(front.url + "/v1/chat/completions", json={},
                  headers={"x-api-key": KEY1, "origin": "https://evil.example"})
    assert r.status_code == 200
    # the fake, like llama-server, answers with "Access-Control-Allow-Origin: *"
    assert not any(k.lower().startswith("access-control") for k in r.headers)


def test_configured_cors_origin_only(fake):
    cfg = ProxyConfig(api_keys=(KEY1,), cors_origins=("https://app.internal",))
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
        ok = HTTP.post(srv.url + "/v1/chat/completions", json={},
                       headers={"x-api-key": KEY1, "origin": "https://app.internal"})
        assert ok.headers["access-control-allow-origin"] == "https://app.internal"
        bad = HTTP.post(srv.url + "/v1/chat/completions", json={},
                        headers={"x-api-key": KEY1, "origin": "https://evil.example"})
        assert "access-control-allow-origin" not in bad.headers


# --------------------------------------------------------------------------- 20: exposure


def test_no_keys_on_a_public_address_is_warned(fake, caplog):
    caplog.set_level(logging.WARNING, logger="mtpwrap.proxy")
    cfg = ProxyConfig(listen_host="0.0.0.0", allowed_hosts=("*",))
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
        assert HTTP.get(srv.url + "/livez").status_code == 200
    assert any("without API keys" in r.getMessage() for r in caplog.records)


def test_internal_key_never_goes_back_to_the_client(fake, front):
    fake.mode = "sse"
    r = HTTP.post(front.url + "/v1/chat/completions", json={"stream": True},
                  headers={"x-api-key": KEY1})
    assert fake.api_key not in json.dumps(dict(r.headers))
    assert fake.api_key.encode() not in r.content
    h = HTTP.get(front.url + "/healthz", headers={"x-api-key": KEY1})
    assert fake.api_key not in h.text


# --------------------------------------------------------------------------- scoped keys

INFER, ADMIN, OPS, ALL = ("infer-key-0123456789", "admin-key-0123456789",
                          "ops-key-0123456789ab", "full-key-0123456789a")


@pytest.fixture
def scoped(fake):
    cfg = ProxyConfig(api_keys=(f"{INFER} inference", f"{ADMIN} admin", f"{OPS} metrics", ALL),
                      enable_paths=("slots", "slot-actions", "props-write", "lora-adapters",
                                    "backend-metrics"))
    with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _):
        yield srv


SCOPED_ROUTES = [
    ("POST", "/v1/chat/completions", "inference"), ("POST", "/completion", "inference"),
    ("GET", "/v1/models", "inference"), ("GET", "/props", "inference"),
    ("POST", "/props", "admin"), ("GET", "/slots", "admin"),
    ("POST", "/slots/0?action=save", "admin"), ("POST", "/slots/0?action=erase", "admin"),
    ("GET", "/lora-adapters", "admin"), ("POST", "/lora-adapters", "admin"),
    ("GET", "/metrics", "metrics"), ("GET", "/healthz", "metrics"),
    ("GET", "/backend/metrics", "metrics"),
]


@pytest.mark.parametrize("method,path,needs", SCOPED_ROUTES,
                         ids=[f"{m} {p}" for m, p, _ in SCOPED_ROUTES])
def test_each_scope_opens_its_own_paths_only(fake, scoped, method, path, needs):
    ops_page = path in ("/metrics", "/healthz")
    for key, scope in ((INFER, "inference"), (ADMIN, "admin"), (OPS, "metrics"), (ALL, None)):
        before = len(fake.seen)
        r = HTTP.request(method, scoped.url + path, json={}, headers={"x-api-key": key})
        if scope is None or scope == needs:
            assert r.status_code not in (401, 403), (key, r.text)
            assert ops_page or len(fake.seen) == before + 1  # it reached the child
        else:
            assert r.status_code == 403, (key, r.status_code)
            assert f"needs a key with the {needs} scope" in r.json()["error"]["message"]
            assert len(fake.seen) == before  # a refused request never reaches the child
    assert HTTP.request(method, scoped.url + path, json={}).status_code == 401
    for probe in ("/livez", "/readyz"):  # probes stay open whatever the keys
        assert HTTP.get(scoped.url + probe).status_code == 200


def test_scoped_keys_come_from_the_key_file_and_a_bad_scope_stops_up(tmp_path):
    from tests.helpers import cli_env, run_cli

    keys = tmp_path / "keys"
    keys.write_text(f"{INFER} inference\n{OPS} metrics,dashboards\n")
    r = run_cli("up", "--profile", "cpu-demo", "--api-key-file", str(keys), "--port", "1",
                env=cli_env(MTPWRAP_HOME=str(tmp_path / "h")))
    assert r.returncode == 78, r.stderr
    assert f"{keys} line 2: unknown scope 'dashboards'" in r.stderr
    assert OPS not in r.stderr + r.stdout and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- the web UI


@pytest.mark.parametrize("bundle", [None, True, False])
def test_the_webui_feature_says_when_the_build_has_no_bundle(fake, bundle, caplog):
    """`webui` is opt-in; a build made without the web UI bundle (LLAMA_BUILD_WEBUI=OFF, as the
    manifest records it) gets a 404 that says so, and nothing reaches llama-server."""
    cfg = ProxyConfig(api_keys=(KEY1,), enable_paths=("webui",))
    caplog.set_level(logging.WARNING, logger="mtpwrap.proxy")
    why = "tools/server/public/bundle.js is missing from the source tree, so it was built " \
        "with LLAMA_BUILD_WEBUI=OFF"
    info = ServeInfo(profile="t", webui=bundle, webui_why=why if bundle is False else "")
    with serve_front(fake.base_url, fake.api_key, cfg, info=info) as (srv, _):
        r = HTTP.get(srv.url + "/", headers={"x-api-key": KEY1})
    if bundle is False:
        assert r.status_code == 404
        message = r.json()["error"]["message"]
        assert message.startswith("The web UI is unavailable") and "LLAMA_BUILD_WEBUI=OFF" \
            in message
        assert fake.seen == []
        assert any("enable_paths lists webui" in rec.message for rec in caplog.records)
    else:
        assert r.status_code == 200 and r.json()["path"] == "/"
        assert [s.path for s in fake.seen] == ["/"]


def test_only_an_admin_sees_the_running_command(scoped):
    """The command llama-server runs (paths, model, flags) is an admin's to see: /healthz and
    /status.json carry it for a key with the admin scope, never for a metrics-only key."""
    ops = HTTP.get(scoped.url + "/healthz", headers={"x-api-key": OPS}).json()
    assert "command" not in ops
    assert "command" in HTTP.get(scoped.url + "/healthz", headers={"x-api-key": ALL}).json()
    page = HTTP.get(scoped.url + "/status.json", headers={"x-api-key": OPS}).json()
    assert page["command"] is None
