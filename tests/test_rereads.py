"""Why a prompt was read again (`mtpwrap.front.rereads`): the classifier on its own (block hashes
and the places they were seen in, a cause out), then the front over the fake upstream replaying
Open WebUI's bodies — as installed (the document in the last user message: `moved`) and with
`RAG_SYSTEM_CONTEXT=true` (in the system message: no re-read) — in the audit line, /metrics and
/status.json. The same on the real llama-server is in tests/test_proxy_real.py."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter

from mtpwrap.config.objects import ProxyConfig
from mtpwrap.front.rereads import BLOCK_CHARS, ENTRIES, Block, Place, Rereads, blocks, classify
from mtpwrap.supervision.state import State
from tests.fakes.fake_upstream import FakeUpstream
from tests.fakes.front_harness import serve_front
from tests.helpers import Lines, wait_for

KEY = "webui-key-0123456789"
RECIPE_KEY = "recipe-key-0123456789"
#: a contract of 60 clauses (about 5,000 characters), as Open WebUI's retrieval hands it on
DOC = "\n".join(f"Clause {i}: the supplier ships {i * 7} crates of part {i:03d} to depot "
                f"{i % 5} by week {i % 52}, or pays {i * 11} euros a day." for i in range(60))
SYSTEM = "You are a careful assistant for the purchasing team."


def rag(question: str) -> str:
    """Open WebUI's RAG template (abridged) around the document and the question."""
    return ("### Task:\nRespond to the user query using the provided context, with inline "
            "citations [id] where a source has an id.\n\n<context>\n<source id=\"1\" name="
            f"\"contract.pdf\">{DOC}</source>\n</context>\n\n<user_query>\n{question}\n"
            "</user_query>\n")


def as_installed(n: int) -> list[dict[str, str]]:
    """The n-th question of a chat, as installed: the document rides in the last user message
    (the history holds the plain questions and the answers)."""
    history = [m for i in range(1, n) for m in (
        {"role": "user", "content": f"Question {i}?"},
        {"role": "assistant", "content": f"Answer {i}."})]
    return [{"role": "system", "content": SYSTEM}, *history,
            {"role": "user", "content": rag(f"Question {n}?") + f"\nQuestion {n}?"}]


def recipe(n: int) -> list[dict[str, str]]:
    """The same with RAG_SYSTEM_CONTEXT=true: the document goes into the system message."""
    history = [m for i in range(1, n) for m in (
        {"role": "user", "content": f"Question {i}?"},
        {"role": "assistant", "content": f"Answer {i}."})]
    return [{"role": "system", "content": SYSTEM + "\n" + rag(f"Question {n}?")}, *history,
            {"role": "user", "content": f"Question {n}?"}]


def seen_in(*prompts: tuple[Block, ...], generation: int = 1) -> dict[bytes, tuple[Place, int]]:
    """Where each block of `prompts` was seen last, as the front keeps it."""
    return {b.digest: (b.at, generation) for p in prompts for b in p}


# --------------------------------------------------------------------------- the classifier


def test_a_document_that_moved_to_another_message_is_moved() -> None:
    first, second = blocks({"messages": as_installed(1)}), blocks({"messages": as_installed(2)})
    assert classify(second, seen_in(first), 1, 1300, 0) == "moved"


def test_a_byte_that_differs_early_in_a_long_message_is_changed() -> None:
    def body(day: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": f"Today is {day}.\n{DOC}"},
                             {"role": "user", "content": "Which depot?"}]}

    # a longer date moves every character after it, but no cut past the first block
    monday, wednesday = blocks(body("Monday 1 May")), blocks(body("Wednesday 10 May"))
    assert monday[0].digest != wednesday[0].digest and monday[1:] == wednesday[1:]
    assert classify(wednesday, seen_in(monday), 1, 1300, 20) == "changed"


def test_a_prefix_seen_where_it_is_yet_read_again_is_evicted() -> None:
    prompt = blocks({"messages": recipe(1)})
    # the same prompt, in the same places, under the same child: llama-server dropped it
    assert classify(prompt, seen_in(prompt), 1, 1300, 0) == "evicted"
    # its start kept (the document) and a long new part read: a first read of that part
    longer = blocks({"messages": [*recipe(1), {"role": "user", "content": DOC.upper()}]})
    assert classify(longer, seen_in(prompt), 1, 2600, 1290) == "cold"


def test_a_prompt_seen_before_the_childs_restart_is_restarted() -> None:
    first, second = blocks({"messages": as_installed(1)}), blocks({"messages": as_installed(2)})
    assert classify(second, seen_in(second, generation=1), 2, 1300, 0) == "restarted"
    assert classify(second, seen_in(first, generation=1), 2, 1300, 0) == "restarted"


def test_a_prompt_never_seen_is_cold_and_short_messages_prove_nothing() -> None:
    prompt = blocks({"messages": as_installed(1)})
    assert classify(prompt, {}, 1, 1300, 0) == "cold"
    # "Thanks!" seen elsewhere before is not a document that moved
    thanks = blocks({"messages": [{"role": "user", "content": "Thanks!"}]})
    later = blocks({"messages": [{"role": "user", "content": DOC.upper()},
                                 {"role": "user", "content": "Thanks!"}]})
    assert classify(later, seen_in(thanks), 1, 1300, 0) == "cold"


def test_blocks_hold_no_text_and_read_every_shape_of_prompt() -> None:
    msgs = blocks({"messages": recipe(1)})
    assert all(len(b.digest) == 8 for b in msgs)
    assert sum(b.chars for b in msgs) == sum(len(m["content"]) for m in recipe(1))
    assert max(b.chars for b in msgs) < 2 * BLOCK_CHARS
    parts = blocks({"messages": [{"role": "user", "content": [
        {"type": "text", "text": DOC}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    anthropic = blocks({"system": [{"type": "text", "text": DOC}], "messages": []})
    native = blocks({"prompt": DOC})
    assert [b.digest for b in parts] == [b.digest for b in anthropic] == \
        [b.digest for b in native]
    assert blocks({"prompt": [1, 2, 3]}) == blocks([]) == blocks({"input": "x"}) == ()


def _rereads(threshold: int = 2048) -> tuple[Rereads, CollectorRegistry]:
    registry = CollectorRegistry()
    counter = Counter("t_reread_tokens", "t", ["cause"], registry=registry)
    return Rereads(threshold, counter), registry


def _line(prompt_tokens: int | None, cached: int | None, status: int = 200,
          tokens_from: str = "answer") -> dict[str, Any]:
    return {"time": "2027-01-15T08:00:00.000+00:00", "status": status,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached, "tokens_from": tokens_from}


def test_a_read_under_the_threshold_or_not_answered_says_nothing() -> None:
    r, registry = _rereads()
    first, second = blocks({"messages": as_installed(1)}), blocks({"messages": as_installed(2)})
    none = {"reread_tokens": None, "reread_cause": None}
    assert r.explain("-", first, 1, _line(13176, 11200)) == none  # 1,976 read
    assert r.explain("-", second, 1, _line(13246, 0, status=500)) == none  # not read: not kept
    assert r.explain("-", second, 1, _line(None, None)) == none  # counts unknown: kept
    # a reservation charged for an answer that said no counts is not a read
    assert r.explain("-", second, 1, _line(13246, 0, tokens_from="reserved")) == none
    assert r.explain("-", second, 1, _line(13246, 0)) == {"reread_tokens": 13246,
                                                          "reread_cause": "evicted"}
    # per key: another key's prompts tell nothing about this one's
    assert r.explain("alice", second, 1, _line(13246, 0))["reread_cause"] == "cold"
    assert registry.get_sample_value("t_reread_tokens_total", {"cause": "evicted"}) == 13246
    assert registry.get_sample_value("t_reread_tokens_total", {"cause": "moved"}) == 0
    assert [(x["key"], x["reread_cause"]) for x in r.recent] == [("-", "evicted"),
                                                                 ("alice", "cold")]


def test_the_blocks_kept_are_bounded_oldest_out() -> None:
    r, _ = _rereads()
    first = blocks({"messages": as_installed(1)})
    r.explain("-", first, 1, _line(100, 0))
    for i in range(ENTRIES):
        r.explain("-", blocks({"prompt": f"prompt {i}"}), 1, _line(100, 0))
    assert len(r._seen["-"]) == ENTRIES
    assert r.explain("-", first, 1, _line(13176, 0))["reread_cause"] == "cold"


# --------------------------------------------------------------------------- the front


def _ask(url: str, fake: FakeUpstream, lines: Lines, messages: list[dict[str, str]],
         read: int, cached: int, key: str = KEY) -> dict[str, Any]:
    """One streamed question whose answer says llama-server read `read` tokens and found
    `cached` of them in its cache; its audit line."""
    # OpenAI's usage, as llama-server writes it (its cached tokens in `prompt_tokens_details`)
    fake.usage = {"prompt_tokens": read, "completion_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": cached}}
    n = len(lines.records)
    r = httpx.post(url + "/v1/chat/completions", timeout=10,
                   headers={"authorization": f"Bearer {key}"},
                   json={"model": "m", "messages": messages, "stream": True})
    assert r.status_code == 200, r.text
    wait_for("the audit line", lambda: len(lines.records) > n, 10)
    line = lines.records[n]
    assert (line["prompt_tokens"], line["cached_tokens"]) == (read, cached)
    return line


def test_open_webui_as_installed_is_moved_and_the_recipe_reads_no_more() -> None:
    fake = FakeUpstream(mode="sse", events=3).start()
    try:
        config = ProxyConfig(api_keys=(f"{KEY} name=webui", f"{RECIPE_KEY} name=recipe"))
        with serve_front(fake.base_url, fake.api_key, config) as (srv, sup):
            lines = Lines()
            srv.front.trail.sink = lines
            # as installed: three questions, measured 13,176 / 13,246 / 13,320 read, 0 cached
            causes = [_ask(srv.url, fake, lines, as_installed(n), read, 0)
                      for n, read in ((1, 13176), (2, 13246), (3, 13320))]
            assert [(c["reread_tokens"], c["reread_cause"]) for c in causes] == [
                (13176, "cold"), (13246, "moved"), (13320, "moved")]
            # the recipe, another Open WebUI (its own key): questions 2 and 3 read 74 and 78
            causes = [_ask(srv.url, fake, lines, recipe(n), read, cached, RECIPE_KEY)
                      for n, read, cached in ((1, 13180, 0), (2, 13250, 13176),
                                              (3, 13330, 13252))]
            assert [c["reread_cause"] for c in causes] == ["cold", None, None]
            assert causes[1]["reread_tokens"] is None
            # llama-server restarted: its cache is gone
            sup.set_state(State.READY, new_generation=True)
            line = _ask(srv.url, fake, lines, recipe(3), 13330, 0, RECIPE_KEY)
            assert (line["reread_tokens"], line["reread_cause"]) == (13330, "restarted")

            auth = {"authorization": f"Bearer {KEY}"}
            metrics = httpx.get(srv.url + "/metrics", headers=auth).text
            assert 'mtpwrap_reread_tokens_total{cause="moved"} 26566.0' in metrics
            assert 'mtpwrap_reread_tokens_total{cause="changed"} 0.0' in metrics
            status = httpx.get(srv.url + "/status.json", headers=auth).json()
            assert [(r["key"], r["reread_cause"]) for r in status["rereads"]] == [
                ("recipe", "restarted"), ("recipe", "cold"), ("webui", "moved"),
                ("webui", "moved"), ("webui", "cold")]
            assert "RAG_SYSTEM_CONTEXT=true" in status["rereads"][2]["fix"]
            shown = repr(status["rereads"]) + repr(lines.records) + metrics
            assert "Clause" not in shown and "Question" not in shown
    finally:
        fake.stop()
