"""API keys changed on a running `mtpwrap up` (the real llama-server, the demo model) without
touching llama-server, with the official `openai` client: a key dropped by `mtpwrap reload` or
taken out of the watched key file is refused, the others still answer, a stream let in before
its key went finishes, a bad key file changes nothing, and llama-server keeps its pid (and its
warm prompts) throughout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from mtpwrap import proc
from tests.helpers import REPO, cli_env, run_cli, wait_for, wait_ready

pytestmark = pytest.mark.integration

ALICE = "alice-key-0123456789"
BOB = "bob-key-abcdefghijkl"
BOTH = f"{ALICE} name=alice\n{BOB} name=bob\n"
HELLO = [{"role": "user", "content": "Say hello."}]
#: ~800 tokens: a document llama-server keeps warm in a slot
DOCUMENT = " ".join(f"Clause {i}: the party shall deliver item {i * 7} by day {i % 28 + 1}."
                    for i in range(50))


class Up:
    """`mtpwrap up --config FILE` whose config names a key file the test can change."""

    def __init__(self, tmp: Path, port: int, binary: Path, model: Path) -> None:
        self.tmp, self.port = tmp, port
        self.keys = tmp / "keys"
        self.keys.write_text(BOTH)
        self.keys.chmod(0o600)
        self.config = tmp / "mtpwrap.yaml"
        self.settings = {"profile": "cpu-demo", "model": str(model), "binary": str(binary),
                         "port": port, "drain_s": 20, "api_key_file": str(self.keys),
                         "supervisor": {"backoff_initial_s": 0.5}}
        self.config.write_text(yaml.safe_dump(self.settings))
        self.env = cli_env(MTPWRAP_HOME=str(tmp / "home"), MTPWRAP_CONFIG=str(self.config))
        self.log = tmp / "up.log"
        self.process = proc.start([sys.executable, "-m", "mtpwrap", "up"], env=self.env,
                                  cwd=REPO, stdout=self.log.open("w"), stderr=proc.STDOUT,
                                  text=True)
        self.proc = self.process.popen
        self.base = f"http://127.0.0.1:{port}"
        wait_ready(self.base, self.proc, self.log.read_text, 180)

    def state(self) -> dict:
        return json.loads((self.tmp / "home" / "state" / "instance.json").read_text())

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0,
                             timeout=120)

    def chat(self, key: str) -> int:
        """The status a short chat completion with `key` gets."""
        try:
            self.client(key).chat.completions.create(model="demo", messages=HELLO,  # type: ignore[arg-type]
                                                     max_tokens=4, temperature=0)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    def prompt_n(self, prompt: str) -> int:
        """Prompt tokens llama-server computed for a completion of `prompt` (not its cache's)."""
        r = httpx.post(f"{self.base}/v1/completions", timeout=120,
                       headers={"authorization": f"Bearer {ALICE}"},
                       json={"model": "demo", "prompt": prompt, "max_tokens": 2,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return int(r.json()["timings"]["prompt_n"])

    def healthz(self, key: str) -> int:
        """/healthz with `key`: the front's own page, answered without a slot of
        llama-server's (so a probe never waits behind a stream)."""
        return httpx.get(f"{self.base}/healthz", timeout=10,
                         headers={"authorization": f"Bearer {key}"}).status_code

    def reconfigure(self, **changes: object) -> None:
        self.config.write_text(yaml.safe_dump({**self.settings, **changes}))

    def close(self) -> None:
        self.process.kill()


@pytest.fixture
def up(tmp_path: Path, free_port: int, llama_server_bin: Path, demo_model: Path
       ) -> Iterator[Up]:
    u = Up(tmp_path, free_port, llama_server_bin, demo_model)
    try:
        yield u
    finally:
        u.close()


def test_reload_drops_a_key_without_restarting_llama_server(up: Up) -> None:
    assert up.chat(ALICE) == 200 and up.chat(BOB) == 200
    child = up.state()["child_pid"]
    cold = up.prompt_n(DOCUMENT)
    assert cold > 500, cold
    fewer = up.tmp / "keys-without-bob"
    fewer.write_text(f"{ALICE} name=alice\n")
    # another file, named by the config: only a reload reads it (the watch is on the first)
    up.reconfigure(api_key_file=str(fewer))
    r = run_cli("reload", env=up.env, timeout=120)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "API keys: 2 key(s) -> 1: removed bob" in said, said
    assert "llama-server unchanged (same command line): not restarted" in said, said
    assert ALICE not in said and BOB not in said
    assert up.chat(BOB) == 401 and up.chat(ALICE) == 200
    st = up.state()
    assert st["child_pid"] == child and st["restarts"] == 0 and st["state"] == "ready"
    assert st["reload"]["result"] == "ok"
    took = st["reload"]["finished_at"] - st["reload"]["started_at"]
    print(f"reload that swapped the keys: {took:.2f} s in the running instance")
    assert took < 5, took
    # the document is still warm: only the new question is computed
    warm = up.prompt_n(DOCUMENT + " Which item is due on day 3?")
    print(f"prompt tokens computed: {cold} cold, {warm} after the reload")
    assert warm < 0.05 * cold, (warm, cold)

    # the watch follows the file the reload named
    fewer.write_text(f"{BOB} name=bob\n")
    wait_for("alice refused", lambda: up.chat(ALICE) == 401, 5, every=0.1)
    assert up.chat(BOB) == 200

    # a bad key file: refused by `mtpwrap reload` with one sentence, and by the running
    # instance on SIGHUP; the keys in use stay
    fewer.write_text(f"{BOB} name=bob\n{ALICE} name=alice class=urgent\n")
    r = run_cli("reload", env=up.env, timeout=120)
    assert r.returncode == 78, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{fewer} line 2: class='urgent'" in lines[0] and ALICE not in lines[0]
    generation = up.state()["reload"]["generation"]
    os.kill(up.proc.pid, signal.SIGHUP)
    wait_for("the refusal", lambda: up.state()["reload"]["generation"] > generation
             and up.state()["reload"]["result"] != "running", 60)
    st = up.state()
    assert st["reload"]["result"] == "refused", st["reload"]
    assert f"{fewer} line 2" in st["reload"]["message"]
    assert up.chat(BOB) == 200 and up.chat(ALICE) == 401
    assert up.state()["child_pid"] == child
    log = up.log.read_text()
    assert ALICE not in log and BOB not in log


def test_a_key_taken_out_of_the_file_is_refused_within_seconds(up: Up) -> None:
    assert up.chat(BOB) == 200
    child = up.state()["child_pid"]
    up.keys.write_text(f"{ALICE} name=alice\n")
    took = wait_for("bob refused", lambda: up.healthz(BOB) == 401, 3, every=0.05)
    print(f"a key taken out of the file refused after {took:.2f} s")
    assert up.chat(BOB) == 401 and up.chat(ALICE) == 200
    assert up.state()["child_pid"] == child
    assert "API keys changed (" in up.log.read_text()


def test_a_stream_let_in_before_its_key_went_finishes(up: Up) -> None:
    arrivals: list[float] = []
    finish: list[str | None] = []

    def stream() -> None:
        chunks = up.client(BOB).chat.completions.create(
            model="demo", messages=HELLO, max_tokens=500, temperature=0,  # type: ignore[arg-type]
            stream=True, extra_body={"ignore_eos": True})
        for chunk in chunks:
            arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        wait_for("the stream under way", lambda: len(arrivals) >= 3, 60, every=0.02)
        up.keys.write_text(f"{ALICE} name=alice\n")
        wait_for("bob refused", lambda: up.healthz(BOB) == 401, 3, every=0.05)
        revoked = time.monotonic()
    finally:
        reader.join(120)
    assert finish == ["length"], finish
    assert len(arrivals) >= 500
    assert arrivals[-1] > revoked, "the stream ended before the key went: make it longer"
    assert up.chat(BOB) == 401
