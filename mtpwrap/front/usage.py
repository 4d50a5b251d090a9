"""What a request cost: the tokens llama-server computed for it, whichever way it ended, and
what it may cost, reserved against its key's budget before it is sent.

An answer that ended as llama-server meant it carries llama-server's own counts: `usage`
(OpenAI's and Anthropic's names), `timings` (a stream without `include_usage`) or the native
`tokens_evaluated`/`tokens_predicted` (every chunk of `/completion`). An Anthropic stream says
its prompt in its first event only (`message_start`: `input_tokens` plus
`cache_read_input_tokens`) and its answer in its last (`message_delta`): the first bytes of
every answer are kept for that, and its last chunks for the rest.

An answer cut short (the client went, a stall, a shutdown, llama-server gone) is charged what
was computed: the prompt as llama-server counts it (the first event, or its own tokenizer asked
afterwards: `/apply-template` + `/tokenize`, `/tokenize`, `/v1/messages/count_tokens`), and a
token for each token event relayed (a character made of several tokens is one event, so this
is a lower bound). A prompt sent to llama-server is charged whole, even when the cut came during
its prefill: llama-server does not say how far it got. Nothing sent to llama-server costs
nothing.

The reservation, taken when the request is admitted: the prompt estimated from the body's size
(`BYTES_PER_TOKEN`), plus the most tokens it may generate (its `max_tokens` under any of its
names, else the `max_predict` cap, else the context) times its choices.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mtpwrap.front.bodies import CHOICE_FIELDS, PREDICT_FIELDS

#: the answer's last bytes kept to read its usage and timings from (they end the answer)
TAIL_BYTES = 16 * 1024
#: the answer's first bytes kept to read an Anthropic stream's prompt from (its first event)
HEAD_BYTES = 4096
#: a body's bytes per prompt token for the reservation: generous (English text in a BPE
#: vocabulary is about four bytes a token; JSON and markup fewer)
BYTES_PER_TOKEN = 3

# One token count each, the last in the answer: usage (OpenAI's and Anthropic's names), timings
# and the native counts. `(?<!\\)` skips a name inside a JSON string of the answer.
_COUNT = {name: re.compile(rb'(?<!\\)"' + name.encode() + rb'"\s*:\s*(\d+)') for name in (
    "prompt_tokens", "completion_tokens", "cached_tokens", "input_tokens", "output_tokens",
    "cache_read_input_tokens", "prompt_n", "cache_n", "predicted_n", "draft_n",
    "draft_n_accepted", "tokens_evaluated", "tokens_predicted")}
_FINISH = re.compile(rb'(?<!\\)"(?:finish_reason|stop_reason)"\s*:\s*"([a-z_]{1,32})"')

#: the routes whose streams are Anthropic's events
MESSAGES = frozenset({"/v1/messages"})
#: per route: the token events of its stream, each (marker, +1 or -1); a marker holds quotes,
#: which a JSON string escapes, so text inside the answer never matches one
_EVENTS: dict[str, tuple[tuple[bytes, int], ...]] = {}
for _route, _marks in {
    ("/v1/chat/completions", "/chat/completions"): ((b'"delta":{"', 1),
                                                     (b'"delta":{"role"', -1)),
    ("/v1/completions", "/completions"): ((b'"finish_reason":null', 1),),
    ("/completion", "/infill"): ((b'"stop":false', 1),),
    ("/v1/messages",): ((b'"type":"content_block_delta"', 1),),
    ("/v1/responses", "/responses"): ((b'.delta","', 1),),
}.items():
    for _r in _route:
        _EVENTS[_r] = _marks


def _last(pattern: re.Pattern[bytes], text: bytes) -> int | None:
    found = pattern.findall(text)
    return int(found[-1]) if found else None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def answer_counts(tail: bytes) -> dict[str, Any]:
    """Token counts and the finish reason from the end of an answer: llama-server's `usage`
    where it gave one, else its `timings`, else its native counts. A prompt counts its cached
    tokens (OpenAI's `prompt_tokens`; Anthropic's `input_tokens` + `cache_read_input_tokens`)."""
    n = {name: _last(p, tail) for name, p in _COUNT.items()}
    prompt_n, cache_n = n["prompt_n"], n["cache_n"]
    from_timings = None if prompt_n is None else prompt_n + (cache_n or 0)
    anthropic = None if n["input_tokens"] is None \
        else n["input_tokens"] + (n["cache_read_input_tokens"] or 0)
    out: dict[str, Any] = {
        "prompt_tokens": _first(n["prompt_tokens"], anthropic, from_timings,
                                n["tokens_evaluated"]),
        "cached_tokens": _first(n["cached_tokens"], n["cache_read_input_tokens"], cache_n),
        "completion_tokens": _first(n["completion_tokens"], n["output_tokens"],
                                    n["predicted_n"], n["tokens_predicted"]),
        "drafted_tokens": n["draft_n"], "accepted_tokens": n["draft_n_accepted"],
    }
    finish = _FINISH.findall(tail)
    out["finish"] = finish[-1].decode() if finish else None
    return out


@dataclass(eq=False)
class Tally:
    """One answer's bytes as far as its tokens go, fed by the relay chunk by chunk: its first
    bytes, its last chunks and its token events."""

    route: str = "other"
    stream: bool = False
    #: the request went to llama-server (a prompt was handed over)
    sent: bool = False
    #: llama-server's status (0: no head from it yet)
    status: int = 0
    #: the answer was relayed to its end (or to its last event)
    ended: bool = False
    head: bytearray = field(default_factory=bytearray)
    #: the answer's last chunks (references), for its final counts and draft figures
    tail: collections.deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=64))
    #: token events relayed
    events: int = 0
    _edge: dict[bytes, bytes] = field(default_factory=dict)

    def feed(self, chunk: bytes) -> None:
        if len(self.head) < HEAD_BYTES:
            self.head += chunk[:HEAD_BYTES - len(self.head)]
        self.tail.append(chunk)
        marks = _EVENTS.get(self.route) if self.stream else None
        if marks:
            for mark, sign in marks:
                # a mark cut between two reads: the last len-1 bytes of the one before, with
                # this one's first len-1 (neither alone can hold a whole mark)
                edge = self._edge.get(mark, b"")
                k = len(mark) - 1
                self.events += sign * (chunk.count(mark) + (edge + chunk[:k]).count(mark))
                self._edge[mark] = chunk[-k:]

    def last_bytes(self, n: int) -> bytes:
        return b"".join(self.tail)[-n:]

    def counts(self, client_status: int = 200) -> dict[str, Any]:
        """The answer's counts: llama-server's own where the answer has them; for a cut
        stream, the prompt from its first event and a token per event relayed (the prompt
        None where the answer never said it: `count_prompt` asks). `client_status`: the status
        the client got."""
        counts = answer_counts(self.last_bytes(TAIL_BYTES))
        if self.stream and self.route in MESSAGES:
            # the first event's prompt, the last event's answer: never message_start's zero
            start = answer_counts(bytes(self.head))
            counts["prompt_tokens"], counts["cached_tokens"] = (start["prompt_tokens"],
                                                                start["cached_tokens"])
            tail = self.last_bytes(TAIL_BYTES)
            at = tail.rfind(b'"type":"message_delta"')
            counts["completion_tokens"] = None if at < 0 \
                else _last(_COUNT["output_tokens"], tail[at:])
        if self.cut(client_status):
            if counts["completion_tokens"] is None:
                counts["completion_tokens"] = max(self.events, 0)
            counts["from"] = "cut"
        else:
            counts["from"] = "answer" if counts["prompt_tokens"] is not None or \
                counts["completion_tokens"] is not None else None
        return counts

    def cut(self, client_status: int) -> bool:
        """The request went to llama-server and its answer (none yet, or a 200) was not
        relayed to its end — but not one the server side failed before llama-server's answer
        began (a 5xx of the front's: llama-server gone, a stall, a shutdown), which costs the
        client nothing."""
        return (self.sent and not self.ended and self.status in (0, 200)
                and not (self.status == 0 and client_status >= 500))

    def wants_prompt(self, client_status: int) -> bool:
        """A cut request whose answer never said its prompt's size."""
        return self.cut(client_status) and self.counts(client_status)["prompt_tokens"] is None


# --------------------------------------------------------------------------- reservation

def reservation(route: str, doc: object, body_bytes: int, max_predict: int,
                context: int | None) -> int:
    """The tokens a request may cost, reserved when it is admitted: its prompt estimated from
    the body's size, plus what it may generate (only generation routes generate)."""
    prompt = -(-body_bytes // BYTES_PER_TOKEN)
    if route not in _EVENTS or not isinstance(doc, Mapping):
        return prompt
    asked = [v for k in PREDICT_FIELDS if isinstance(v := doc.get(k), int)
             and not isinstance(v, bool) and v > 0]
    most = min(asked) if asked else (max_predict or context or 0)
    if max_predict:
        most = min(most, max_predict)
    choices = next((v for k in CHOICE_FIELDS if isinstance(v := doc.get(k), int)
                    and not isinstance(v, bool) and v > 1), 1)
    return prompt + most * choices


# --------------------------------------------------------------------------- a cut's prompt

async def count_prompt(client: httpx.AsyncClient, base_url: str, api_key: str, route: str,
                       doc: object, timeout: float) -> int | None:
    """The prompt's tokens as llama-server's tokenizer counts them, for a request cut before
    its answer said; None where the route's prompt cannot be asked about or llama-server does
    not answer."""
    if not isinstance(doc, Mapping):
        return None
    # rare (cuts only): each connection closed after its answer, none kept in the pool
    headers = {"authorization": f"Bearer {api_key}", "connection": "close"}

    async def ask(path: str, body: Mapping[str, Any]) -> Any:
        r = await client.post(base_url + path, content=json.dumps(body), headers=headers,
                              timeout=timeout)
        return r.json() if r.status_code == 200 else None

    try:
        if route in MESSAGES:
            got = await ask("/v1/messages/count_tokens", doc)
            return _int(got.get("input_tokens")) if isinstance(got, dict) else None
        if route in ("/v1/chat/completions", "/chat/completions"):
            applied = await ask("/apply-template", doc)
            prompt = applied.get("prompt") if isinstance(applied, dict) else None
            return await _tokenized(ask, prompt) if isinstance(prompt, str) else None
        if route in ("/v1/completions", "/completions", "/completion"):
            return await _tokenized(ask, doc.get("prompt"))
    except (httpx.HTTPError, ValueError):
        return None
    return None


async def _tokenized(ask: Any, prompt: object) -> int | None:
    """A prompt's tokens: a string tokenized, token ids counted, a batch of either summed."""
    if isinstance(prompt, str):
        got = await ask("/tokenize", {"content": prompt, "add_special": True,
                                      "parse_special": True})
        tokens = got.get("tokens") if isinstance(got, dict) else None
        return len(tokens) if isinstance(tokens, list) else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        parts = [await _tokenized(ask, p) for p in prompt]
        return None if any(p is None for p in parts) else sum(p or 0 for p in parts)
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
