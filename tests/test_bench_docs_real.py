"""`mtpwrap bench docs --profile P` as a person runs it: it starts `mtpwrap up` itself on a
profile pointing at the tiny hybrid qwen35 model with its MTP head (3K-token documents of
Debian's licence texts), runs the cold read, a new question in the same message, the question
as a message of its own and a restart, then one ubatch cell. The report's numbers are held
against llama-server's own log of the same requests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mtpwrap.build.tiny_gguf import write_tiny_random
from tests.helpers import cli_env, run_cli

pytestmark = pytest.mark.integration

DOC_TOKENS = 3000


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    model = write_tiny_random(folder / "tiny-qwen35-mtp.gguf", arch="qwen35", mtp=True)
    profile = folder / "tiny-docs.yaml"
    profile.write_text(yaml.safe_dump({
        "description": "The tiny hybrid model with its MTP head on the CPU",
        "hardware": {"requires_gpu": False}, "model": str(model), "context": 4096,
        "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "mtp", "depth": 2},
        "gpu_layers": 0, "slots": 1, "threads": 1}))
    return profile


def test_the_workflow_measured_through_mtpwrap_up(tiny_profile: Path, llama_server_bin: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "report"
    r = run_cli("bench", "docs", "--profile", str(tiny_profile), "--binary",
                str(llama_server_bin), "--corpora", "en", "--doc-tokens", str(DOC_TOKENS),
                "--long-tokens", "256", "--steps", "cold,same,separate,restart",
                "--ubatch", "64", "--max-tokens", "4", "--timeout", "120", "--out", str(out),
                env=cli_env(MTPWRAP_HOME=str(tmp_path / "home")), timeout=240)
    assert r.returncode == 0, r.output
    res = json.loads((out / "report.json").read_text())
    rows = {row["step"]: row for row in res["steps"]}
    assert [row["step"] for row in res["steps"]] == ["cold", "same", "separate", "restart"]

    # The document is the one asked for, and each request's counts are llama-server's.
    doc = res["documents"]["A"]
    assert DOC_TOKENS - 2 <= doc["tokens"] <= DOC_TOKENS + 2
    cold = rows["cold"]
    assert cold["cache_n"] == 0 and cold["prompt_n"] >= doc["tokens"]
    assert cold["read_tokens_per_s"] == pytest.approx(
        cold["prompt_n"] / (cold["prompt_ms"] / 1000))
    for row in res["steps"]:
        assert row["prompt_n"] + row["cache_n"] == row["prompt_tokens"], row
        assert row["ttft_s"] > 0 and row["progress_events"] >= 1, row
    # The document as a message of its own is found in the cache.
    assert rows["separate"]["cache_n"] > 0
    assert rows["separate"]["prompt_n"] < rows["separate"]["prompt_tokens"]
    assert rows["restart"]["action"]["action"] == "restart"
    assert rows["restart"]["action"]["ready_after_s"] > 0

    # llama-server's own log of the requests before the restart: its "prompt eval" lines, one
    # per request, in order.
    text = (out / "up" / "logs" / "llama-server.log").read_text(errors="replace")
    logged = [int(n) for n in re.findall(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens",
                                         text)]
    before = [rows[s]["prompt_n"] for s in ("cold", "same", "separate")]
    assert any(logged[i:i + 3] == before for i in range(len(logged))), (logged, before)

    # The ubatch cell: a launch of the profile with that ubatch, one cold read.
    (cell,) = res["ubatch"]
    assert cell["launch"]["ubatch"] == 64 and cell["cache_n"] == 0
    assert cell["prompt_n"] == cold["prompt_n"]

    # Provenance: machine, load, model, binary.
    assert res["machine"]["cpu_model"] and len(res["machine"]["loadavg_end"]) == 3
    assert res["provenance"]["model"]["sha256"] and res["provenance"]["binary"]["binary"]
    md = (out / "report.md").read_text()
    assert "| step | request | prompt | read | cached |" in md
    assert "## Read rate against ubatch" in md and "| 64 |" in md


def test_a_crash_of_llama_server_is_survived_and_measured(llama_server_bin: Path,
                                                           demo_model: Path,
                                                           tmp_path: Path) -> None:
    profile = tmp_path / "demo-docs.yaml"
    profile.write_text(yaml.safe_dump({
        "description": "The demo model, one slot, on the CPU", "hardware": {"requires_gpu": False},
        "model": str(demo_model), "context": 2048, "kv": {"k": ["f16"], "v": ["f16"]},
        "spec": {"kind": "none"}, "gpu_layers": 0, "slots": 1, "threads": 1}))
    out = tmp_path / "report"
    r = run_cli("bench", "docs", "--profile", str(profile), "--binary", str(llama_server_bin),
                "--corpora", "en", "--doc-tokens", "1000", "--long-tokens", "64",
                "--steps", "separate,crash", "--ubatch", "none", "--max-tokens", "2",
                "--timeout", "120", "--out", str(out), "--json",
                env=cli_env(MTPWRAP_HOME=str(tmp_path / "home")), timeout=240)
    assert r.returncode == 0, r.output
    res = json.loads(r.stdout)
    assert res == json.loads((out / "report.json").read_text())
    cold, separate, crash = res["steps"]
    assert [cold["step"], separate["step"], crash["step"]] == ["cold", "separate", "crash"]
    assert cold["prompt_n"] >= res["documents"]["A"]["tokens"] and cold["cache_n"] == 0
    assert separate["cache_n"] > 0 and separate["error"] is None
    # The llama-server that read the document was killed; a new one answered the question.
    act = crash["action"]
    assert act["action"] == "crash" and act["killed_pid"] == res["front"]["child_pid"]
    assert act["ready_after_s"] > 0 and crash["error"] is None
    assert crash["prompt_n"] + crash["cache_n"] == crash["prompt_tokens"]
    assert res["ubatch"] == []
