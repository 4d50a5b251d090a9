"""An MTP path that runs on a CPU: a tiny random-weight `qwen35` model with a nextn (MTP) block,
written by the project's own model writer, served with `--spec-type draft-mtp`. Acceptance on
random weights means nothing; what is tested is the path: flags accepted, drafts made, counters
moving, and the bench's numbers matching the server's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtpwrap.bench import stats
from mtpwrap.bench.runner import BenchConfig, Client, launch_config
from mtpwrap.build.tiny_gguf import write_tiny_random

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_bin(request: pytest.FixtureRequest) -> Path:
    env = os.environ.get("MTPWRAP_BINARY")
    return Path(env) if env else request.getfixturevalue("llama_server_bin")


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_random(tmp_path_factory.mktemp("mtp") / "tiny-qwen35-mtp.gguf",
                             arch="qwen35", mtp=True)


def test_draft_mtp_runs_and_counters_move(server_bin: Path, tiny_mtp: Path,
                                          tmp_path: Path) -> None:
    cfg = BenchConfig("mtp", spec="mtp", depth=2)
    srv = launch_config(cfg, binary=server_bin, model=tiny_mtp, ctx_size=512,
                        threads=1, log_path=tmp_path / "server.log")
    client = Client.of(srv)
    try:
        prompt = client.tokenize("제1조 대한민국은 민주공화국이다. Article 1. " * 4)
        before = client.metrics()
        res = client.complete(prompt, 32)
        c = client.metrics() - before
    finally:
        client.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "adding speculative implementation 'draft-mtp'" in log
    assert res.n == 32 == c.predicted_tokens
    assert c.steps > 0 and c.drafted > 0, (tmp_path / "server.log").read_text()[-2000:]
    assert res.timings["draft_n"] == c.drafted
    assert res.timings["draft_n_accepted"] == c.accepted
    assert len(c.per_pos) == 2 and sum(c.per_pos) == c.accepted
    s = stats.spec_stats(c, 2)
    assert s.mean_draft_length is not None and 0 < s.mean_draft_length <= 2
