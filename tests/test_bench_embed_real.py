"""`bench embed` against the real llama-server on the demo model, standing in for the front.

llama-server started with `--embeddings --pooling mean` answers both `/v1/embeddings` and
`/v1/chat/completions`, as the front does with an embedding companion beside the chat model.
Small sizes: 4 passages of 64 tokens per corpus, 1 round, 16 chat tokens.

The stand-in has 8 slots: more than the background load keeps in flight (2 workers × 2
passages), so the chat request always finds one free (with every slot taken by embeddings, a
chat request was seen waiting over 600 s for one); and a power of two: with `--pooling mean`
this build aborts at load (GGML_ASSERT ggml_can_mul_mat) for 3, 5, 6, 9, 10 or 12 slots."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mtpwrap import proc
from mtpwrap.bench import embed, embed_report
from tests.helpers import cli_env, run_cli

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stand_in(llama_server_bin: Path, demo_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The front's stand-in: its base URL, once /health says ok (polled, with a deadline)."""
    port = proc.free_loopback_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(llama_server_bin), "-m", str(demo_model), "--embeddings", "--pooling", "mean",
            "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "8", "-t", "1"]
    log = tmp_path_factory.mktemp("embed") / "llama-server.log"
    with proc.running_server(argv, base_url=base, log_path=log, timeout=60,
                             env={"LD_LIBRARY_PATH": str(llama_server_bin.parent)}):
        yield base


def _count(base: str, text: str) -> int:
    """Tokens of `text` as llama-server's own /tokenize counts an embedding input (with the
    special tokens an embedding request adds)."""
    r = httpx.post(f"{base}/tokenize", json={"content": text, "add_special": True}, timeout=30)
    r.raise_for_status()
    return len(r.json()["tokens"])


def test_embed_bench_measures_the_real_server(stand_in: str, tmp_path: Path) -> None:
    plan = embed.EmbedPlan(url=stand_in, corpora=["ruling", "licence"], doc_tokens=64, docs=4,
                           batch=2, concurrency=[1, 2], rounds=1, chat_tokens=16)
    res = embed.run(plan)

    # Passages: 4 per corpus, each cut at 64 tokens (less a split character at either end).
    for name in ("ruling", "licence"):
        rec = res["corpora"][name]
        assert rec["passages"] == 4
        assert rec["documents"] and all(d["sha256"] for d in rec["documents"])
        assert all(56 <= n <= 64 for n in rec["tokenize_counts"]), rec["tokenize_counts"]

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
        again = embed.make_passages(front, "licence", 4, 64)
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
