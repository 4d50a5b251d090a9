"""Per-request draft depth on the real llama-server (CPU build, demo model drafting for itself).

The patched build (patches/llama.cpp/0001) honours `speculative.n_max` on every generation
endpoint, streamed or not; the probe `mtpwrap build` runs tells it from a server that ignores
the field (the same binary behind a relay that drops it; nothing is compiled here). Then the
front's policy on the patched build: its header, its /metrics and /healthz, and a client's own
fields passed through untouched.

Draft counts come from llama-server's own /metrics counters (a difference of two scrapes, parsed
by bench/stats with prometheus_client's parser), so every endpoint is measured the same way,
whether or not its response carries `timings`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpwrap.bench import stats
from mtpwrap.build import patchset, source, spec_probe
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.decide import profiles
from mtpwrap.front.info import ServeInfo
from mtpwrap.proc import free_loopback_port
from tests.fakes.front_harness import LlamaChild, serve_front
from tests.helpers import ignoring_draft_depth

pytestmark = pytest.mark.integration

INTERNAL = "internal-key-abcdefghij"
KEY = "client-key-0123456789"
SERVER_DEPTH = 8
N_PREDICT = 40
PROMPT = ("Article 1 (Purpose) The purpose of this Act is to protect the rights of tenants and "
          "to stabilise housing. Article 2 (Definitions) In this Act,")


@pytest.fixture(scope="module")
def llama(llama_server_bin: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LlamaChild]:
    child = LlamaChild(llama_server_bin, demo_model, free_loopback_port(), INTERNAL,
                       extra=["-c", "4096", "-np", "1", "--spec-type", "draft-simple",
                              "--spec-draft-n-max", str(SERVER_DEPTH), "-md", str(demo_model)],
                       log_path=tmp_path_factory.mktemp("llama") / "spec-depth.log")
    child.start(timeout=300)
    yield child
    child.kill()


def _counters(base: str, key: str) -> stats.Counters:
    r = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    return stats.Counters.from_metrics(stats.parse_metrics(r.text))


def _ask(base: str, key: str, endpoint: str, stream: bool, extra: dict) -> None:
    """One greedy generation through the endpoint's own client; the whole answer is read."""
    if endpoint in ("/v1/completions", "/v1/chat/completions"):
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        common = {"model": "demo", "max_tokens": N_PREDICT, "temperature": 0.0,
                  "stream": stream, "extra_body": extra}
        if endpoint == "/v1/completions":
            out = client.completions.create(prompt=PROMPT, **common)  # type: ignore[call-overload]
        else:
            out = client.chat.completions.create(  # type: ignore[call-overload]
                messages=[{"role": "user", "content": PROMPT}], **common)
        if stream:
            for _ in out:
                pass
        return
    if endpoint == "/completion":
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0, "stream": stream}
    else:  # /v1/messages
        body = {"model": "demo", "max_tokens": N_PREDICT, "temperature": 0.0, "stream": stream,
                "messages": [{"role": "user", "content": PROMPT}]}
    body.update(extra)
    with httpx.stream("POST", base + endpoint, json=body, timeout=300,
                      headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        r.read()


def _drafted(base: str, key: str, endpoint: str, stream: bool, extra: dict
             ) -> tuple[int, int]:
    before = _counters(base, INTERNAL)
    _ask(base, key, endpoint, stream, extra)
    d = _counters(base, INTERNAL) - before
    return int(d.drafted), int(d.predicted_tokens)


ENDPOINTS = ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_request_n_max_sets_the_draft_depth(llama: LlamaChild, endpoint: str,
                                            stream: bool) -> None:
    zero, _ = _drafted(llama.base_url, INTERNAL, endpoint, stream, {"speculative.n_max": 0})
    one, predicted_one = _drafted(llama.base_url, INTERNAL, endpoint, stream,
                                  {"speculative.n_max": 1})
    eight, _ = _drafted(llama.base_url, INTERNAL, endpoint, stream, {"speculative.n_max": 8})
    assert zero == 0
    assert 0 < one <= predicted_one
    assert eight > one


@pytest.fixture(scope="module")
def ignoring_binary(llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The patched llama-server behind a relay that drops `speculative.*` from every body: a
    server that ignores a request's own draft depth, as the unpatched build does."""
    return ignoring_draft_depth(llama_server_bin, tmp_path_factory.mktemp("ignoring"))


def test_probe_tells_a_server_that_honours_n_max_from_one_that_ignores_it(
        llama_server_bin: Path, demo_model: Path, cpu_manifest: dict,
        ignoring_binary: Path) -> None:
    """The probe's verdict on both kinds of server, with nothing compiled here: the patched
    build, and the same binary with the field taken out of each request (the real unpatched
    build beside it: benchmarks/spec_depth_unpatched.py)."""
    # every patch written for this source (the fork's are recorded not for it)
    upstream = [p.name for p in patchset.available()
                if p.meant_for("offline", source.OFFLINE_COMMIT)]
    assert [p["name"] for p in cpu_manifest["patches"] if p["status"] == "applied"] == upstream
    assert cpu_manifest["spec_depth"]["status"] == "honoured"
    honoured = spec_probe.probe(llama_server_bin, demo_model)
    assert honoured["status"] == "honoured", honoured
    assert honoured["draft_n"]["default"] > 0 and honoured["draft_n"]["n_max_0"] == 0
    ignored = spec_probe.probe(ignoring_binary, demo_model)
    assert ignored["status"] == "ignored", ignored
    assert ignored["draft_n"]["n_max_0"] > 0


# ------------------------------------------------------------------------ the front's policy


def _front(llama: LlamaChild, per_request_depth: str, policy: dict):
    prof = profiles.validate({"name": "t", "description": "d", "model": "demo",
                              "context": 4096, "hardware": {"requires_gpu": False},
                              "spec": {"kind": "draft", "depth": SERVER_DEPTH,
                                       "draft_model": "demo", "policy": policy}},
                             where="test profile")
    info = ServeInfo(profile="t", speculation=prof.spec, per_request_depth=per_request_depth)
    cfg = ProxyConfig(api_keys=(KEY,), stream_stall_s=120, prefill_stall_s=300)
    return serve_front(llama.base_url, llama.api_key, cfg, info=info, pid=llama.proc.pid)


def _metric(text: str, name: str, cls: str) -> float | None:
    """The sum of the class's samples of `name` (over its other labels); None when absent."""
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == name and s.labels.get("request_class") == cls]
    return sum(found) if found else None


def test_front_applies_the_class_policy_and_shows_it(llama: LlamaChild) -> None:
    with _front(llama, "honoured", {"en-prose": 0, "ko-prose": 1}) as (srv, _):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        before = _counters(llama.base_url, INTERNAL)
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": PROMPT}],
            max_tokens=N_PREDICT, temperature=0.0)
        assert raw.headers["x-mtpwrap-spec"] == "class=en-prose depth=0 source=profile"
        assert int((_counters(llama.base_url, INTERNAL) - before).drafted) == 0

        # The client's own field wins, and the bytes it sent reach llama-server as they were.
        body = json.dumps({"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0,
                           "speculative.n_max": 8})
        before = _counters(llama.base_url, INTERNAL)
        r = httpx.post(srv.url + "/completion", content=body, timeout=300,
                       headers={"authorization": f"Bearer {KEY}",
                                "content-type": "application/json"})
        assert r.headers["x-mtpwrap-spec"] == "class=en-prose depth=8 source=client"
        assert r.json()["timings"]["draft_n"] > 0
        assert int((_counters(llama.base_url, INTERNAL) - before).drafted) \
            == r.json()["timings"]["draft_n"]

        ko = ("대한민국의 주권은 국민에게 있고, 모든 권력은 국민으로부터 나온다. "
              "제2조 국민이 되는 요건은")
        r = httpx.post(srv.url + "/completion", timeout=300,
                       json={"prompt": ko, "n_predict": N_PREDICT, "temperature": 0.0},
                       headers={"authorization": f"Bearer {KEY}"})
        assert r.headers["x-mtpwrap-spec"] == "class=ko-prose depth=1 source=profile"
        timings = r.json()["timings"]
        assert 0 < timings["draft_n"] <= timings["predicted_n"]

        page = httpx.get(srv.url + "/metrics", headers={"authorization": f"Bearer {KEY}"},
                         timeout=30).text
        assert _metric(page, "mtpwrap_spec_requests_total", "en-prose") == 2
        assert _metric(page, "mtpwrap_spec_drafted_tokens_total", "ko-prose") \
            == timings["draft_n"]
        assert _metric(page, "mtpwrap_spec_accepted_tokens_total", "ko-prose") \
            == timings["draft_n_accepted"]
        assert _metric(page, "mtpwrap_spec_alpha", "ko-prose") is not None
        health = httpx.get(srv.url + "/healthz", headers={"authorization": f"Bearer {KEY}"},
                           timeout=30).json()
        table = health["spec_policy"]
        assert table["status"] == "active"
        assert table["classes"]["ko-prose"]["drafted"] == timings["draft_n"]
        assert table["classes"]["en-prose"]["profile_depth"] == 0


def test_front_on_an_unpatched_binary_says_unsupported(llama: LlamaChild) -> None:
    with _front(llama, "ignored", {"en-prose": 0}) as (srv, _):
        r = httpx.post(srv.url + "/completion", timeout=300,
                       json={"prompt": PROMPT, "n_predict": 8, "temperature": 0.0},
                       headers={"authorization": f"Bearer {KEY}"})
        assert r.headers["x-mtpwrap-spec"] == \
            "class=en-prose depth=8 source=unsupported why=probe-ignored"
        assert r.json()["timings"]["draft_n"] > 0  # the table's 0 was not sent
        health = httpx.get(srv.url + "/healthz", headers={"authorization": f"Bearer {KEY}"},
                           timeout=30).json()
        assert health["spec_policy"]["status"] == "unsupported"
