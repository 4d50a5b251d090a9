"""Open WebUI's own requests, replayed through `mtpwrap up` on the tiny hybrid qwen35 + MTP model:
the bodies Open WebUI 0.12.4 sent for three questions on one ~12K-token contract in "Use entire
document" mode, with its title/tags/follow-up task requests in between, captured at the front
(tests/data/open-webui/, how in docs/clients/open-webui.md).

- `as-installed.jsonl`: Open WebUI's defaults. The document rides in the last user message, so at
  questions 2 and 3 it sits in another message than before: llama-server reads it all again and
  the audit line names the cause `moved`.
- `recipe.jsonl`: deploy/open-webui/open-webui.env (`RAG_SYSTEM_CONTEXT=true`, the tasks off).
  The document stays in the system message: questions 2 and 3 read only what follows it.

Each set is replayed in order with its own named key (the front tells re-reads apart per key);
"read" is the audit line's `prompt_tokens - cached_tokens`, llama-server's own counts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import DATA, Instance, audit_lines, tiny_hybrid_profile

pytestmark = pytest.mark.integration

CAPTURED = DATA / "open-webui"
KEYS = {"as-installed": "sk-owui-installed-0123456789", "recipe": "sk-owui-recipe-0123456789"}
#: what a later question may re-read in the recipe: the checkpoint spacing (1,024 tokens) and
#: a short question with its chat template
REREAD = 1120
#: answers are cut to this: the replay is about what is read, not what is written
MAX_TOKENS = 4


def captured(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (CAPTURED / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path) -> Iterator[Instance]:
    from mtpwrap.proc import free_loopback_port

    folder = tmp_path_factory.mktemp("open-webui")
    profile = tiny_hybrid_profile(folder, "tiny-owui")
    model = Path(yaml.safe_load(profile.read_text())["model"])
    keys = ",".join(f"{key} name=open-webui-{name} scopes=inference"
                    for name, key in KEYS.items())
    u = Instance(folder / "home", free_loopback_port(), llama_server_bin, model,
                 log=folder / "up.log", profile=str(profile), MTPWRAP_API_KEYS=keys,
                 MTPWRAP_PROXY_QUEUE_TIMEOUT_S="300")
    try:
        u.wait_ready(180)
        yield u
    finally:
        u.close()
        model.unlink()


def ours(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The audit lines of the key's model requests."""
    return [x for x in records if x.get("key") == key and x.get("prompt_tokens")]


def replay(up: Instance, name: str) -> list[dict[str, Any]]:
    """Send the set's requests in order; the audit line of each question."""
    audit = up.home / "audit"
    key = f"open-webui-{name}"
    lines: list[dict[str, Any]] = []
    kinds: list[str] = []
    for sent in captured(name):
        body = {**sent["body"], "max_tokens": MAX_TOKENS}
        headers = {**sent["headers"], "authorization": f"Bearer {KEYS[name]}"}
        with httpx.stream("POST", f"{up.base}/v1/chat/completions", json=body,
                          headers=headers, timeout=300) as r:
            text = r.read().decode()
            assert r.status_code == 200, (sent["kind"], text[-500:])
        kinds.append(sent["kind"])
        records = audit_lines(audit, lambda rs: len(ours(rs, key)) >= len(kinds), timeout=60)
        lines = ours(records, key)
    assert len(lines) == len(kinds), (lines, kinds)
    return [x for x, kind in zip(lines, kinds, strict=True) if kind == "question"]


def read(line: dict[str, Any]) -> int:
    return int(line["prompt_tokens"]) - int(line["cached_tokens"] or 0)


def test_the_captures_are_open_webuis_three_questions_on_one_document() -> None:
    """What the files hold: the same three questions, the document in the last user message as
    installed and in the system message with the recipe, Open WebUI's forwarded user headers
    with the recipe, and the task requests only as installed."""
    for name in KEYS:
        sets = captured(name)
        questions = [s["body"] for s in sets if s["kind"] == "question"]
        assert len(questions) == 3, name
        for b in questions:
            doc_in = [m["role"] for m in b["messages"] if "Clause 90." in str(m["content"])]
            assert doc_in == (["user"] if name == "as-installed" else ["system"]), (name, doc_in)
            if name == "as-installed":
                assert "Clause 90." in b["messages"][-1]["content"]
        kinds = {s["kind"] for s in sets} - {"question"}
        if name == "as-installed":
            assert {"title", "tags", "follow_ups"} <= kinds, kinds
        else:
            assert not kinds, kinds
            assert all("X-OpenWebUI-User-Name" in s["headers"] for s in sets)
    assert "sk-" not in (CAPTURED / "as-installed.jsonl").read_text()
    assert "sk-" not in (CAPTURED / "recipe.jsonl").read_text()


def test_as_installed_every_question_re_reads_the_document_moved(up: Instance) -> None:
    first, *later = replay(up, "as-installed")
    assert read(first) > 10000, first
    for line in later:
        assert read(line) > 10000, line
        assert line["reread_cause"] == "moved", line


def test_the_recipe_reads_the_document_once(up: Instance) -> None:
    first, *later = replay(up, "recipe")
    assert read(first) > 10000, first
    assert len(later) == 2
    for line in later:
        assert read(line) <= REREAD, line
        assert line["reread_cause"] is None, line
    # the chat and the person as Open WebUI names them (its forwarded headers), in each line
    sent = captured("recipe")[0]["headers"]
    assert {(x["chat"], x["user"]) for x in (first, *later)} == {
        (sent["X-OpenWebUI-Chat-Id"], sent["X-OpenWebUI-User-Id"])}, first
