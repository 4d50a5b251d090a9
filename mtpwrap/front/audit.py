"""The audit trail: one JSON line per request, written when its answer ends or its client goes.

A line says who asked (the key's name, never the key), from where, which route, what came of
it (status, who answered, the finish or refusal reason), how many tokens it was charged
(`front.usage`: llama-server's own counts — prompt, cached, completion, drafted, accepted —,
what was computed of a request cut short, or its reservation; `tokens_from` says which), how
long it waited in the queue, its time to the first token and in all, and the bytes in and out.
Never a prompt, an answer, a header or a key: the line is built from the fields below only.

Sinks: a file per UTC day under `audit.dir` (`audit-YYYY-MM-DD.jsonl`, 0600 in a 0700
directory, one `write` per line so lines never interleave), files older than
`audit.retention_days` deleted when the day turns and at start; or journald, each field as a
structured field (`MTPWRAP_KEY=`, `MTPWRAP_TOKENS_IN=` …) for a SIEM via rsyslog; or off.

The serving loop never writes a line itself: it queues the line (in the order the requests
ended) for one writer thread (`supervision.writer.InOrderWriter`), so a slow or stalled disk or
journald holds no stream, probe or watchdog ping. The queue holds `QUEUE_LINES` lines (a disk
stalled for minutes at the front's highest rate). A line that finds it full is not lost and
does not stop the serving: it goes whole to the service's own log (journald keeps it) and
`mtpwrap_audit_unwritten_total{reason="queue_full"}` counts it, so the trail can be completed
from the journal; blocking the loop instead would stop every client and the systemd watchdog,
which would then kill the service with the whole queue in it. Close (the front's shutdown)
writes what is queued, waiting up to `CLOSE_S`; a line still unwritten then goes to the log
the same way (`reason="shutdown"`). A line the sink refuses (a full disk, journald gone) is
counted with `reason="write_failed"` and the error logged once per run of failures.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import datetime as dt
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mtpwrap.config.apikeys import ApiKey
from mtpwrap.config.objects import AuditConfig
from mtpwrap.front.access import route_label
from mtpwrap.front.budgets import Budgets, Hold
from mtpwrap.front.metrics import FrontMetrics
from mtpwrap.front.rereads import Block, Rereads
from mtpwrap.front.usage import COUNTS, Tally
from mtpwrap.supervision.writer import InOrderWriter

log = logging.getLogger("mtpwrap.audit")

#: the front's own pages, audited under their path (every other path is a route's label)
FRONT_PAGES = frozenset({"/metrics", "/healthz", "/status", "/status.json"})
#: journald's native socket
JOURNAL_SOCKET = "/run/systemd/journal/socket"
#: how long the end of a cut request waits for llama-server to count its prompt
COUNT_TIMEOUT_S = 5.0
#: lines the writer's queue holds (about 40 MB at 400 bytes a line; at 100 requests a second, a
#: disk stalled for a quarter of an hour)
QUEUE_LINES = 100_000
#: how long close waits for the queued lines to be written
CLOSE_S = 10.0


@dataclass(eq=False)
class Ticket:
    """One request as the audit trail sees it; filled in by whoever learns a field."""

    method: str
    route: str
    client: str
    key: str = "-"
    klass: str = "interactive"
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    status: int = 0
    by: str = "front"
    stream: bool = False
    bytes_in: int = 0
    bytes_out: int = 0
    queued_s: float = 0.0
    ttft_s: float | None = None
    #: why the front refused it (the `mtpwrap_refused`/`shed` reason), or how it was cut
    reason: str | None = None
    #: what llama-server's answer says of its tokens (the relay feeds it)
    tally: Tally = field(default_factory=Tally)
    api_key: ApiKey | None = field(default=None, repr=False)
    #: the companion that answered (its name); None: the chat model
    model: str | None = None
    #: the tokens reserved against its key's budgets when it was admitted
    hold: Hold | None = None
    #: what it may cost, as reserved at admission (with a key or without): a 200 whose
    #: answer does not say its counts pays this
    reserved: int | None = None
    #: the reservation's estimate of the prompt (what a cut charges when llama-server cannot
    #: count it)
    prompt_estimate: int | None = None
    #: asks llama-server how many tokens the request's prompt is (for a cut answer)
    count_prompt: Callable[[], Awaitable[int | None]] | None = field(default=None, repr=False)
    #: the prompt as llama-server counted it after a cut
    prompt_counted: int | None = None
    #: a chat model request's prompt as block hashes, and the llama-server generation that
    #: answered it (`front.rereads`: why it was read again)
    blocks: tuple[Block, ...] = field(default=(), repr=False)
    generation: int | None = None
    #: what the document store restored into the slot before it, and kept of it after
    #: (front/store.py: tokens, bytes, ms)
    restored: dict[str, Any] | None = None
    saved: dict[str, Any] | None = None
    #: the chat and the person as the client names them (Open WebUI's forwarded user headers)
    chat: str | None = None
    user: str | None = None

    def record(self, model: str) -> dict[str, Any]:
        counts = self.tally.counts(self.status, self.prompt_counted, self.prompt_estimate,
                                   self.reserved)
        return {
            "time": _iso(self.at), "id": self.id, "key": self.key, "class": self.klass,
            "client": self.client, "method": self.method, "route": self.route, "model": model,
            "status": self.status, "by": self.by, "stream": self.stream,
            **{name: counts[name] for name in COUNTS}, "queued_s": round(self.queued_s, 4),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "total_s": round(time.perf_counter() - self.t0, 4),
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "finish": counts["finish"], "reason": self.reason, "tokens_from": counts["from"],
            "restored": self.restored, "saved": self.saved, "chat": self.chat, "user": self.user,
        }


#: the current request's ticket (the guard sets it; the worker tasks it starts see the same)
current: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("mtpwrap_ticket",
                                                                        default=None)

def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def tokens(record: dict[str, Any]) -> int:
    """The tokens a record counts against a budget: its prompt and completion together."""
    return (record.get("prompt_tokens") or 0) + (record.get("completion_tokens") or 0)


# --------------------------------------------------------------------------- sinks

class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NoSink:
    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def day_of(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d")


_FILE = re.compile(r"^audit-(\d{4}-\d{2}-\d{2})\.jsonl$")


class FileSink:
    """A JSON line per request in today's file; the day's turn opens the next one."""

    def __init__(self, directory: Path, retention_days: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory, self.retention_days, self.clock = directory, retention_days, clock
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._fd = -1
        self._day = ""
        self.prune()

    def write(self, record: dict[str, Any]) -> None:
        day = day_of(self.clock())
        if day != self._day:
            self._open(day)
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def _open(self, day: str) -> None:
        self.close()
        path = self.directory / f"audit-{day}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(self._fd, 0o600)
        self._day = day
        self.prune()

    def prune(self) -> list[Path]:
        """Delete the files older than the retention; the deleted ones."""
        oldest = day_of(self.clock() - self.retention_days * 86400)
        gone = []
        for path in sorted(self.directory.iterdir()):
            m = _FILE.match(path.name)
            if m and m.group(1) < oldest:
                path.unlink(missing_ok=True)
                gone.append(path)
        if gone:
            log.info("audit: deleted %d file(s) older than %d days", len(gone),
                     self.retention_days)
        return gone

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._day = ""


class JournalSink:
    """Each record as a journald entry with structured fields, over journald's own socket."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.connect(path)

    def write(self, record: dict[str, Any]) -> None:
        fields = [f"MESSAGE=mtpwrap audit {record['route']} {record['status']} "
                  f"key={record['key']}", "PRIORITY=6", "SYSLOG_IDENTIFIER=mtpwrap-audit"]
        fields += [f"MTPWRAP_{name.upper()}={_plain(value)}" for name, value in record.items()
                   if value is not None]
        fields += [f"MTPWRAP_TOKENS_IN={record.get('prompt_tokens') or 0}",
                   f"MTPWRAP_TOKENS_OUT={record.get('completion_tokens') or 0}"]
        try:
            self.sock.send("\n".join(fields).encode() + b"\n")
        except OSError as err:
            log.warning("audit: journald refused a record (%s)", err)

    def close(self) -> None:
        self.sock.close()


def _plain(value: Any) -> str:
    return str(value).replace("\n", " ")


def open_sink(cfg: AuditConfig, clock: Callable[[], float] = time.time) -> Sink:
    if cfg.sink == "off":
        return NoSink()
    if cfg.sink == "journald":
        return JournalSink()
    return FileSink(cfg.directory, cfg.retention_days, clock)


def read_records(directory: Path, since: str | None = None) -> Iterator[dict[str, Any]]:
    """The audit files' records, oldest first; `since`: a YYYY-MM-DD day, the first read."""
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        m = _FILE.match(path.name)
        if not m or (since is not None and m.group(1) < since):
            continue
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue  # a line cut by a crash mid-write


# --------------------------------------------------------------------------- the trail

#: the writer's first job where the trail is a file: today's lines read (by identity)
_SEED: dict[str, Any] = {}

#: the front's pages that are not audited: probes carry no key and come every few seconds
UNAUDITED = frozenset({"/livez", "/readyz"})


class Trail:
    """Ends each request's ticket: its audit line, its usage counters, its budget's tokens;
    and keeps the last refusals for the status page."""

    def __init__(self, sink: Sink, metrics: FrontMetrics, budgets: Budgets,
                 model: Callable[[], str | None], clock: Callable[[], float] = time.time,
                 queue_lines: int = QUEUE_LINES) -> None:
        self.sink, self.metrics, self.budgets, self.model = sink, metrics, budgets, model
        self.clock = clock
        #: the writer thread and its queue: the loop only queues a line
        self.writer: InOrderWriter[dict[str, Any]] = InOrderWriter(
            self._write, name="mtpwrap-audit", limit=queue_lines)
        metrics.audit_queue.set_function(lambda: self.writer.pending)
        self.refusals: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        #: the cause of each heavy re-read of a prompt (the front sets it)
        self.rereads: Rereads | None = None
        self.lines = 0
        self._failed = False
        #: today's totals per key (UTC day), for the status page; seeded from today's file
        self._day = day_of(clock())
        self._today: dict[str, dict[str, int]] = {}
        self._today_lock = threading.Lock()  # the loop adds to them, the writer seeds them
        #: (end time, completion tokens) of the last minute's requests
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        if isinstance(sink, FileSink):
            # the writer's first job, off the loop (a day's file may hold 100,000 lines), and
            # done before it writes any line of this run's: none is counted twice
            self.writer.submit(_SEED)

    def begin(self, scope: dict[str, Any] | Any, path: str, key: ApiKey | None) -> Ticket:
        client = scope.get("client")
        route = path if path in FRONT_PAGES else route_label(scope["method"], path)
        t = Ticket(method=scope["method"], route=route, client=client[0] if client else "-")
        said = {k: v.decode("latin-1")[:128] for k, v in scope.get("headers") or ()
                if k in (b"x-openwebui-chat-id", b"x-openwebui-user-id")}
        t.chat, t.user = said.get(b"x-openwebui-chat-id"), said.get(b"x-openwebui-user-id")
        if key is not None:
            t.key, t.klass, t.api_key = key.name, key.klass, key
        return t

    async def finish(self, t: Ticket) -> dict[str, Any]:
        """`end`, once llama-server has counted the prompt of a request cut before its answer
        said (a few seconds at most: past them the reservation's estimate is charged, as it is
        for a request stopped by a shutdown, when llama-server is about to stop)."""
        if t.count_prompt is not None and t.reason != "shutdown" and \
                t.tally.wants_prompt(t.status):
            with contextlib.suppress(Exception):
                t.prompt_counted = await asyncio.wait_for(t.count_prompt(), COUNT_TIMEOUT_S)
        return self.end(t)

    def end(self, t: Ticket) -> dict[str, Any]:
        record = t.record(t.model or self.model() or "-")
        if self.rereads is not None:
            record.update(self.rereads.explain(t.key, t.blocks, t.generation, record))
        if not self.writer.submit(record):
            self._unwritten(record, "queue_full")
        status = record["status"]
        self.metrics.key_requests.labels(t.key, f"{status // 100}xx").inc()
        self.metrics.model_requests.labels(record["model"], f"{status // 100}xx").inc()
        for kind in ("prompt", "completion"):
            if record[f"{kind}_tokens"]:
                self.metrics.key_tokens.labels(t.key, kind).inc(record[f"{kind}_tokens"])
        if t.reason is not None and status >= 400:
            self.metrics.key_refused.labels(t.key, t.reason).inc()
            self.refusals.append({k: record[k] for k in ("time", "key", "route", "status",
                                                        "reason")})
        if t.api_key is not None:
            self.budgets.settle(t.api_key, t.hold, tokens(record))
        self._add_today(record)
        if record["completion_tokens"] and record["tokens_from"] != "reserved":  # generated
            self._recent.append((self.clock(), record["completion_tokens"]))
        return record

    def _write(self, record: dict[str, Any]) -> None:
        """The writer thread's: one line to the sink (or, first, today's lines read)."""
        if record is _SEED and isinstance(self.sink, FileSink):
            for line in read_records(self.sink.directory, since=self._day):
                self._add_today(line)
            return
        try:
            self.sink.write(record)
            self.lines += 1
            self._failed = False
        except OSError as err:
            self.metrics.audit_unwritten.labels("write_failed").inc()
            if not self._failed:  # once per run of failures, not once per request
                log.error("audit: cannot write the audit trail (%s); requests are still "
                          "served", err)
            self._failed = True

    def _unwritten(self, record: dict[str, Any], reason: str) -> None:
        """A line the writer could not take: whole into the service's log, and counted."""
        self.metrics.audit_unwritten.labels(reason).inc()
        log.error("audit: line not written to the trail (%s), kept here: %s", reason,
                  json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def _add_today(self, record: dict[str, Any] | None) -> None:
        """A record into today's totals (None: none, a new day only)."""
        day = day_of(self.clock())
        with self._today_lock:
            if day != self._day:
                self._day, self._today = day, {}
            if record is not None and str(record.get("time", ""))[:10] == day:
                _add(self._today.setdefault(str(record.get("key") or "-"), dict.fromkeys(
                    ("requests", "refused", "prompt_tokens", "completion_tokens"), 0)), record)

    def usage_today(self) -> list[dict[str, Any]]:
        self._add_today(None)
        with self._today_lock:
            return [{"key": k, **v} for k, v in sorted(self._today.items())]

    def tokens_per_s(self, window_s: float = 60.0) -> float:
        """Completion tokens of the requests that ended in the last `window_s`, per second."""
        start = self.clock() - window_s
        while self._recent and self._recent[0][0] < start:
            self._recent.popleft()
        return sum(n for _t, n in self._recent) / window_s

    def close(self) -> None:
        """Write the queued lines (up to `CLOSE_S`; those left go to the log), then close the
        sink and the budgets' writer. Blocks: the shutdown's last step."""
        for record in self.writer.close(CLOSE_S):
            if record is not _SEED:
                self._unwritten(record, "shutdown")
        self.budgets.close()
        self.sink.close()


# --------------------------------------------------------------------------- usage

#: what `mtpwrap usage` groups by, and the record field each reads
GROUPS = {"key": "key", "route": "route", "day": "time"}
SUMS = ("requests", "refused", "prompt_tokens", "cached_tokens", "completion_tokens",
        "bytes_in", "bytes_out")


def summarize(records: Iterator[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Totals per key, route or day: requests, refusals by the front, tokens and bytes."""
    field_ = GROUPS[by]
    totals: dict[str, dict[str, Any]] = {}
    for r in records:
        group = str(r.get(field_) or "-")
        if by == "day":
            group = group[:10]
        _add(totals.setdefault(group, {by: group, **dict.fromkeys(SUMS, 0)}), r)
    return [totals[k] for k in sorted(totals)]


def _add(totals: dict[str, Any], record: dict[str, Any]) -> None:
    """A record into its group's totals: a request, a refusal by the front, the sums kept."""
    totals["requests"] += 1
    totals["refused"] += record.get("by") == "front" and (record.get("status") or 0) >= 400
    for name in totals.keys() & set(SUMS[2:]):
        totals[name] += record.get(name) or 0
