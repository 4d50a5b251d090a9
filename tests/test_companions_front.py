"""The front with several companions, over fault-free fake upstreams that record what reached
them: which child a request goes to by route and `model`, the 404 for a name no companion of
the role has, token ids checked against the chosen child's vocabulary, the merged model list
when a child answers it oddly or is not ready, and the audit's model. (The real llama-server
path is tests/test_companions_real.py; a 2-core machine cannot run three of them beside the
chat model without oversubscribing it.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front.companions import CompanionInfo
from mtpwrap.front.info import ServeInfo
from mtpwrap.supervision.state import State
from tests.fakes.fake_upstream import FakeUpstream
from tests.fakes.front_harness import FrontServer, serve_front


@pytest.fixture
def upstreams() -> Iterator[dict[str, FakeUpstream]]:
    fakes = {name: FakeUpstream(mode="json").start() for name in ("chat", "en", "ko", "rr")}
    yield fakes
    for f in fakes.values():
        f.stop()


@pytest.fixture
def front(upstreams: dict[str, FakeUpstream]) -> Iterator[FrontServer]:
    companions = (
        (CompanionInfo("embed-en", "embedding", "en.gguf", 2, n_vocab=100), upstreams["en"]),
        (CompanionInfo("embed-ko", "embedding", "ko.gguf", 1, n_vocab=300_000), upstreams["ko"]),
        (CompanionInfo("rerank", "rerank", "rr.gguf", 1), upstreams["rr"]),
    )
    chat = upstreams["chat"]
    with serve_front(chat.base_url, chat.api_key, ProxyConfig(queue_timeout_s=2.0),
                     ServeInfo(model="chat.gguf", n_vocab=50_000),
                     companions=tuple((info, f.base_url, f.api_key)
                                      for info, f in companions)) as (srv, _sup):
        yield srv


def _paths(fake: FakeUpstream) -> list[str]:
    return [s.path for s in fake.seen]


def _post(srv: FrontServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=10)


def test_routes_by_path_and_model(front: FrontServer, upstreams: dict[str, FakeUpstream]
                                  ) -> None:
    assert _post(front, "/v1/embeddings", {"model": "embed-ko", "input": "x"}).status_code == 200
    assert _post(front, "/v1/embeddings", {"input": "x"}).status_code == 200  # the first
    assert _post(front, "/embedding", {"content": "x"}).status_code == 200
    assert _post(front, "/v1/rerank", {"model": "anything", "query": "q",
                                       "documents": ["d"]}).status_code == 200
    assert _post(front, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]}).status_code == 200
    assert _paths(upstreams["ko"]) == ["/v1/embeddings"]
    assert _paths(upstreams["en"]) == ["/v1/embeddings", "/embedding"]
    assert _paths(upstreams["rr"]) == ["/v1/rerank"]  # one reranker: whatever `model` says
    assert [p for p in _paths(upstreams["chat"]) if p != "/metrics"] == ["/v1/chat/completions"]

    # two embedding companions: a name that is neither is the client's mistake
    r = _post(front, "/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"})
    assert r.status_code == 404
    assert r.headers["x-mtpwrap-answered-by"] == "front"
    assert "'text-embedding-3-small' does not serve embedding requests here; send one of " \
           "'embed-en', 'embed-ko' as `model`" in r.text


def test_token_ids_are_checked_against_the_chosen_model(
        front: FrontServer, upstreams: dict[str, FakeUpstream]) -> None:
    # 5000 is inside the chat model's vocabulary (50,000) but outside embed-en's (100)
    r = _post(front, "/v1/embeddings", {"model": "embed-en", "input": [[1, 5000]]})
    assert r.status_code == 400 and "vocabulary" in r.text
    # 120,000 is outside the chat model's but inside embed-ko's (300,000)
    r = _post(front, "/v1/embeddings", {"model": "embed-ko", "input": [[1, 120_000]]})
    assert r.status_code == 200, r.text
    assert _paths(upstreams["en"]) == [] and _paths(upstreams["ko"]) == ["/v1/embeddings"]


def test_the_model_list_merges_every_child(front: FrontServer) -> None:
    # the fakes answer {"ok": true, ...}: no list to merge, so each companion is listed from
    # what the front knows; a companion not ready is listed with its state
    rr = front.front.routes.get("rerank")
    rr.supervisor.state = State.BACKOFF
    r = httpx.get(front.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    listed = {m["id"]: m for m in r.json()["data"]}
    assert listed["rerank"]["status"] == {"value": "backoff"}
    assert listed["embed-en"]["role"] == "embedding"
    assert set(listed) == {"embed-en", "embed-ko", "rerank"}
    # and the readiness of each
    assert httpx.get(front.url + "/readyz", timeout=10).status_code == 200
    assert httpx.get(front.url + "/readyz", params={"model": "rerank"},
                     timeout=10).status_code == 503
    assert httpx.get(front.url + "/readyz", params={"model": "embed-ko"},
                     timeout=10).status_code == 200
    health = httpx.get(front.url + "/healthz", timeout=10).json()
    assert [(c["name"], c["state"]) for c in health["companions"]] == [
        ("embed-en", "ready"), ("embed-ko", "ready"), ("rerank", "backoff")]
