"""The audit trail's sinks and counts (`mtpwrap.front.audit`) without a server: daily files,
their mode and retention under an injected clock, journald's structured fields on a socket of
the test's own, and the token counts read from an answer's end. The real-server checks (the
counts equal llama-server's usage, canaries nowhere) are in tests/test_audit_real.py."""

from __future__ import annotations

import json
import socket
import stat
import tempfile
from pathlib import Path

from mtpwrap.front import audit
from mtpwrap.front.audit import FileSink, JournalSink, Ticket, answer_counts, read_records

DAY = 86400.0
T0 = 1_800_000_000.0  # 2027-01-15


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(n: int) -> dict[str, object]:
    t = Ticket(method="POST", route="/v1/chat/completions", client="127.0.0.1", key="app")
    t.status, t.by = 200, "llama-server"
    t.tail.append(b'{"usage":{"completion_tokens":%d,"prompt_tokens":7}}' % n)
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
    path = str(Path(tempfile.mkdtemp(prefix="journal-")) / "socket")
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(path)
    try:
        sink = JournalSink(path)
        sink.write(record(5))
        sink.close()
        fields = dict(line.split("=", 1) for line in journal.recv(65536).decode().splitlines())
    finally:
        journal.close()
    assert fields["SYSLOG_IDENTIFIER"] == "mtpwrap-audit" and fields["PRIORITY"] == "6"
    assert fields["MTPWRAP_KEY"] == "app" and fields["MTPWRAP_STATUS"] == "200"
    assert fields["MTPWRAP_TOKENS_IN"] == "7" and fields["MTPWRAP_TOKENS_OUT"] == "5"
    assert fields["MTPWRAP_ROUTE"] == "/v1/chat/completions"
    assert "MTPWRAP_REASON" not in fields  # None fields are left out


def test_counts_come_from_the_answers_end_not_from_text_inside_it() -> None:
    # a stream without include_usage: llama-server's timings in its last event
    stream = (b'data: {"choices":[{"delta":{"content":"say \\"prompt_tokens\\": 999"}}]}\n\n'
              b'data: {"choices":[{"finish_reason":"length","delta":{}}],"timings":'
              b'{"cache_n":3,"prompt_n":9,"predicted_n":16,"draft_n":12,'
              b'"draft_n_accepted":10}}\n\ndata: [DONE]\n\n')
    assert answer_counts(stream) == {"prompt_tokens": 12, "cached_tokens": 3,
                                     "completion_tokens": 16, "drafted_tokens": 12,
                                     "accepted_tokens": 10, "finish": "length"}
    # usage wins where llama-server gave it; Anthropic's names too
    anthropic = (b'{"content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn",'
                 b'"usage":{"cache_read_input_tokens":0,"input_tokens":21,"output_tokens":4}}')
    counts = answer_counts(anthropic)
    assert counts["prompt_tokens"] == 21 and counts["completion_tokens"] == 4
    assert counts["finish"] == "end_turn"
    assert answer_counts(b'{"tokens":[1,2,3]}')["prompt_tokens"] is None


def test_a_front_made_answer_has_no_token_counts_and_the_record_has_every_field() -> None:
    t = Ticket(method="POST", route="/v1/chat/completions", client="10.0.0.7", key="app")
    t.status, t.reason = 429, "budget_rpm"
    t.tail.append(b'{"usage":{"prompt_tokens":5}}')  # never read for a front-made answer
    r = t.record("demo")
    assert r["prompt_tokens"] is None and r["by"] == "front" and r["reason"] == "budget_rpm"
    assert list(r) == ["time", "id", "key", "class", "client", "method", "route", "model",
                       "status", "by", "stream", "prompt_tokens", "cached_tokens",
                       "completion_tokens", "drafted_tokens", "accepted_tokens", "queued_s",
                       "ttft_s", "total_s", "bytes_in", "bytes_out", "finish", "reason"]
    json.dumps(r)  # plain JSON
    assert audit.tokens({"prompt_tokens": 5, "completion_tokens": None}) == 5
