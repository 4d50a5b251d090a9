"""`bench docs` without a server: the report made from recorded numbers (a run of the tiny
hybrid model behind `mtpwrap up` on this machine's CPU), the step list, and bad input as one
sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpwrap.bench import docs, docs_report
from mtpwrap.errors import ConfigError
from tests.helpers import cli_env, run_cli


def _row(step: str, request: str, prompt_n: int, cache_n: int, prompt_ms: float,
         ttft: float, doc: str = "A", action: dict | None = None) -> dict:
    return {"step": step, "request": request, "document": doc, "document_tokens": 3000,
            "form": "same", "prompt_tokens": prompt_n + cache_n, "prompt_n": prompt_n,
            "cache_n": cache_n, "prompt_ms": prompt_ms,
            "read_tokens_per_s": docs.read_rate({"prompt_n": prompt_n, "prompt_ms": prompt_ms}),
            "ttft_s": ttft, "total_s": ttft + 0.05, "predicted_n": 8, "progress_events": 3,
            "progress_last": None, "timings": {"prompt_n": prompt_n, "cache_n": cache_n,
                                               "prompt_ms": prompt_ms},
            "usage": {"prompt_tokens": prompt_n + cache_n}, "model": "tiny", "action": action}


def recorded() -> dict:
    steps = [
        _row("cold", "A + question", 3027, 0, 1312.5, 1.41),
        _row("same", "A + question", 526, 2512, 204.0, 0.27),
        _row("separate", "A / question", 528, 2508, 207.9, 0.29),
        _row("other", "B + long question", 3530, 0, 1601.2, 1.70, "B"),
        _row("other", "B + question", 3031, 0, 1330.0, 1.44, "B"),
        _row("restart", "A + question", 3032, 0, 1318.7, 1.42,
             action={"action": "restart", "command_s": 2.1, "ready_after_s": 2.3,
                     "output": "restart: llama-server restarted"}),
    ]
    cell = _row("cold", "ubatch 32", 3027, 0, 2950.0, 3.05)
    cell.update({"ubatch": 32, "launch": {"profile": "tiny", "ubatch": 32, "batch": None,
                                          "context": 4096, "slots": 1, "threads": 2}})
    results = {
        "schema": 1, "kind": "bench-docs", "started": "2026-12-05T10:00:00+00:00",
        "finished": "2026-12-05T10:02:00+00:00",
        "plan": docs.DocsPlan(url=None, profile="tiny.yaml", doc_tokens=3000,
                              steps=["cold", "same", "separate", "other", "restart"],
                              ubatch=[32], command="mtpwrap bench docs --profile tiny.yaml"
                              ).to_dict(),
        "machine": {"cpu_model": "Example CPU", "cpu_count": 2, "loadavg_start": [1.5, 1.2, 1.0],
                    "loadavg_end": [1.9, 1.4, 1.1], "hardware": {"gpus": []}},
        "documents": {"A": {"tokens": 3000, "source": "licensedcode-data==32.1.0",
                            "lang": "en", "documents": [{"name": "x", "sha256": "0" * 64,
                                                         "tokens": 3000}],
                            "attribution": "licence texts, CC-BY-4.0"},
                      "B": {"tokens": 3000, "source": "licensedcode-data==32.1.0",
                            "lang": "en", "reversed": True, "documents": []}},
        "long_question_tokens": 512, "slot_context": 4096, "steps": steps, "ubatch": [cell],
        "provenance": {"model": {"path": "/m/tiny-qwen35-mtp.gguf", "bytes": 1234,
                                 "sha256": "ab" * 32},
                       "binary": {"binary": "/b/llama-server",
                                  "manifest": {"variant": "cpu",
                                               "binaries": {"llama-server": {
                                                   "sha256": "cd" * 32}},
                                               "patches": [{"name": "0001-x",
                                                            "status": "applied"},
                                                           {"name": "0002-y",
                                                            "status": "opted-out"}],
                                               "source": {"kind": "submodule",
                                                          "commit": "0c1e570"}}},
                       "binary_sha256": "cd" * 32, "binary_sha256_end": "ef" * 32,
                       "commit": "0c1e570", "profile": "tiny", "context": 4096,
                       "kv": "f16/f16", "speculation": "draft-mtp", "started_by_bench": True},
    }
    results["summary"] = docs_report.summarize(results)
    return results


def test_the_table_shows_each_requests_own_numbers_side_by_side() -> None:
    res = recorded()
    columns, rows = docs_report.table(res)
    assert columns == ["step", "request", "prompt", "read", "cached", "read s", "read t/s",
                       "first token s", "ready s"]
    assert [r[0] for r in rows] == ["cold", "same", "separate", "other", "other", "restart"]
    cold = rows[0]
    assert cold[2:] == ["3027", "3027", "0", "1.31", "2306.3", "1.41", "–"]
    assert rows[2][3:5] == ["528", "2508"]
    assert rows[-1][-1] == "2.3"  # the restart's wait until ready
    u_columns, u_rows = docs_report.ubatch_table(res)
    assert u_columns[0] == "ubatch" and u_rows == [["32", "3027", "0", "2.95", "1026.1", "3.05"]]


def test_the_summary_names_the_requests_that_read_their_document_again() -> None:
    s = recorded()["summary"]
    assert s["cold_read_tokens_per_s"] == pytest.approx(3027 / 1.3125)
    assert s["read_again"] == ["other: B + question", "restart: A + question"]
    assert s["ubatch_read_tokens_per_s"] == {"32": pytest.approx(3027 / 2.95)}


def test_the_report_states_machine_load_model_binary_and_every_raw_number(
        tmp_path: Path) -> None:
    res = recorded()
    files = docs_report.write(res, tmp_path)
    md = files["md"].read_text()
    for text in ("Example CPU, 2 CPUs; no GPU", "1.50 1.20 1.00 at the start",
                 "1.90 1.40 1.10 at the end", "`tiny-qwen35-mtp.gguf`, 1234 bytes",
                 "ab" * 32, "commit 0c1e570", "variant cpu", "cd" * 32,
                 "patches applied: 0001-x\n",
                 f"**The binary was replaced during the run** (sha256 `{'ef' * 32}`",
                 "`mtpwrap bench docs --profile tiny.yaml`", "## Read rate against ubatch",
                 "- restart: restart: llama-server restarted; ready again after 2.3 s",
                 "| cold | A + question | 3027 | 3027 | 0 | 1.31 | 2306.3 | 1.41 | – |",
                 "B's first question: 512 tokens", "in reverse order", "**read t/s**"):
        assert text in md, text
    again = json.loads(files["json"].read_text())
    assert again["steps"][1]["timings"] == {"prompt_n": 526, "cache_n": 2512,
                                            "prompt_ms": 204.0}
    assert "api_key" not in again["plan"]


def test_a_request_without_an_answer_is_a_row_with_its_error(tmp_path: Path) -> None:
    res = recorded()
    doc = docs.Doc("A", "en", "en", "text", 3000, {})
    res["steps"].append(docs.row("separate", "A / question", doc, "separate", None,
                                 error="the template | refused two user messages"))
    _, rows = docs_report.table(res)
    assert rows[-1] == ["separate", "A / question", "–", "–", "–", "–", "–", "–", "–"]
    md = docs_report.markdown(res)
    assert "- separate, A / question: the template | refused two user messages" in md
    assert "| separate | A / question | – |" in md


def test_a_tiny_model_can_state_a_longer_trained_context(tmp_path: Path) -> None:
    from mtpwrap.build.tiny_gguf import write_tiny_random
    from mtpwrap.decide.gguf_facts import read_facts

    path = write_tiny_random(tmp_path / "t.gguf", "qwen35", mtp=True, context=16384)
    assert read_facts(path).n_ctx_train == 16384
    assert read_facts(write_tiny_random(tmp_path / "d.gguf")).n_ctx_train == 4096


def test_steps_run_in_their_order_with_the_cold_read_first() -> None:
    assert docs.parse_steps("restart,separate") == ["cold", "separate", "restart"]
    assert docs.parse_steps("all") == list(docs.STEPS)
    with pytest.raises(ConfigError, match="unknown step"):
        docs.parse_steps("cold,warm")
    with pytest.raises(ConfigError, match="--corpora"):
        docs.DocsPlan(corpora=["ruling", "licence", "en"])
    assert docs.read_rate({"prompt_n": 10, "prompt_ms": 0}) is None


@pytest.mark.parametrize(("args", "says"), [
    (["--steps", "cold,warm"], "--steps: unknown step(s) warm"),
    (["--ubatch", "32,abc"], "--ubatch must be comma-separated integers"),
    (["--corpora", "nonsense"], "--corpora must name one or two corpora"),
])
def test_bad_input_is_one_sentence(args: list[str], says: str) -> None:
    r = run_cli("bench", "docs", *args, env=cli_env(), timeout=60)
    assert r.returncode == 78, r.output
    assert says in r.output and "Traceback" not in r.output


def test_actions_on_a_front_this_machine_does_not_run_are_refused_before_any_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpwrap.bench.docs_front import Target

    monkeypatch.setenv("MTPWRAP_STATE_DIR", str(tmp_path / "state"))
    target = Target("http://127.0.0.1:9", None, 5.0)
    try:
        target.check_actions(["cold", "same"])  # nothing to act on
        with pytest.raises(ConfigError, match="The restart step needs the front running on "
                                              "this machine"):
            target.check_actions(["cold", "restart"])
    finally:
        target.close()


def test_the_reports_command_line_leaves_the_api_key_out() -> None:
    from mtpwrap.commands.bench_docs import _without_key

    assert _without_key(["--url", "http://h", "--api-key", "sekrit-12345", "docs"]) == [
        "--url", "http://h", "--api-key", "…", "docs"]
    assert _without_key(["docs", "--api-key=sekrit-12345"]) == ["docs", "--api-key=…"]
