"""What a request that asked for a stream of a route that never streams gets and is charged,
shown on demand by the fault-injecting upstream (a slow answer, past `keepalive_s`); the same on
the real llama-server is in tests/test_usage_real.py."""

from __future__ import annotations

import httpx

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front.usage import BYTES_PER_TOKEN
from tests.fakes.fake_upstream import FakeUpstream
from tests.fakes.front_harness import serve_front
from tests.helpers import wait_for

KEY = "metered-key-0123456789"


def _tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('mtpwrap_key_tokens_total{key="metered"'))


def test_a_stream_asked_of_a_route_that_never_streams_is_its_json_and_charged() -> None:
    fake = FakeUpstream(mode="slow_json", interval=0.6).start()
    try:
        config = ProxyConfig(api_keys=(f"{KEY} name=metered tokens_per_day=1000000",),
                             keepalive_s=0.1)
        with serve_front(fake.base_url, fake.api_key, config) as (srv, _):
            raw = b'{"input": "a text to embed", "stream": true}'
            r = httpx.post(srv.url + "/v1/embeddings", timeout=10, content=raw, headers={
                "authorization": f"Bearer {KEY}", "content-type": "application/json"})
            # before: event-stream headers after keepalive_s, then the JSON as a 502 event
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json() == {"ok": True}
            # it says no counts: charged its reservation (the body's 44 bytes, 3 a token)
            wait_for("the request charged", lambda: _tokens(srv.url) > 0, 10)
            assert _tokens(srv.url) == 15 == -(-len(raw) // BYTES_PER_TOKEN)
    finally:
        fake.stop()


def test_a_key_without_a_token_budget_is_charged_its_reservation_too() -> None:
    """`mtpwrap usage` counts every key's tokens, budget or not: an answer that says no counts
    is charged its reservation (the body's estimate plus the most it may generate) whether or
    not a budget holds it."""
    fake = FakeUpstream(mode="json").start()
    try:
        config = ProxyConfig(api_keys=(f"{KEY} name=metered",), max_predict=100)
        with serve_front(fake.base_url, fake.api_key, config) as (srv, _):
            raw = b'{"prompt": "a text", "n_predict": 40, "response_fields": ["content"]}'
            r = httpx.post(srv.url + "/completion", timeout=10, content=raw, headers={
                "authorization": f"Bearer {KEY}", "content-type": "application/json"})
            assert r.status_code == 200, r.text
            # before: the estimate of its prompt only (the reservation was a budget's alone)
            wait_for("the request charged", lambda: _tokens(srv.url) > 0, 10)
            assert _tokens(srv.url) == -(-len(raw) // BYTES_PER_TOKEN) + 40
    finally:
        fake.stop()
