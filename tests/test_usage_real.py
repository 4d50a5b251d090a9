"""No request is free, on the real llama-server (`mtpwrap up`: the demo chat model with an
embedding or a rerank companion made of the same model), with a key that has a token budget:

- an answer whose counts are left out (`/completion` with `response_fields`) is charged its
  reservation, which is no less than what llama-server computed;
- an answer whose counts sit before a hundred KiB of probabilities (`n_probs`) is charged its
  counts, and a batch of prompts the sum of its answers';
- native `/embedding` and a TEI-style rerank, whose answers say no counts, are charged their
  reservation, no less than what llama-server computed (its own count, asked the other way);
- `"stream": true` on `/v1/embeddings`, which does not stream, gets its JSON answer (not an
  event stream that ends in a 502 once `keepalive_s` passes), charged its usage;
- counting tokens (`/v1/messages/count_tokens`, the `input_tokens` routes) costs none (like
  `/tokenize`, which always cost none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mtpwrap.front.usage import BYTES_PER_TOKEN
from mtpwrap.proc import free_loopback_port
from tests.helpers import Instance, cli_env, run_cli, wait_for

pytestmark = pytest.mark.integration

KEYS = {"metered": "metered-key-5e4d3c2b1a", "free": "free-key-0f9e8d7c6b"}
KEY_FILE = f"""{KEYS['metered']} name=metered tokens_per_day=10000000
{KEYS['free']} name=free
"""
PROMPT = "Write a story about a lighthouse keeper and the ships she guides."
TEXT = " ".join(f"Clause {i}: the lessee shall return item {i * 7} by day {i % 28 + 1}."
                for i in range(12))


class Up:
    def __init__(self, home: Path, binary: Path, model: Path, companion: str) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        keys = home / "keys"
        keys.write_text(KEY_FILE)
        keys.chmod(0o600)
        profile = home / "with-companions.yaml"
        profile.write_text(yaml.safe_dump({
            "description": "The demo model on the CPU, with companions",
            "hardware": {"requires_gpu": False}, "model": str(model), "context": 4096,
            "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "none"}, "gpu_layers": 0,
            "slots": 1, "threads": 1, "companions": [  # one: a thread each on two cores
                {"role": companion, "name": companion, "model": str(model), "context": 512,
                 "threads": 1, **({"pooling": "mean"} if companion == "embedding" else {})}]}))
        # keep-alive comments after 10 ms without a byte: a request that does not stream
        # must never get one
        self.inst = Instance(home, free_loopback_port(), binary, model, log=home / "up.log",
                             profile=str(profile), MTPWRAP_API_KEY_FILE=str(keys),
                             MTPWRAP_PROXY_KEEPALIVE_S="0.01")
        self.inst.wait_ready(180)
        self.base = self.inst.base
        wait_for(f"the {companion} companion ready", lambda: httpx.get(
            f"{self.base}/readyz", params={"model": companion}, timeout=10).status_code == 200,
                 120)

    def lines(self, route: str) -> list[dict[str, Any]]:
        """The metered key's audit lines on `route`."""
        return [x for f in sorted((self.home / "audit").glob("audit-*.jsonl"))
                for text in f.read_text().splitlines() if text.strip()
                for x in [json.loads(text)] if x["key"] == "metered" and x["route"] == route]

    def post(self, key: str, path: str, body: dict[str, Any]
             ) -> tuple[httpx.Response, bytes, dict[str, Any]]:
        """The request as sent (its bytes: the reservation is counted on them), its answer,
        and (for the metered key) its audit line once written."""
        seen = len(self.lines(path))
        raw = json.dumps(body).encode()
        r = httpx.post(self.base + path, content=raw, timeout=180, headers={
            "authorization": f"Bearer {KEYS[key]}", "content-type": "application/json"})
        if key != "metered":
            return r, raw, {}
        wait_for(f"the audit line of {path}", lambda: len(self.lines(path)) > seen, 60)
        return r, raw, self.lines(path)[seen]

    def usage(self) -> tuple[int, int]:
        """The metered key's prompt and completion tokens, as `mtpwrap usage` sums them."""
        r = run_cli("usage", "--by", "key", "--json", env=cli_env(MTPWRAP_HOME=str(self.home)))
        assert r.returncode == 0, r.stderr
        row = next((x for x in json.loads(r.stdout)["rows"] if x["key"] == "metered"), {})
        return row.get("prompt_tokens", 0), row.get("completion_tokens", 0)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
       demo_model: Path) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("usage") / "home", llama_server_bin, demo_model,
           "embedding")
    try:
        yield u
    finally:
        u.inst.stop()


@pytest.fixture
def with_reranker(tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> Iterator[Up]:
    u = Up(tmp_path / "home", llama_server_bin, demo_model, "rerank")
    try:
        yield u
    finally:
        u.inst.stop()


def _reserved(raw: bytes, generated: int = 0) -> int:
    """The reservation of a request of these bytes that may generate `generated` tokens."""
    return -(-len(raw) // BYTES_PER_TOKEN) + generated


def _charged(line: dict[str, Any]) -> int:
    return (line["prompt_tokens"] or 0) + (line["completion_tokens"] or 0)


def test_an_answer_without_its_counts_is_charged_its_reservation(up: Up) -> None:
    body = {"prompt": PROMPT, "n_predict": 40, "ignore_eos": True, "temperature": 0}
    truth, _, _ = up.post("free", "/completion", body)
    assert truth.status_code == 200, truth.text
    computed = truth.json()["tokens_evaluated"] + truth.json()["tokens_predicted"]
    before = up.usage()
    r, raw, line = up.post("metered", "/completion", {**body, "response_fields": ["content"]})
    assert r.status_code == 200 and list(r.json()) == ["content"], r.text
    print(f"response_fields: charged {line['prompt_tokens']} + {line['completion_tokens']} "
          f"({line['tokens_from']}); llama-server computed {computed}")
    assert line["tokens_from"] == "reserved", line
    assert _charged(line) == _reserved(raw, 40) >= computed
    assert line["completion_tokens"] == 40
    after = up.usage()
    assert sum(after) - sum(before) == _charged(line)


def test_counts_are_read_wherever_the_answer_puts_them(up: Up) -> None:
    # n_probs: llama-server writes the counts first, then the probabilities (~1.7 KiB a token)
    r, _, line = up.post("metered", "/completion", {
        "prompt": PROMPT, "n_predict": 100, "n_probs": 20, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = r.json()
    print(f"n_probs: {len(r.content)} bytes, charged {line['prompt_tokens']} + "
          f"{line['completion_tokens']} ({line['tokens_from']})")
    assert len(r.content) > 64 * 1024
    assert (line["prompt_tokens"], line["completion_tokens"], line["tokens_from"]) == (
        answer["tokens_evaluated"], answer["tokens_predicted"], "answer")
    assert line["completion_tokens"] == 100
    # a batch of prompts: one answer each, every one charged
    r, _, line = up.post("metered", "/completion", {"prompt": ["Say one.", "Say two, please."],
                                                    "n_predict": 5, "ignore_eos": True})
    assert r.status_code == 200 and isinstance(r.json(), list), r.text
    assert (line["prompt_tokens"], line["completion_tokens"], line["tokens_from"]) == (
        sum(a["tokens_evaluated"] for a in r.json()), 10, "answer")


def test_a_native_embedding_without_counts_is_charged_its_reservation(up: Up) -> None:
    # native /embedding says no counts; /v1/embeddings says llama-server's for the same text
    truth, _, _ = up.post("free", "/v1/embeddings", {"model": "embedding", "input": TEXT})
    assert truth.status_code == 200, truth.text
    computed = truth.json()["usage"]["prompt_tokens"]
    r, raw, line = up.post("metered", "/embedding", {"model": "embedding", "content": TEXT})
    assert r.status_code == 200 and isinstance(r.json(), list), r.text[:200]
    print(f"/embedding: charged {_charged(line)} ({line['tokens_from']}); llama-server "
          f"computed {computed}")
    assert (line["tokens_from"], _charged(line)) == ("reserved", _reserved(raw))
    assert _charged(line) >= computed


def test_a_tei_rerank_without_counts_is_charged_its_reservation(with_reranker: Up) -> None:
    up = with_reranker
    # a TEI-style rerank (`texts`) says no counts; the Jina style (`documents`) says them. A
    # long query with short documents: llama-server reads the query once per document
    query = "Which of these clauses says when the lessee must return what was lent? " * 3
    docs = ["Rent is due monthly.", "Items go back by day 9.", "Cats sit.", "Leases end."]
    truth, _, _ = up.post("free", "/v1/rerank", {"model": "rerank", "query": query,
                                                 "documents": docs})
    assert truth.status_code == 200, truth.text
    computed = truth.json()["usage"]["prompt_tokens"]
    r, raw, line = up.post("metered", "/v1/rerank", {"model": "rerank", "query": query,
                                                     "texts": docs})
    assert r.status_code == 200 and isinstance(r.json(), list), r.text
    print(f"TEI rerank: charged {_charged(line)} ({line['tokens_from']}); llama-server "
          f"computed {computed}; the body's estimate {_reserved(raw)}")
    assert line["tokens_from"] == "reserved", line
    assert _charged(line) >= computed > _reserved(raw)


def test_a_stream_asked_of_a_route_that_does_not_stream_is_its_answer(up: Up) -> None:
    r, _, line = up.post("metered", "/v1/embeddings", {"model": "embedding", "input": TEXT,
                                                       "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert (line["status"], line["prompt_tokens"], line["tokens_from"]) == (
        200, r.json()["usage"]["prompt_tokens"], "answer")


@pytest.mark.parametrize("path,body", [
    ("/v1/messages/count_tokens", {"model": "demo", "messages": [
        {"role": "user", "content": TEXT}]}),
    ("/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": TEXT}]}),
    ("/v1/responses/input_tokens", {"input": TEXT}),
])
def test_counting_tokens_costs_none(up: Up, path: str, body: dict[str, Any]) -> None:
    before = up.usage()
    r, _, line = up.post("metered", path, body)
    assert r.status_code == 200, r.text
    assert (line["prompt_tokens"], line["completion_tokens"], line["tokens_from"]) == (
        None, None, None), line
    assert up.usage() == before
