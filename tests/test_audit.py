"""The audit trail's sinks and counts (`mtpwrap.front.audit`) without a server: daily files,
their mode and retention under an injected clock, journald's structured fields on a socket of
the test's own, and the token counts read from an answer's end. The real-server checks (the
counts equal llama-server's usage, canaries nowhere) are in tests/test_audit_real.py."""

from __future__ import annotations

import json
import shutil
import socket
import stat
from pathlib import Path

from mtpwrap import upstream
from mtpwrap.front import audit, usage
from mtpwrap.front.audit import FileSink, JournalSink, Ticket, read_records
from mtpwrap.front.usage import Tally, answer_counts, reservation

DAY = 86400.0
T0 = 1_800_000_000.0  # 2027-01-15


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(n: int) -> dict[str, object]:
    t = Ticket(method="POST", route="/v1/chat/completions", client="127.0.0.1", key="app")
    t.status, t.by, t.tally.route = 200, "llama-server", t.route
    t.tally.sent, t.tally.status, t.tally.ended = True, 200, True
    t.tally.feed(b'{"usage":{"completion_tokens":%d,"prompt_tokens":7}}' % n)
    return t.record("demo")


def test_one_file_a_day_0600_in_a_0700_directory_and_old_days_deleted(tmp_path: Path
                                                                      ) -> None:
    clock = Clock(T0)
    d = tmp_path / "audit"
    sink = FileSink(d, retention_days=2, clock=clock)
    for day in range(4):
        sink.write(record(day))
        sink.write(record(day))
        clock.t += DAY
    sink.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(p.name for p in d.iterdir())
    # the fourth day's turn deleted the first day's file (older than two days)
    assert files == ["audit-2027-01-16.jsonl", "audit-2027-01-17.jsonl",
                     "audit-2027-01-18.jsonl"]
    assert all(stat.S_IMODE((d / f).stat().st_mode) == 0o600 for f in files)
    rows = list(read_records(d))
    assert [r["completion_tokens"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert list(read_records(d, since="2027-01-18")) == rows[4:]
    # a start prunes too: a day passes with the service stopped (today is the 20th)
    clock.t += DAY
    FileSink(d, retention_days=2, clock=clock).close()
    assert sorted(p.name for p in d.iterdir()) == ["audit-2027-01-18.jsonl"]


def test_a_line_cut_by_a_crash_is_skipped(tmp_path: Path) -> None:
    d = tmp_path / "audit"
    sink = FileSink(d, retention_days=30, clock=Clock(T0))
    sink.write(record(1))
    sink.close()
    with (d / "audit-2027-01-15.jsonl").open("a") as f:
        f.write('{"time": "2027-01-15T08:00:00", "key": "ap')
    assert [r["completion_tokens"] for r in read_records(d)] == [1]


def test_journald_gets_structured_fields() -> None:
    path = str(upstream.private_socket_dir("socket") / "socket")
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(path)
    try:
        sink = JournalSink(path)
        sink.write(record(5))
        sink.close()
        fields = dict(line.split("=", 1) for line in journal.recv(65536).decode().splitlines())
    finally:
        journal.close()
        shutil.rmtree(Path(path).parent)
    assert fields["SYSLOG_IDENTIFIER"] == "mtpwrap-audit" and fields["PRIORITY"] == "6"
    assert fields["MTPWRAP_KEY"] == "app" and fields["MTPWRAP_STATUS"] == "200"
    assert fields["MTPWRAP_TOKENS_IN"] == "7" and fields["MTPWRAP_TOKENS_OUT"] == "5"
    assert fields["MTPWRAP_ROUTE"] == "/v1/chat/completions"
    assert "MTPWRAP_REASON" not in fields  # None fields are left out


def test_counts_are_read_from_the_answers_json_never_from_text_inside_it() -> None:
    # a stream without include_usage: llama-server's timings in its last event
    stream = (b'data: {"choices":[{"delta":{"content":"say \\"prompt_tokens\\": 999"}}]}\n\n'
              b'data: {"choices":[{"finish_reason":"length","delta":{}}],"timings":'
              b'{"cache_n":3,"prompt_n":9,"predicted_n":16,"draft_n":12,'
              b'"draft_n_accepted":10}}\n\ndata: [DONE]\n\n')
    for size in (1, 2, 7, len(stream)):  # however the reads cut it
        t = Tally(route="/v1/chat/completions", stream=True, sent=True, status=200, ended=True)
        for i in range(0, len(stream), size):
            t.feed(stream[i:i + size])
        assert t.counts() == {"prompt_tokens": 12, "cached_tokens": 3, "completion_tokens": 16,
                              "drafted_tokens": 12, "accepted_tokens": 10, "finish": "length",
                              "from": "answer"}, size
    # usage wins where llama-server gave it; Anthropic's names too
    # (Anthropic's prompt is its input tokens and those read from the cache)
    counts = answer_counts(json.loads(
        '{"content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn",'
        '"usage":{"cache_read_input_tokens":30,"input_tokens":21,"output_tokens":4}}'))
    assert counts["prompt_tokens"] == 51 and counts["completion_tokens"] == 4
    assert counts["cached_tokens"] == 30
    assert counts["finish"] == "end_turn"
    assert answer_counts({"tokens": [1, 2, 3]})["prompt_tokens"] is None
    # a batch of native answers (a prompt per answer) is their sum
    assert answer_counts([{"tokens_evaluated": 5, "tokens_predicted": 7},
                          {"tokens_evaluated": 6, "tokens_predicted": 8}])[
        "prompt_tokens"] == 11


def test_a_whole_answer_is_parsed_wherever_its_counts_are() -> None:
    # /completion with n_probs: llama-server puts its counts first and the probabilities,
    # hundreds of KiB, after them
    probs = [{"id": i, "token": "x", "logprob": -1.0, "top_logprobs": [
        {"id": j, "token": "y", "logprob": -2.0} for j in range(20)]} for i in range(200)]
    answer = json.dumps({"content": "text", "tokens_predicted": 200, "tokens_evaluated": 9,
                         "timings": {"prompt_n": 9, "predicted_n": 200},
                         "completion_probabilities": probs}).encode()
    assert len(answer) > 64 * 1024
    t = Tally(route="/completion", sent=True, status=200, ended=True)
    for i in range(0, len(answer), 4096):
        t.feed(answer[i:i + 4096])
    assert (t.counts()["prompt_tokens"], t.counts()["completion_tokens"]) == (9, 200)
    assert t.counts()["from"] == "answer"


def test_a_200_that_does_not_say_its_counts_is_charged_its_reservation() -> None:
    def whole(route: str, answer: bytes, reserved: int | None = 250) -> dict[str, object]:
        t = Tally(route=route, sent=True, status=200, ended=True)
        t.feed(answer)
        return t.counts(200, estimate=50, reserved=reserved)

    # response_fields left the counts out: the prompt's estimate and the rest as generation
    c = whole("/completion", b'{"content":"forty tokens of text"}')
    assert (c["prompt_tokens"], c["completion_tokens"], c["from"]) == (50, 200, "reserved")
    # native /embedding and a TEI-style rerank say no counts: all of it is the prompt's
    for route, answer in (("/embedding", b'[{"index":0,"embedding":[[0.1,0.2]]}]'),
                          ("/v1/rerank", b'[{"index":1,"score":0.9},{"index":0,"score":0.1}]')):
        c = whole(route, answer)
        assert (c["prompt_tokens"], c["completion_tokens"], c["from"]) == (250, None,
                                                                           "reserved"), route
    # an answer past what the tally keeps is charged its reservation too
    c = whole("/v1/chat/completions", b'{"usage":{"prompt_tokens":1}, "pad":"'
              + b"x" * usage.ANSWER_BYTES + b'"}')
    assert c["from"] == "reserved"
    # without a key no reservation is taken: the prompt's estimate
    c = whole("/completion", b'{"content":"x"}', reserved=None)
    assert (c["prompt_tokens"], c["completion_tokens"], c["from"]) == (50, None, "estimate")
    # a route that runs no model costs nothing, whatever its answer says
    for route in ("/tokenize", "/v1/messages/count_tokens", "/v1/chat/completions/input_tokens"):
        c = whole(route, b'{"input_tokens":41,"tokens":[1,2]}')
        assert (c["prompt_tokens"], c["from"]) == (None, None), route


def test_a_front_made_answer_has_no_token_counts_and_the_record_has_every_field() -> None:
    t = Ticket(method="POST", route="/v1/chat/completions", client="10.0.0.7", key="app")
    t.status, t.reason = 429, "budget_rpm"
    r = t.record("demo")
    assert r["prompt_tokens"] is None and r["by"] == "front" and r["reason"] == "budget_rpm"
    assert list(r) == ["time", "id", "key", "class", "client", "method", "route", "model",
                       "status", "by", "stream", "prompt_tokens", "cached_tokens",
                       "completion_tokens", "drafted_tokens", "accepted_tokens", "queued_s",
                       "ttft_s", "total_s", "bytes_in", "bytes_out", "finish", "reason",
                       "tokens_from", "restored", "saved", "chat", "user"]
    assert r["tokens_from"] is None and r["restored"] is None
    json.dumps(r)  # plain JSON
    assert audit.tokens({"prompt_tokens": 5, "completion_tokens": None}) == 5


# --------------------------------------------------------------------------- a cut answer's tally

CHAT = [b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
        b'"content":null}}],"object":"chat.completion.chunk"}\n\n'] + [
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"w%d"}}],'
    b'"object":"chat.completion.chunk"}\n\n' % i for i in range(7)]


def test_a_cut_stream_counts_a_token_per_event_even_across_reads() -> None:
    whole = b"".join(CHAT)
    for cut in range(1, len(whole)):  # every place a read may end
        t = Tally(route="/v1/chat/completions", stream=True, sent=True, status=200)
        t.feed(whole[:cut])
        t.feed(whole[cut:])
        counts = t.counts()
        assert (counts["completion_tokens"], counts["from"]) == (7, "cut"), cut
        assert t.wants_prompt(499)  # the chat stream never said its prompt: it is asked
    # the text of the answer never counts as an event
    t = Tally(route="/v1/chat/completions", stream=True, sent=True, status=200)
    t.feed(b'data: {"choices":[{"delta":{"content":"\\"delta\\":{\\"x"}}]}\n\n')
    assert t.counts()["completion_tokens"] == 1


def test_an_anthropic_stream_keeps_the_prompt_of_its_first_event() -> None:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
             b'{"cache_read_input_tokens":500,"input_tokens":40,"output_tokens":0}}}\n\n')
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"word"}}\n\n')
    end = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
           b'"max_tokens"},"usage":{"output_tokens":300}}\n\nevent: message_stop\n'
           b'data: {"type":"message_stop"}\n\n')
    t = Tally(route="/v1/messages", stream=True, sent=True, status=200)
    for chunk in [start] + [delta] * 300:  # far more than the tail keeps
        t.feed(chunk)
    cut = t.counts()
    assert (cut["prompt_tokens"], cut["cached_tokens"], cut["completion_tokens"],
            cut["from"]) == (540, 500, 300, "cut")
    assert not t.wants_prompt(499)
    t.feed(end)
    t.ended = True
    whole = t.counts()
    assert (whole["prompt_tokens"], whole["completion_tokens"], whole["from"]) == (
        540, 300, "answer")


def test_what_is_not_sent_costs_nothing_and_an_error_is_not_a_cut() -> None:
    t = Tally(route="/v1/chat/completions", stream=True)
    assert t.counts(499)["from"] is None and not t.wants_prompt(499)
    t.sent = True  # sent; the client left during the prefill: its prompt is charged
    assert t.wants_prompt(499) and t.counts(499)["from"] == "cut"
    # llama-server gone (or a stall) before its answer began: the front's 502/504 costs nothing
    assert not t.wants_prompt(502) and t.counts(502)["from"] is None
    t.status = 400
    t.feed(b'{"error":{"code":400,"message":"too long"}}')
    assert t.counts(400)["completion_tokens"] is None and not t.wants_prompt(400)


def test_a_reservation_is_the_prompt_estimate_and_the_most_it_may_generate() -> None:
    doc = {"messages": [], "max_tokens": 100, "n_predict": 300, "n": 2}
    assert reservation("/v1/chat/completions", doc, 30, 0, 4096) == 10 + 100 * 2
    assert reservation("/v1/chat/completions", {"messages": []}, 30, 0, 4096) == 10 + 4096
    assert reservation("/v1/chat/completions", {"messages": []}, 30, 500, 4096) == 10 + 500
    assert reservation("/v1/embeddings", {"input": "x", "max_tokens": 9}, 31, 0, 4096) == 11
