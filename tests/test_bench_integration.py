"""The bench against the real llama-server on the real demo model.

Known answer: the demo model drafting for itself at temperature 0 has every draft accepted, so
accepted ÷ drafted is exactly 1.0. Every count the bench reports must equal llama-server's own
`/metrics` counters and the response `timings`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtpwrap.bench import corpora, stats
from mtpwrap.bench.runner import BenchConfig, Client, bursts, launch_config
from tests.helpers import cli_env, run_cli

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_bin(request: pytest.FixtureRequest) -> Path:
    env = os.environ.get("MTPWRAP_BINARY")
    return Path(env) if env else request.getfixturevalue("llama_server_bin")


@pytest.fixture(scope="module")
def model(demo_model: Path) -> Path:
    return demo_model  # MTPWRAP_DEMO_MODEL, when set, is honoured by the models module


@pytest.fixture(scope="module")
def english() -> corpora.Corpus:
    return corpora.english_corpus()


def _serve(cfg: BenchConfig, server_bin: Path, model: Path, tmp: Path, tcp: bool = False
           ) -> Iterator[Client]:
    # One thread: multi-threaded CPU kernels are not bit-identical between a batch of 1 (the
    # drafter) and a batch of k+1 (verification), which breaks the self-draft's known answer.
    srv = launch_config(cfg, binary=server_bin, model=model, ctx_size=1024, threads=1,
                        log_path=tmp / f"{cfg.name}.log", tcp=tcp)
    client = Client.of(srv)
    try:
        yield client
    finally:
        client.close()
        assert srv.stop() is not None


@pytest.fixture(scope="module")
def self_draft(server_bin: Path, model: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Client]:
    yield from _serve(BenchConfig("draft", spec="draft", depth=3), server_bin, model,
                      tmp_path_factory.mktemp("draft"))


def _one(client: Client, corpus: corpora.Corpus, n_ctx: int = 256, n_predict: int = 33):
    prompt = corpora.build_prompt(corpus, n_ctx, client.tokenize)
    before = client.metrics()
    res = client.complete(prompt.tokens, n_predict)
    return prompt, res, client.metrics() - before


def test_self_draft_known_answer_and_counters_reconcile(self_draft: Client,
                                                        english: corpora.Corpus) -> None:
    prompt, res, c = _one(self_draft, english)
    assert prompt.n_tokens == 256 and c.prompt_tokens == 256
    # 33 = the token from prefill + 8 steps of 4: every step drafts the full depth.
    assert res.n == 33 == res.timings["predicted_n"] == c.predicted_tokens
    assert c.drafted > 0 and c.steps > 0
    s = stats.spec_stats(c, 3)
    assert s.acceptance_rate == 1.0  # exactly: the drafter is the target
    assert s.accepted == s.drafted
    assert res.timings["draft_n"] == c.drafted
    assert res.timings["draft_n_accepted"] == c.accepted
    # One counter per draft position, each hit on every step; they sum to the accepted total.
    assert len(c.per_pos) == 3 and sum(c.per_pos) == c.accepted
    assert all(p == c.steps for p in c.per_pos)
    assert s.alpha == 1.0 and s.mean_accepted_length == pytest.approx(4.0)


def test_stream_timing_recovers_accepted_runs(self_draft: Client,
                                              english: corpora.Corpus) -> None:
    """The rejection-hotspot method, measured where the truth is known: every step of the
    self-draft emits 4 tokens together. The inferred accepted count must match the counter."""
    _, res, c = _one(self_draft, english, n_predict=41)
    # The gap that separates steps, as `bench` takes it: a fifth of the server's own mean step
    # (about 100 ms here, more on a loaded machine). A fixed 2 ms split the steps of a loaded
    # machine, where the client read a step's 4 tokens as 1 + 3: [4, 1, 3, 1, 3, ...], 22
    # inferred for 30.
    assert c.n_decode > 0 and c.predicted_seconds > 0
    sizes = bursts(res.arrivals[1:], c.step_gap())
    inferred = sum(g - 1 for g in sizes)
    # Allow a few tokens of error from scheduling; the report states it.
    assert abs(inferred - c.accepted) <= 0.1 * res.n, (sizes, c)


def test_ngram_and_no_speculation_counters(server_bin: Path, model: Path, tmp_path: Path,
                                           english: corpora.Corpus) -> None:
    for client in _serve(BenchConfig("ngram", spec="ngram", depth=8), server_bin, model,
                         tmp_path):
        _, res, c = _one(client, english, n_predict=48)
        assert res.timings.get("draft_n", 0) == c.drafted
        assert res.timings.get("draft_n_accepted", 0) == c.accepted
        assert sum(c.per_pos) == c.accepted and c.accepted <= c.drafted
        assert c.steps > 0  # the licence texts repeat themselves: the n-gram drafter fires
    for client in _serve(BenchConfig("none"), server_bin, model, tmp_path):
        _, res, c = _one(client, english)
        assert c.drafted == 0 and c.steps == 0 and "draft_n" not in res.timings
        assert res.n == c.predicted_tokens


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_bench_quick_cli_writes_report(server_bin: Path, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = cli_env(MTPWRAP_BINARY=str(server_bin), MTPWRAP_DEMO_MODEL=str(model))
    # The smallest cells that still take every path: two contexts (the speed plot's two
    # points), 8 tokens (the CLI's least: the prefill token and two verification steps of the
    # self-draft); the quality and load requests shrink with them (32 tokens read, 8 made).
    p = run_cli("bench", "--quick", "--contexts", "16,32", "--concurrency", "1,2",
                "--n-predict", "8", "--out", str(out), env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((out / "report.json").read_text())
    s = results["summary"]
    assert s["reconciled"] is True
    names = [c["name"] for c in results["plan"]["configs"]]
    assert names == ["baseline", "draft", "ngram", "kv-q8_0", "draft+kv-q8_0"]
    draft = {r["lang"]: r for r in s["speculation"] if r["config"] == "draft"}
    assert set(draft) == {"ko", "en"}
    assert draft["ko"]["acceptance_rate"] == 1.0 and draft["en"]["acceptance_rate"] == 1.0
    # The report's pooled counts are the sums of the per-request server counters.
    cells = [c for c in results["cells"] if c["config"] == "draft" and c["lang"] == "ko"]
    assert draft["ko"]["drafted"] == sum(c["counters"]["drafted"] for c in cells)
    assert draft["ko"]["drafted"] == sum(c["timings"]["draft_n"] for c in cells)
    assert results["provenance"]["corpora"]["ko"]["archive_sha256"] == corpora.KONLPY.sha256
    # KV actually allocated: q8_0 is 34 bytes per 32 values, f16 2 bytes per value.
    kv = s["kv_bytes_per_value"]
    assert kv["kv-q8_0"]["k_type"] == "q8_0" and kv["baseline"]["k_type"] == "f16"
    assert kv["kv-q8_0"]["k_bytes_per_value"] == pytest.approx(34 / 32, rel=0.01)
    assert kv["baseline"]["v_bytes_per_value"] == pytest.approx(2.0, rel=0.01)
    md = (out / "report.md").read_text()
    assert "Korean decode t/s" in md and "English decode t/s" in md
    # No --gap-ms: each cell separates steps by a fifth of the server's own mean step there.
    streamed = [c for c in results["cells"] if "stream" in c]
    assert streamed and all(c["stream"]["gap_s"] == stats.Counters(**c["counters"]).step_gap()
                            for c in streamed)
    assert "a fifth of the server's own mean step in that cell" in md
    assert "## Definitions" in md and "accepted ÷ drafted" in md
    for png in ("speed_vs_context.png", "acceptance_by_position.png",
                "rejection_by_class.png"):
        w, h = _png_size(out / png)
        assert w >= 600 and h >= 400
    assert {r["concurrency"] for r in results["load"]} == {1, 2}
    assert all(not r["errors"] for r in results["load"])
    # Greedy speculation is lossless: the self-draft output equals the baseline's.
    q = {(r["config"], r["lang"]): r for r in s["quality"]}
    assert q[("draft", "en")]["agree_prefix"] == q[("draft", "en")]["compared"]


def test_bench_against_a_running_server(server_bin: Path, model: Path, tmp_path: Path) -> None:
    """`--url`: the bench is only a client; speculation is detected from the counters."""
    out = tmp_path / "report"
    # a server another program is given by URL: loopback TCP
    for client in _serve(BenchConfig("draft", spec="draft", depth=2), server_bin, model,
                         tmp_path, tcp=True):
        assert client.socket is None
        p = run_cli("bench", "--url", client.base_url, "--contexts", "64", "--langs", "en",
                    "--concurrency", "1", "--n-predict", "16", "--out", str(out),
                    env=cli_env(), timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((out / "report.json").read_text())
    spec = results["summary"]["speculation"]
    assert [(r["config"], r["depth"], r["acceptance_rate"]) for r in spec] == [
        ("running", 2, 1.0)]
    assert results["summary"]["reconciled"] is True
