"""What a request cost: the tokens llama-server computed for it, whichever way it ended, and
what it may cost, reserved against its key's budget before it is sent.

Only the routes that run the model (`SLOT_PATHS`) cost tokens; counting them (`/tokenize`,
`/v1/messages/count_tokens` …) runs none, and only a key's `rpm` bounds it. An answer is read
as JSON: a whole one kept up to `ANSWER_BYTES`, of a stream its first event (Anthropic's prompt)
and its last ones. A 200 that does not say its counts (`response_fields`, native `/embedding`,
TEI-style rerank, an answer past `ANSWER_BYTES`) is charged its reservation.

An answer cut short (the client went, a stall, a shutdown, llama-server gone) is charged what
was computed: its prompt as llama-server counts it (its events, else its tokenizer asked
afterwards), even when the cut came during its prefill, and its own count so far or a token per
token event relayed (a lower bound). Nothing sent to llama-server costs nothing.

The reservation, taken when the request is admitted: the prompt estimated from the body's size
(`BYTES_PER_TOKEN`), plus the most tokens it may generate (its `max_tokens` under any of its
names, else the `max_predict` cap, else the context) times its choices.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mtpwrap.front.access import SLOT_PATHS
from mtpwrap.front.bodies import CHOICE_FIELDS, PREDICT_FIELDS
from mtpwrap.front.companions import ROLE_ROUTES

#: the most of a whole answer (or of one event) kept to read its counts from
ANSWER_BYTES = 8 * 1024 * 1024
#: a stream's last events kept: the usage chunk, [DONE]; Anthropic's message_delta, message_stop
LAST_EVENTS = 4
#: a body's bytes per prompt token for the reservation: generous (English text in a BPE
#: vocabulary is about four bytes a token; JSON and markup fewer)
BYTES_PER_TOKEN = 3

#: per route that generates: the token events of its stream, each (marker, +1 or -1); a marker
#: holds quotes, which a JSON string escapes, so text inside the answer never matches one
_EVENTS: dict[str, tuple[tuple[bytes, int], ...]] = {route: marks for routes, marks in (
    (("/v1/chat/completions", "/chat/completions"), ((b'"delta":{"', 1), (b'"delta":{"role"', -1))),
    (("/v1/completions", "/completions"), ((b'"finish_reason":null', 1),)),
    (("/completion", "/infill"), ((b'"stop":false', 1),)),
    (("/v1/messages",), ((b'"type":"content_block_delta"', 1),)),
    (("/v1/responses", "/responses"), ((b'.delta","', 1),))) for route in routes}
#: the routes that generate, and stream when asked to
STREAMS = frozenset(_EVENTS)
COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "drafted_tokens",
          "accepted_tokens")


def answer_counts(doc: object) -> dict[str, Any]:
    """llama-server's counts in one answer or event (parsed JSON), and its finish: its `usage`
    (Anthropic's prompt: input tokens and those read from the cache; its `message_start` says
    only that), else its `timings`, else the native counts; a batch's answers summed."""
    if isinstance(doc, list):
        parts = [answer_counts(d) for d in doc] or [answer_counts(None)]
        said = {k: [p[k] for p in parts if p[k] is not None] for k in COUNTS}
        return {**{k: sum(v) if v else None for k, v in said.items()},
                "finish": parts[-1]["finish"]}
    d = _obj(doc)
    usage = _obj(d.get("usage")) or _obj(_obj(d.get("response")).get("usage"))
    start = {} if usage else _obj(_obj(d.get("message")).get("usage"))
    u, t, native = _ints(usage or start), _ints(d.get("timings")), _ints(d)
    cached = _ints(usage.get("prompt_tokens_details") or usage.get("input_tokens_details"))
    choices = d.get("choices") if isinstance(d.get("choices"), list) else [{}]
    finish = [_obj(choices[-1] if choices else {}).get("finish_reason"), d.get("stop_reason"),
              _obj(d.get("delta")).get("stop_reason")]
    prompt = [u.get("prompt_tokens"),
              u["input_tokens"] + u.get("cache_read_input_tokens", 0) if "input_tokens" in u
              else None, t["prompt_n"] + t.get("cache_n", 0) if "prompt_n" in t else None,
              native.get("tokens_evaluated")]
    return {
        "prompt_tokens": next((v for v in prompt if v is not None), None),
        "cached_tokens": cached.get("cached_tokens", u.get("cache_read_input_tokens",
                                                           t.get("cache_n"))),
        "completion_tokens": None if start else u.get("completion_tokens", u.get(
            "output_tokens", t.get("predicted_n", native.get("tokens_predicted")))),
        "drafted_tokens": t.get("draft_n"), "accepted_tokens": t.get("draft_n_accepted"),
        "finish": next((f for f in finish if isinstance(f, str) and 0 < len(f) <= 32), None),
    }


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _ints(value: object) -> dict[str, int]:  # an object's whole-number fields
    return {k: v for k, v in _obj(value).items() if isinstance(v, int) and not isinstance(v, bool)}


@dataclass(eq=False)
class Tally:
    """One answer of a model route as far as its tokens go, fed by the relay chunk by chunk:
    a whole answer kept, to be parsed at its end; of an event stream, its first and last
    events, and its token events counted as they pass."""

    route: str = "other"
    stream: bool = False  # an event stream (as the client asked, until llama-server's head)
    sent: bool = False    # the request went to llama-server (a prompt was handed over)
    status: int = 0       # llama-server's status (0: no head from it yet)
    ended: bool = False   # the answer was relayed to its end (or to its last event)
    events: int = 0       # token events relayed
    #: the whole answer's chunks (references), or a stream's event in progress; their size
    kept: list[bytes] = field(default_factory=list)
    size: int = 0
    first: bytes = b""  # a stream's first event; its last ones:
    last: collections.deque[bytes] = field(
        default_factory=lambda: collections.deque(maxlen=LAST_EVENTS))

    def feed(self, chunk: bytes) -> None:
        # an event ends at a blank line, which one read may end in the middle of
        if not self.stream or (b"\n\n" not in chunk and not (
                chunk[:1] == b"\n" and self.kept and self.kept[-1][-1:] == b"\n")):
            self.size += len(chunk)
            if self.size <= ANSWER_BYTES:
                self.kept.append(chunk)
            return
        *done, rest = b"".join([*self.kept, chunk]).split(b"\n\n")
        self.kept, self.size = [rest], len(rest)
        marks = _EVENTS.get(self.route, ())
        for event in done:
            self.first = self.first or event
            self.last.append(event)
            for mark, sign in marks:
                self.events += sign * event.count(mark)

    def said(self) -> dict[str, Any]:
        """llama-server's counts as far as its answer says them (an answer past `ANSWER_BYTES`
        is kept cut, and not parsed); a stream's from its first event (Anthropic's
        prompt) and its last ones, the later saying more."""
        read = dict.fromkeys((*COUNTS, "finish"))
        whole = [b"".join(self.kept)] if self.size <= ANSWER_BYTES else []  # past it: cut
        for raw in whole if not self.stream else [
                next((line[5:] for line in e.split(b"\n") if line.startswith(b"data:")), b"")
                for e in (self.first, *self.last)]:
            with contextlib.suppress(ValueError, RecursionError):
                said = answer_counts(json.loads(raw))
                read.update({k: v for k, v in said.items() if v is not None})
        return read

    def counts(self, client_status: int = 200, counted: int | None = None,
               estimate: int | None = None, reserved: int | None = None) -> dict[str, Any]:
        """What the request is charged, and `from` where that came from: `answer`; `cut` (its
        prompt, where the answer did not say it, as llama-server's tokenizer `counted` it);
        `reserved` (the admission's reservation, `estimate` its prompt's part, no fewer tokens
        than events relayed); `estimate` (the prompt's, where nothing else says); None."""
        cut = self.cut(client_status)
        if not cut and not (self.ended and self.status == 200 and self.route in SLOT_PATHS):
            return {**dict.fromkeys((*COUNTS, "finish")), "from": None}
        counts = {**self.said(), "from": "cut" if cut else "answer"}
        generates = self.route in STREAMS
        if cut and counts["completion_tokens"] is None:
            counts["completion_tokens"] = max(self.events, 0)
        if cut and counts["prompt_tokens"] is None:
            counts["prompt_tokens"] = counted if counted is not None else estimate
            counts["from"] = "cut" if counted is not None or estimate is None else "estimate"
        elif not cut and (counts["prompt_tokens"] is None
                          or generates and counts["completion_tokens"] is None):
            whole = reserved if reserved is not None else estimate or 0
            prompt = min(estimate or 0, whole) if generates else whole
            counts.update(prompt_tokens=prompt,
                          completion_tokens=max(whole - prompt, self.events) or None)
            counts["from"] = "reserved" if reserved is not None else "estimate"
        return counts

    def cut(self, client_status: int) -> bool:
        """The request went to llama-server's model and its answer (none yet, or a 200) was
        not relayed to its end — but not one the front failed (a 5xx) before llama-server's
        answer began (llama-server gone, a stall, a shutdown): that costs nothing."""
        return (self.route in SLOT_PATHS and self.sent and not self.ended
                and self.status in (0, 200) and not (self.status == 0 and client_status >= 500))

    def wants_prompt(self, client_status: int) -> bool:
        """A cut request whose answer never said its prompt's size."""
        return self.cut(client_status) and self.counts(client_status)["prompt_tokens"] is None


# --------------------------------------------------------------------------- reservation

def reservation(route: str, doc: object, body_bytes: int, max_predict: int,
                context: int | None) -> int:
    """The tokens a request may cost, reserved when it is admitted: its prompt estimated from
    the body's size (a rerank's query once per document), plus what it may generate (only
    generation routes generate)."""
    prompt = -(-body_bytes // BYTES_PER_TOKEN)
    docs, query = _obj(doc).get("documents", _obj(doc).get("texts")), _obj(doc).get("query")
    if route in ROLE_ROUTES["rerank"] and isinstance(docs, list) and isinstance(query, str):
        # llama-server reads the query once per document, with a few tokens around each pair
        return prompt + len(docs) * (-(-len(query.encode()) // BYTES_PER_TOKEN) + 4)
    if route not in _EVENTS or not isinstance(doc, Mapping):
        return prompt
    n = _ints(doc)
    asked = [n[k] for k in PREDICT_FIELDS if n.get(k, 0) > 0]
    most = min(asked) if asked else (max_predict or context or 0)
    if max_predict:
        most = min(most, max_predict)
    return prompt + most * next((n[k] for k in CHOICE_FIELDS if n.get(k, 0) > 1), 1)


# --------------------------------------------------------------------------- a cut's prompt

def asker(client: httpx.AsyncClient, base_url: str, api_key: str, timeout: float, *,
          close: bool = False) -> Any:
    """POST a JSON body to one of llama-server's paths: (status, the answer's object)."""
    headers = {"authorization": f"Bearer {api_key}"}
    if close:
        headers["connection"] = "close"

    async def ask(path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        r = await client.post(base_url + path, content=json.dumps(body), headers=headers,
                              timeout=timeout)
        try:
            return r.status_code, _obj(r.json())
        except ValueError:
            return r.status_code, {}

    return ask


async def count_prompt(client: httpx.AsyncClient, base_url: str, api_key: str, route: str,
                       doc: object, timeout: float) -> int | None:
    """The prompt's tokens as llama-server's tokenizer counts them, for a request cut before
    its answer said; None where the route's prompt cannot be asked about or llama-server does
    not answer."""
    if not isinstance(doc, Mapping):
        return None
    # rare (cuts only): each connection closed after its answer, none kept in the pool
    ask = asker(client, base_url, api_key, timeout, close=True)
    try:
        if route == "/v1/messages":
            status, n = await ask("/v1/messages/count_tokens", doc)
            return _ints(n).get("input_tokens") if status == 200 else None
        prompt = await _prompt(ask, route, doc)
        return await _tokenized(ask, prompt)
    except (httpx.HTTPError, ValueError):
        return None


async def prompt_tokens(ask: Any, route: str, doc: object) -> list[int] | None:
    """The tokens llama-server will read for a chat or completion request of one prompt (the
    chat template applied); None for another route, a batch, or no answer."""
    if not isinstance(doc, Mapping):
        return None
    try:
        prompt = await _prompt(ask, route, doc)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return await _tokens(ask, prompt) if isinstance(prompt, str) else None
    except (httpx.HTTPError, ValueError):
        return None


async def _prompt(ask: Any, route: str, doc: Mapping[str, Any]) -> object:
    """The prompt of a chat request (its template applied) or of a completion request."""
    if route in ("/v1/chat/completions", "/chat/completions"):
        status, answer = await ask("/apply-template", doc)
        return answer.get("prompt") if status == 200 else None
    if route in ("/v1/completions", "/completions", "/completion"):
        return doc.get("prompt")
    return None


async def _tokens(ask: Any, prompt: str) -> list[int] | None:
    status, answer = await ask("/tokenize", {"content": prompt, "add_special": True,
                                             "parse_special": True})
    tokens = answer.get("tokens") if status == 200 else None
    return tokens if isinstance(tokens, list) else None


async def _tokenized(ask: Any, prompt: object) -> int | None:
    """A prompt's tokens: a string tokenized, token ids counted, a batch of either summed."""
    if isinstance(prompt, str):
        tokens = await _tokens(ask, prompt)
        return None if tokens is None else len(tokens)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        parts = [await _tokenized(ask, p) for p in prompt]
        return None if any(p is None for p in parts) else sum(p or 0 for p in parts)
    return None
