"""Companions on the real llama-server: `mtpwrap up` with the demo chat model and an embedding
companion (the demo model served with `--embeddings --pooling mean`), or a reranker (the demo
model with `--reranking`, the smallest model this llama-server takes for it), through the
official `openai` client and plain HTTP.

- chat and embeddings answered at the same time; the same text embedded twice is identical;
- /v1/models lists both; /readyz stays the chat model's, /readyz?model=NAME is the companion's;
- killing the companion leaves chat answering, and the companion comes back;
- /v1/rerank and /rerank reach the reranker; /v1/embeddings on a node without an embedding
  companion still gets llama-server's own answer from the chat model.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from mtpwrap.proc import free_loopback_port
from tests.helpers import Instance, audit_lines, wait_for

pytestmark = pytest.mark.integration


def _profile(folder: Path, model: Path, companions: list[dict[str, object]]) -> Path:
    path = folder / "with-companions.yaml"
    path.write_text(yaml.safe_dump({
        "description": "The demo model on the CPU, with companions",
        "hardware": {"requires_gpu": False}, "model": str(model), "context": 2048,
        "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "none"}, "gpu_layers": 0,
        "slots": 1, "threads": 1, "companions": companions}))
    return path


def _up(tmp_path: Path, binary: Path, model: Path, companions: list[dict[str, object]]
        ) -> Iterator[Instance]:
    profile = _profile(tmp_path, model, companions)
    inst = Instance(tmp_path / "home", free_loopback_port(), binary, model,
                    log=tmp_path / "up.log", profile=str(profile))
    try:
        inst.wait_ready(180)
        yield inst
    finally:
        inst.stop()


@pytest.fixture
def with_embedding(tmp_path: Path, llama_server_bin: Path, demo_model: Path
                   ) -> Iterator[Instance]:
    yield from _up(tmp_path, llama_server_bin, demo_model, [
        {"role": "embedding", "name": "legal-embed", "model": str(demo_model),
         "pooling": "mean", "context": 512, "threads": 1}])


def _companion(base: str, name: str) -> dict[str, object]:
    health = httpx.get(f"{base}/healthz", timeout=10).json()
    return next(c for c in health["companions"] if c["name"] == name)


def _companion_ready(base: str, name: str) -> bool:
    return httpx.get(f"{base}/readyz", params={"model": name}, timeout=10).status_code == 200


def test_chat_and_embeddings_side_by_side(with_embedding: Instance) -> None:
    base = with_embedding.base
    wait_for("the embedding companion ready", lambda: _companion_ready(base, "legal-embed"),
             120)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    text = "The lessee shall return the premises in their original condition."

    answers: dict[str, object] = {}

    def chat() -> None:
        answers["chat"] = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
            temperature=0)

    def embed(key: str) -> None:
        answers[key] = client.embeddings.create(model="legal-embed", input=text)

    threads = [threading.Thread(target=chat), threading.Thread(target=embed, args=("e1",)),
               threading.Thread(target=embed, args=("e2",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    chat_answer = answers["chat"]
    assert isinstance(chat_answer, openai.types.chat.ChatCompletion)
    assert chat_answer.choices[0].message.content
    e1, e2 = answers["e1"], answers["e2"]
    assert isinstance(e1, openai.types.CreateEmbeddingResponse)
    assert isinstance(e2, openai.types.CreateEmbeddingResponse)
    v1, v2 = e1.data[0].embedding, e2.data[0].embedding
    assert len(v1) == 576  # SmolLM2-135M's hidden size
    assert v1 == v2  # the same text, the same vector, bit for bit
    assert e1.model == "legal-embed"
    assert e1.usage.prompt_tokens > 0

    # /v1/models lists the chat model and the companion
    listed = {m.id: m for m in client.models.list()}
    assert "legal-embed" in listed
    assert any(i.endswith(".gguf") for i in listed), listed

    # the audit trail and /metrics name the companion that answered
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'mtpwrap_model_requests_total{model="legal-embed",status="2xx"} 2.0' in metrics
    assert 'mtpwrap_companion_state{model="legal-embed",role="embedding",state="ready"} 1.0' \
        in metrics
    page = httpx.get(f"{base}/status.json", timeout=10).json()
    assert [(c["name"], c["role"], c["state"]) for c in page["companions"]] == [
        ("legal-embed", "embedding", "ready")]
    audit_dir = Path(with_embedding.env["MTPWRAP_HOME"]) / "audit"

    def embeddings(lines: list[dict]) -> int:
        return sum(1 for r in lines if r["route"] == "/v1/embeddings"
                   and r["model"] == "legal-embed" and r["status"] == 200)

    assert embeddings(audit_lines(audit_dir, lambda lines: embeddings(lines) >= 2)) == 2


def test_a_companion_crash_leaves_chat_alone(with_embedding: Instance) -> None:
    base = with_embedding.base
    wait_for("the embedding companion ready", lambda: _companion_ready(base, "legal-embed"),
             120)
    before = _companion(base, "legal-embed")
    pid = before["pid"]
    assert isinstance(pid, int)
    os.kill(pid, signal.SIGKILL)
    wait_for("the companion noticed gone", lambda: _companion(base, "legal-embed")["pid"] != pid,
             30)
    # the chat model never stopped being ready, and answers while the companion is away
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    wait_for("the companion back", lambda: _companion_ready(base, "legal-embed"), 120)
    after = _companion(base, "legal-embed")
    assert after["restarts"] == before["restarts"] + 1  # type: ignore[operator]
    assert after["pid"] != pid
    r = httpx.post(f"{base}/v1/embeddings", json={"input": "again", "model": "legal-embed"},
                   timeout=60)
    assert r.status_code == 200, r.text
    code, status = with_embedding.status()
    assert code == 0
    assert [c["name"] for c in status["companions"]] == ["legal-embed"]
    assert status["companions"][0]["state"] == "ready"


@pytest.fixture
def with_reranker(tmp_path: Path, llama_server_bin: Path, demo_model: Path
                  ) -> Iterator[Instance]:
    yield from _up(tmp_path, llama_server_bin, demo_model, [
        {"role": "rerank", "model": str(demo_model), "context": 512, "threads": 1}])


def test_rerank_routed_to_the_reranker(with_reranker: Instance) -> None:
    base = with_reranker.base
    wait_for("the reranker ready", lambda: _companion_ready(base, "rerank"), 120)
    docs = ["A lease is a contract for the use of property.", "The cat sat on the mat.",
            "Rent is due on the first day of each month."]
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(f"{base}{path}", timeout=60, json={
            "model": "rerank", "query": "When is the rent due?", "documents": docs})
        assert r.status_code == 200, r.text
        assert r.headers["x-mtpwrap-answered-by"] == "llama-server"
        results = r.json()["results"]
        assert sorted(x["index"] for x in results) == [0, 1, 2]
        assert all(isinstance(x["relevance_score"], float) for x in results)
    # no embedding companion here: the chat model's llama-server answers for itself
    r = httpx.post(f"{base}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 501, r.text
    assert "embeddings" in r.text.lower()
    # an unknown readiness name is a 404 that lists the names
    r = httpx.get(f"{base}/readyz", params={"model": "nope"}, timeout=10)
    assert r.status_code == 404 and "rerank" in r.json()["reason"]
