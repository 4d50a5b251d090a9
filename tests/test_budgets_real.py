"""Budgets that cannot be dodged, on the real llama-server (`mtpwrap up --profile cpu-demo`, the
demo model), with named keys and token budgets in a key file:

- a stream its client closes after some tokens is charged what llama-server computed (its
  prompt, as llama-server counts it, and the tokens relayed), and the audit line and
  `mtpwrap usage` carry the same figures; the charge spends the budget, and the next request is
  refused naming the key, the budget and when it resets;
- an Anthropic stream with more events than the last ones the front keeps is charged its prompt
  (from its first event: input tokens and those read from the cache) and its answer;
- parallel requests reserve what they may cost when admitted: they cannot all pass before any
  is charged, and the reservation is let go when the request ends.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mtpwrap.front.usage import LAST_EVENTS
from mtpwrap.proc import free_loopback_port
from tests.helpers import Instance, cli_env, run_cli, wait_for

pytestmark = pytest.mark.integration

KEYS = {
    "free": "free-key-0a1b2c3d4e5f",
    "cutter": "cutter-key-6a7b8c9d0e",
    "reader": "reader-key-1f2e3d4c5b",
    "parallel": "parallel-key-9a8b7c6d",
}
#: budgets sized in the tests below: a few hundred tokens
KEY_FILE = f"""{KEYS['free']} name=free
{KEYS['cutter']} name=cutter tokens_per_hour=50
{KEYS['reader']} name=reader tokens_per_day=100000
{KEYS['parallel']} name=parallel tokens_per_hour=100
"""
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
#: ~700 tokens: a prompt far longer than anything in an answer's tail
DOCUMENT = " ".join(f"Clause {i}: the party shall deliver item {i * 7} by day {i % 28 + 1}."
                    for i in range(45))


class Up:
    def __init__(self, home: Path, binary: Path, model: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        keys = home / "keys"
        keys.write_text(KEY_FILE)
        keys.chmod(0o600)
        self.inst = Instance(home, free_loopback_port(), binary, model, log=home / "up.log",
                             MTPWRAP_API_KEY_FILE=str(keys))
        self.inst.wait_ready(180)
        self.base = self.inst.base

    def http(self, name: str) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=180,
                            headers={"authorization": f"Bearer {KEYS[name]}"})

    def lines(self, key: str) -> list[dict[str, Any]]:
        return [x for f in sorted((self.home / "audit").glob("audit-*.jsonl"))
                for line in f.read_text().splitlines() if line.strip()
                for x in [json.loads(line)] if x["key"] == key]

    def line(self, key: str, n: int) -> dict[str, Any]:
        """The key's nth audit line (1-based), once written."""
        wait_for(f"{key}'s audit line {n}", lambda: len(self.lines(key)) >= n, 60)
        return self.lines(key)[n - 1]

    def usage(self, key: str) -> dict[str, Any]:
        r = run_cli("usage", "--by", "key", "--json", env=cli_env(MTPWRAP_HOME=str(self.home)))
        assert r.returncode == 0, r.stderr
        return next(row for row in json.loads(r.stdout)["rows"] if row["key"] == key)

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        """The prompt of a chat completion as llama-server counts it (a complete answer's
        usage, asked with the key that has no budget)."""
        with self.http("free") as c:
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 1, "stream": False})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
       demo_model: Path) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("budgets") / "home", llama_server_bin, demo_model)
    try:
        yield u
    finally:
        u.inst.close()


def _refusal_names_key_budget_and_reset(message: str, key: str, budget: str) -> None:
    assert f"The API key '{key}' has used" in message, message
    assert f"its budget of {budget}" in message, message
    assert re.search(r"it resets at \d\d:\d\d:\d\d UTC \(in \d+ s\)\.$", message), message


def test_a_stream_closed_early_is_charged_what_llama_server_computed(up: Up) -> None:
    body = {"model": "demo", "messages": MESSAGES, "temperature": 0}
    prompt = up.prompt_tokens(body)
    client = openai.OpenAI(base_url=f"{up.base}/v1", api_key=KEYS["cutter"], max_retries=0,
                           timeout=180)
    stream = client.chat.completions.create(
        **body, max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    read = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            read += 1
            if read == 20:
                break
    stream.close()  # the client goes, 1980 tokens short of its answer

    line = up.line("cutter", 1)
    print(f"cut after {read} tokens read: charged prompt {line['prompt_tokens']} "
          f"(llama-server: {prompt}), completion {line['completion_tokens']}")
    assert line["tokens_from"] == "cut", line
    assert line["prompt_tokens"] == prompt, (line, prompt)
    assert read <= line["completion_tokens"] < 2000, line
    # `mtpwrap usage` carries the line's figures
    row = up.usage("cutter")
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        1, line["prompt_tokens"], line["completion_tokens"])
    # the charge spent the 50 tokens an hour: the next request is refused, and says so
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**body, max_tokens=4)
    assert refused.value.status_code == 429
    _refusal_names_key_budget_and_reset(refused.value.message, "cutter", "50 tokens per hour")


def _messages_stream(up: Up, max_tokens: int) -> tuple[int, int, int]:
    """An Anthropic stream of `max_tokens` tokens on DOCUMENT with the `reader` key: (its
    first event's input tokens, those read from the cache, its last event's output tokens)."""
    body = {"model": "demo", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": DOCUMENT +
                                            " Summarise the clauses at length."}]}
    usage: list[dict[str, int]] = []
    with up.http("reader") as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        for raw in r.iter_lines():
            if raw.startswith("data: "):
                event = json.loads(raw[6:])
                if event["type"] == "message_start":
                    usage.append(event["message"]["usage"])
                elif event["type"] == "message_delta":
                    usage.append(event["usage"])
    start, end = usage
    return start["input_tokens"], start.get("cache_read_input_tokens", 0), end["output_tokens"]


def test_a_long_anthropic_stream_is_charged_its_prompt(up: Up) -> None:
    with up.http("free") as c:
        r = c.post("/v1/messages/count_tokens", json={
            "model": "demo", "messages": [{"role": "user", "content": DOCUMENT +
                                           " Summarise the clauses at length."}]})
    assert r.status_code == 200, r.text
    prompt = r.json()["input_tokens"]
    assert prompt > 500, prompt
    # the first time cold, the second with the document read from llama-server's cache
    for n in (1, 2):
        fresh, cached, output = _messages_stream(up, 40)
        line = up.line("reader", n)
        print(f"/v1/messages stream {n}: {line['bytes_out']} bytes; charged prompt "
              f"{line['prompt_tokens']} (input {fresh} + cache {cached}), completion "
              f"{line['completion_tokens']}")
        assert (line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"],
                line["tokens_from"]) == (fresh + cached, cached, output, "answer")
        assert line["prompt_tokens"] == prompt and output == 40 > 4 * LAST_EVENTS
    assert cached > prompt // 2  # the second found the document warm: still charged whole
    row = up.usage("reader")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2 * prompt, 80)


def test_parallel_requests_cannot_all_pass_before_any_is_charged(up: Up) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 150, "ignore_eos": True,
            "temperature": 0, "stream": True}
    n = 4
    start = threading.Barrier(n)
    answers: list[tuple[int, str]] = []

    def one() -> None:
        start.wait()
        with up.http("parallel") as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            text = "".join(r.iter_text())
            answers.append((r.status_code, text))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    statuses = sorted(s for s, _ in answers)
    print(f"{n} parallel streams of 150 tokens on a budget of 100 tokens an hour: {statuses}")
    assert statuses == [200] + [429] * (n - 1), answers
    for status, text in answers:
        if status == 429:
            _refusal_names_key_budget_and_reset(json.loads(text)["error"]["message"],
                                                "parallel", "100 tokens per hour")
        else:
            assert text.rstrip().endswith("data: [DONE]")
    # the one let in is charged what it cost; its reservation went with it
    line = next(x for x in (up.line("parallel", i) for i in range(1, n + 1))
                if x["status"] == 200)
    assert line["completion_tokens"] == 150 and line["tokens_from"] == "answer"
    with up.http("parallel") as c:
        r = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
    assert r.status_code == 429
    message = r.json()["error"]["message"]
    _refusal_names_key_budget_and_reset(message, "parallel", "100 tokens per hour")
    assert "reserved" not in message  # nothing is held any more: it was spent
