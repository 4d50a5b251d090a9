"""`mtpwrap bench embed`'s pure parts: cutting and batching passages, the decode rate, the
medians and ratio, the table, the report's shape, and the option errors a person meets.

The measurement against a real llama-server is tests/test_bench_embed_real.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpwrap.bench import embed, embed_report
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError
from tests.helpers import run_cli


def test_batches_keep_order_and_the_last_holds_the_rest() -> None:
    docs = [f"d{i}" for i in range(10)]
    got = embed.batches(docs, 4)
    assert got == [["d0", "d1", "d2", "d3"], ["d4", "d5", "d6", "d7"], ["d8", "d9"]]
    assert [d for b in got for d in b] == docs
    assert embed.batches(docs, 10) == [docs]
    assert embed.batches(docs, 11) == [docs]
    assert embed.batches([], 3) == []
    with pytest.raises(ConfigError, match="--batch"):
        embed.batches(docs, 0)


def test_passages_are_exactly_doc_tokens_long_and_a_short_tail_is_dropped() -> None:
    tokens = list(range(100, 111))  # 11 ids
    got = embed.passages(tokens, 4)
    assert got == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert all(len(p) == 4 for p in got)
    assert embed.passages(tokens, 11) == [tokens]
    assert embed.passages(tokens, 12) == []
    with pytest.raises(ConfigError, match="--doc-tokens"):
        embed.passages(tokens, 0)


def test_a_cut_character_is_dropped_at_either_end_only() -> None:
    assert embed.trim_cut("\ufffd\ufffd판결 요지\ufffd") == "판결 요지"
    assert embed.trim_cut("a\ufffdb") == "a\ufffdb"
    assert embed.trim_cut("plain text") == "plain text"


def test_stream_decode_rate_is_tokens_after_the_first_over_time_after_the_first() -> None:
    # 5 tokens: the first at 0.10 s, the last at 0.50 s: 4 tokens in 0.4 s
    assert embed.stream_decode_rate([0.10, 0.20, 0.30, 0.50], 5) == pytest.approx(10.0)
    assert embed.stream_decode_rate([0.10], 1) is None
    assert embed.stream_decode_rate([0.10, 0.10], 2) is None  # no time between: no rate
    assert embed.rate(10, 0.0) is None and embed.rate(10, 2.0) == 5.0


def test_median_ratio_and_cpu_model(tmp_path: Path) -> None:
    assert embed_report.median([3.0, None, 1.0, 2.0]) == 2.0
    assert embed_report.median([1.0, 2.0]) == 1.5
    assert embed_report.median([None]) is None
    assert embed_report.ratio(30.0, 40.0) == 0.75
    assert embed_report.ratio(None, 40.0) is None and embed_report.ratio(30.0, 0.0) is None
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "model name\t: AMD EPYC 7B13 64-Core Processor\n")
    assert hardware.cpu_model(info) == "AMD EPYC 7B13 64-Core Processor"
    assert hardware.cpu_model(tmp_path / "missing")  # falls back to something, never fails


def _results(rounds: int = 3) -> dict:
    """A run as `embed.run` records it: 2 corpora × concurrency 1, 2 × `rounds`."""
    plan = embed.EmbedPlan(url="http://127.0.0.1:9", api_key="secret", rounds=rounds,
                           docs=16, batch=4, doc_tokens=64)
    res: dict = {"schema": embed.SCHEMA, "kind": "bench-embed", "started": "2026-01-01T00:00:00",
                 "finished": "2026-01-01T00:01:00", "plan": plan.to_dict(),
                 "machine": {"cpu_model": "Test CPU", "cpu_count": 2,
                             "loadavg_start": [0.5, 0.25, 0.125]},
                 "corpora": {"ruling": {"attribution": None},
                             "licence": {"attribution": "CC-BY-4.0 licence texts"}},
                 "embed": [], "chat": []}
    for rnd in range(1, rounds + 1):
        for name, per_doc in (("ruling", 62), ("licence", 64)):
            for conc in (1, 2):
                wall = 2.0 / (conc * rnd)
                res["embed"].append({
                    "round": rnd, "corpus": name, "concurrency": conc, "docs": 16,
                    "prompt_tokens": 16 * per_doc, "wall_s": wall,
                    "docs_per_s": 16 / wall, "tokens_per_s": 16 * per_doc / wall,
                    "tokens_per_doc": float(per_doc)})
        idle, busy = 40.0 + rnd, 20.0 + rnd
        res["chat"].append({"round": rnd, "state": "idle", "decode_tokens_per_s": idle,
                            "decode_source": "timings", "ttft_s": 0.01 * rnd})
        res["chat"].append({"round": rnd, "state": "busy", "decode_tokens_per_s": busy,
                            "decode_source": "timings", "ttft_s": 1.0 + rnd,
                            "background": {"docs_per_s": 5.0 * rnd,
                                           "answers_during_decode": rnd - 1}})
    res["summary"] = embed_report.summarize(res)
    return res


def test_summary_takes_medians_over_rounds_and_the_ratio_of_the_medians() -> None:
    s = _results()["summary"]
    assert s["chat_idle_decode_tokens_per_s"] == 42.0  # 41, 42, 43
    assert s["chat_busy_decode_tokens_per_s"] == 22.0  # 21, 22, 23
    assert s["busy_over_idle"] == pytest.approx(22 / 42)
    cell = {(e["corpus"], e["concurrency"]): e for e in s["embed"]}
    assert set(cell) == {("ruling", 1), ("ruling", 2), ("licence", 1), ("licence", 2)}
    # docs/s by round at concurrency 2: 16, 32, 48 -> 32
    assert cell[("ruling", 2)]["docs_per_s"] == pytest.approx(32.0)
    assert cell[("ruling", 2)]["tokens_per_s"] == pytest.approx(32.0 * 62)
    assert cell[("licence", 1)]["tokens_per_doc"] == 64.0
    assert all(e["rounds"] == 3 for e in s["embed"])


def test_table_shows_every_round_and_the_median_and_says_the_machine() -> None:
    res = _results()
    columns, rows = embed_report.table(res)
    assert columns == ["measure", "corpus / state", "conc", "round 1", "round 2", "round 3",
                       "median"]
    assert all(len(r) == len(columns) for r in rows)
    # 3 figures × 2 corpora × 2 levels; decode idle, busy, ratio; first token idle, busy;
    # background docs/s and answers
    assert len(rows) == 3 * 2 * 2 + 7
    by = {(r[0], r[1], r[2]): r[3:] for r in rows}
    assert by[("embed docs/s", "ruling", "2")] == ["16.0", "32.0", "48.0", "32.0"]
    assert by[("embed tokens/doc", "licence", "1")] == ["64.0", "64.0", "64.0", "64.0"]
    assert by[("chat decode t/s", "embedding idle", "–")] == ["41.0", "42.0", "43.0", "42.0"]
    assert by[("chat decode t/s", "embedding busy", "2")] == ["21.0", "22.0", "23.0", "22.0"]
    assert by[("chat busy ÷ idle", "", "")] == [f"{21 / 41:.3f}", f"{22 / 42:.3f}",
                                                 f"{23 / 43:.3f}", f"{22 / 42:.3f}"]
    assert by[("chat first token s", "embedding idle", "–")] == ["0.010", "0.020", "0.030",
                                                                  "0.020"]
    assert by[("chat first token s", "embedding busy", "2")] == ["2.000", "3.000", "4.000",
                                                                  "3.000"]
    assert by[("background answers in decode", "all corpora", "2")] == ["0", "1", "2", "1"]
    assert embed.no_overlap(res) == [1]  # round 1's decode saw no embedding answer
    head = embed_report.title(res)
    assert "Test CPU" in head and "0.50 0.25 0.12" in head and "http://127.0.0.1:9" in head


def test_a_stream_only_decode_rate_is_labelled_and_a_missing_round_shows_a_dash() -> None:
    res = _results(rounds=2)
    for c in res["chat"]:
        c["decode_source"] = "stream"
    res["chat"] = [c for c in res["chat"] if not (c["round"] == 2 and c["state"] == "busy")]
    res["summary"] = embed_report.summarize(res)
    _, rows = embed_report.table(res)
    by = {(r[0], r[1]): r[3:] for r in rows}
    assert by[("chat decode t/s (stream)", "embedding busy")] == ["21.0", "–", "21.0"]
    assert by[("chat busy ÷ idle", "")][1] == "–"


def test_report_folder_holds_the_json_and_the_markdown_with_definitions(tmp_path: Path) -> None:
    res = _results()
    files = embed_report.write(res, tmp_path / "out")
    back = json.loads(files["json"].read_text())
    assert back["kind"] == "bench-embed" and back["schema"] == embed.SCHEMA
    assert "api_key" not in back["plan"] and "secret" not in files["json"].read_text()
    assert back["plan"]["load_concurrency"] == 2
    assert {"embed", "chat", "summary", "machine", "corpora"} <= set(back)
    md = files["md"].read_text()
    assert md.startswith("# bench embed, http://127.0.0.1:9: Test CPU")
    assert "| chat busy ÷ idle |" in md and "## Definitions" in md
    for term in embed_report.DEFINITIONS:
        assert f"**{term}**" in md
    assert "CC-BY-4.0 licence texts" in md  # the licence corpus's attribution
    assert "Copyright Act" in md  # the Korean rulings' note


def test_plan_refuses_unknown_corpora_and_out_of_range_sizes() -> None:
    with pytest.raises(ConfigError, match="--corpora .*ruling"):
        embed.EmbedPlan(url="http://x", corpora=["rulings"])
    with pytest.raises(ConfigError, match="twice"):
        embed.EmbedPlan(url="http://x", corpora=["en", "en"])
    with pytest.raises(ConfigError, match="--batch must be at least 1"):
        embed.EmbedPlan(url="http://x", batch=0)
    with pytest.raises(ConfigError, match="--concurrency"):
        embed.EmbedPlan(url="http://x", concurrency=[])
    assert embed.EmbedPlan(url="http://x", concurrency=[1, 4]).load_concurrency == 4
    plan = embed.EmbedPlan(url="http://x", rounds=2)
    assert embed.steps(plan) == 2 + 1 + 2 * (2 * 2 + 2)


@pytest.mark.parametrize(("args", "says"), [
    (["--concurrency", "1,x"], "--concurrency must be comma-separated integers, got '1,x'."),
    (["--concurrency", "0"], "--concurrency must list positive integers, got '0'."),
    (["--corpora", "ruling,nope"], "--corpora must list corpora among"),
    (["--doc-tokens", "4"], "--doc-tokens"),
])
def test_bad_options_get_one_sentence_naming_the_flag_before_anything_is_sent(
        args: list[str], says: str) -> None:
    # Port 9 (discard) on loopback: nothing answers there, so a refusal must come first.
    r = run_cli("bench", "embed", "--url", "http://127.0.0.1:9", *args, timeout=60)
    assert r.returncode == 78, r.output
    assert says in r.stderr
    assert "Traceback" not in r.output
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 3, r.stderr


def test_without_a_url_it_says_to_pass_one() -> None:
    r = run_cli("bench", "embed", timeout=60)
    assert r.returncode == 78, r.output
    assert "--url" in r.stderr and "Traceback" not in r.output


def test_embed_is_a_subcommand_of_bench() -> None:
    r = run_cli("bench", "--help", timeout=60)
    assert r.returncode == 0 and "embed" in r.stdout
    r = run_cli("bench", "embed", "--help", timeout=60)
    assert r.returncode == 0
    for flag in ("--doc-tokens", "--batch", "--concurrency", "--rounds", "--embed-model",
                 "--chat-model", "--json", "--out"):
        assert flag in r.stdout


def test_an_unreachable_front_is_one_sentence_before_any_corpus_is_read() -> None:
    r = run_cli("bench", "embed", "--url", "http://127.0.0.1:9", "--corpora", "en",
                "--docs", "2", "--rounds", "1", "--out", "/nonexistent/never-written",
                timeout=60)
    assert r.returncode != 0
    assert "http://127.0.0.1:9 did not answer" in r.stderr and "--url" in r.stderr
    assert "Traceback" not in r.output
