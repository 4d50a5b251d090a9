"""`bench embed` against the real front: `mtpwrap up` with the demo chat model and the demo
model as an embedding companion, each its own llama-server. Small sizes: 4 passages of 32 tokens
per corpus, 1 round, 16 chat tokens. The chat model and the embedder are the same model, so
/tokenize (the chat model's) counts what the embedder's usage says."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mtpwrap import proc
from mtpwrap.bench import corpora, embed, embed_report
from tests.helpers import Instance, cli_env, run_cli, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stand_in(llama_server_bin: Path, demo_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The front: `mtpwrap up` with the demo chat model and the demo model as its embedding
    companion (its own llama-server, `--embeddings --pooling mean`); its base URL once both
    are ready. One llama-server serving both cannot stand in for it: with embeddings
    arriving back to back it can leave a chat request without a slot indefinitely."""
    folder = tmp_path_factory.mktemp("embed")
    profile = folder / "with-embedder.yaml"
    profile.write_text(yaml.safe_dump({
        "description": "The demo model on the CPU with an embedding companion",
        "hardware": {"requires_gpu": False}, "model": str(demo_model), "context": 2048,
        "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "none"}, "gpu_layers": 0,
        "slots": 1, "threads": 1,
        "companions": [{"role": "embedding", "name": "embed", "model": str(demo_model),
                        "pooling": "mean", "context": 2048, "slots": 4, "threads": 1}]}))
    inst = Instance(folder / "home", proc.free_loopback_port(), llama_server_bin, demo_model,
                    log=folder / "up.log", profile=str(profile))
    try:
        inst.wait_ready(180)
        wait_for("the embedding companion ready", lambda: httpx.get(
            f"{inst.base}/readyz", params={"model": "embed"}, timeout=10).status_code == 200,
                 120)
        yield inst.base
    finally:
        inst.stop()


def _count(base: str, text: str) -> int:
    """Tokens of `text` as llama-server's own /tokenize counts an embedding input (with the
    special tokens an embedding request adds)."""
    r = httpx.post(f"{base}/tokenize", json={"content": text, "add_special": True}, timeout=30)
    r.raise_for_status()
    return len(r.json()["tokens"])


def test_embed_bench_measures_the_real_server(stand_in: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Each corpus is read once: loading the licence corpus parses 1,161 YAML headers (seconds
    # here), and the recount below makes the same passages again from the same corpus.
    monkeypatch.setattr(corpora, "load", functools.cache(corpora.load))
    doc_tokens = 32
    plan = embed.EmbedPlan(url=stand_in, corpora=["ruling", "licence"], doc_tokens=doc_tokens,
                           docs=4, batch=2, concurrency=[1, 2], rounds=1, chat_tokens=16)
    res = embed.run(plan)

    # Passages: 4 per corpus, each cut at 32 tokens (less a split character at either end).
    for name in ("ruling", "licence"):
        rec = res["corpora"][name]
        assert rec["passages"] == 4
        assert rec["documents"] and all(d["sha256"] for d in rec["documents"])
        assert all(doc_tokens - 8 <= n <= doc_tokens for n in rec["tokenize_counts"]), rec[
            "tokenize_counts"]

    # Embedding: one row per corpus and level, every passage once, tokens from usage equal
    # to what /tokenize says of the same passages.
    rows = {(r["corpus"], r["concurrency"]): r for r in res["embed"]}
    assert set(rows) == {("ruling", 1), ("ruling", 2), ("licence", 1), ("licence", 2)}
    for (name, _conc), r in rows.items():
        assert r["docs"] == 4 and r["requests"] == 2
        assert r["prompt_tokens"] == sum(res["corpora"][name]["tokenize_counts"])
        assert r["docs_per_s"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["prompt_tokens"] / r["wall_s"])
        assert r["wall_s"] >= max(r["request_s"])

    # The same passages, counted here independently of the benchmark.
    front = embed.Front(stand_in, None)
    try:
        again = embed.make_passages(front, "licence", 4, doc_tokens)
    finally:
        front.close()
    assert [_count(stand_in, t) for t in again.texts] == res["corpora"]["licence"][
        "tokenize_counts"]
    reply = httpx.post(f"{stand_in}/v1/embeddings", json={"input": again.texts[:2]},
                       timeout=120).json()
    assert reply["usage"]["prompt_tokens"] == sum(_count(stand_in, t) for t in again.texts[:2])

    # Chat: both rows of the round, 16 tokens each, a decode rate from llama-server's timings
    # and one from the stream; the busy one had the background load running.
    chat = {c["state"]: c for c in res["chat"]}
    assert set(chat) == {"idle", "busy"}
    for c in chat.values():
        assert c["tokens"] == 16 == c["timings"]["predicted_n"]
        assert c["decode_source"] == "timings"
        assert c["decode_tokens_per_s"] > 0 and c["stream_decode_tokens_per_s"] > 0
    bg = chat["busy"]["background"]
    assert bg["requests"] >= 1 and bg["docs"] == 2 * bg["requests"] and bg["prompt_tokens"] > 0
    s = res["summary"]
    assert s["busy_over_idle"] == pytest.approx(
        chat["busy"]["decode_tokens_per_s"] / chat["idle"]["decode_tokens_per_s"])
    assert res["front"]["chat_model_answered"] and res["front"]["models_listed"]

    columns, table = embed_report.table(res)
    assert columns[-2:] == ["round 1", "median"]
    assert [r[0] for r in table][-7:] == ["chat decode t/s", "chat decode t/s",
                                          "chat busy ÷ idle", "chat first token s",
                                          "chat first token s", "background docs/s",
                                          "background answers in decode"]
    assert chat["busy"]["ttft_s"] > 0 and chat["idle"]["ttft_s"] > 0
    files = embed_report.write(res, tmp_path / "report")
    assert json.loads(files["json"].read_text())["summary"] == json.loads(json.dumps(s))


def test_the_command_prints_json_and_writes_the_report(stand_in: str, tmp_path: Path) -> None:
    out = tmp_path / "report"
    r = run_cli("bench", "--url", stand_in, "embed", "--corpora", "en", "--docs", "2",
                "--doc-tokens", "32", "--batch", "2", "--concurrency", "1", "--rounds", "1",
                "--chat-tokens", "8", "--json", "--out", str(out),
                env=cli_env(COLUMNS="200"), timeout=120)
    assert r.returncode == 0, r.output
    res = json.loads(r.stdout)
    assert res["plan"]["url"] == stand_in  # from `bench --url`
    assert [(e["corpus"], e["concurrency"], e["docs"]) for e in res["embed"]] == [("en", 1, 2)]
    assert {c["state"] for c in res["chat"]} == {"idle", "busy"}
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    assert "chat busy ÷ idle" in (out / "report.md").read_text()
