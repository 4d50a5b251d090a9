"""What the campaign sends: request bodies generated with hypothesis, one route at a time.

A case is a route and a body. Most bodies start from a small valid request for the route and
change one thing in it — a field's value replaced by any JSON value, a field llama-server reads
added with a wrong type, a message or content part reshaped, token ids from outside the
vocabulary — so that each case is one mistake a client can make; the rest are whole bodies of
any JSON value, not-JSON bytes or nothing at all. Generations always ask for a handful of tokens
(unless the mistake is in that very field), so that thousands of cases fit in minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

#: one user turn, in the OpenAI shape (Anthropic's is the same for plain text)
_TURN = [{"role": "user", "content": "Hi"}]

#: route -> a small valid body for it
BASE: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": "Hi", "n_predict": 4},
    "/completions": {"prompt": "Hi", "n_predict": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/chat/completions": {"messages": _TURN, "max_tokens": 4},
    "/v1/chat/completions": {"messages": _TURN, "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": _TURN},
    "/v1/messages/count_tokens": {"model": "m", "messages": _TURN},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    "/v1/chat/completions/input_tokens": {"messages": _TURN},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4},
    "/tokenize": {"content": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": _TURN},
}
ROUTES = tuple(BASE)

#: fields llama-server reads on some route, tried with wrong types and odd values
FIELDS = (
    "prompt", "messages", "content", "tokens", "input", "system", "model", "stream",
    "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
    "logit_bias", "n_probs", "logprobs", "top_logprobs", "grammar", "json_schema",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "documents", "add_special", "with_pieces", "parse_special", "n_keep", "n_discard",
    "cache_prompt", "samplers", "dry_multiplier", "dry_sequence_breakers", "mirostat",
    "repeat_penalty", "presence_penalty", "typical_p", "lora", "id_slot", "return_tokens",
    "post_sampling_probs", "reasoning_format", "chat_template", "add_generation_prompt",
    "input_extra", "input_prefix", "input_suffix", "stream_options", "thinking", "metadata",
    "t_max_predict_ms", "n_indent", "ignore_eos", "timings_per_token", "return_progress",
    "reasoning_budget", "speculative.n_max", "speculative.n_min", "speculative.p_min",
)
#: fields that say how many tokens to generate: left as the base sets them unless mutated
PREDICT = ("n_predict", "max_tokens", "max_output_tokens", "max_completion_tokens")
#: content part types of the OpenAI and Anthropic APIs
PART_TYPES = ("text", "image_url", "input_audio", "file", "image", "document", "tool_use",
              "tool_result", "thinking", "refusal", "input_text", "x")
ROLES = ("user", "assistant", "system", "tool", "developer", "function", "")

_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=12))
#: any JSON value, a few levels deep
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS + ("type", "text", "role", "url")) | st.text(
        max_size=6), inner, max_size=4),
    max_leaves=12)
#: token ids: in the vocabulary, at its edges, and far outside it
token_ids = st.one_of(st.integers(0, 2000), st.integers(-2**31, -1),
                      st.integers(40_000, 2**31), st.sampled_from([-1, 0, 2**32, 2**63 - 1]))


@dataclass(frozen=True)
class Case:
    route: str
    body: bytes
    what: str  # what was changed, for the report

    def as_seed(self) -> dict[str, Any]:
        try:
            return {"route": self.route, "body": json.loads(self.body), "what": self.what}
        except ValueError:
            return {"route": self.route, "body_text": self.body.decode("utf-8", "replace"),
                    "what": self.what}


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def _parts(draw: st.DrawFn) -> Any:
    def part() -> Any:
        p: dict[str, Any] = {"type": draw(st.sampled_from(PART_TYPES))}
        for key in draw(st.lists(st.sampled_from(("text", "image_url", "source", "url",
                                                  "data", "input_audio", "content", "id",
                                                  "name", "input")), max_size=3)):
            p[key] = draw(json_values)
        return p
    return [part() for _ in range(draw(st.integers(0, 3)))]


@st.composite
def _message(draw: st.DrawFn) -> Any:
    msg: dict[str, Any] = {"role": draw(st.sampled_from(ROLES) | json_values)}
    content = draw(st.one_of(st.text(max_size=20), _parts(), json_values))
    if draw(st.booleans()):
        msg["content"] = content
    for key in draw(st.lists(st.sampled_from(("name", "tool_calls", "tool_call_id",
                                              "reasoning_content", "x")), max_size=2)):
        msg[key] = draw(json_values)
    return msg


@st.composite
def cases(draw: st.DrawFn, routes: tuple[str, ...] = ROUTES) -> Case:
    route = draw(st.sampled_from(routes))
    base = json.loads(json.dumps(BASE[route]))
    kind = draw(st.sampled_from(("replace", "add", "add", "messages", "tokens", "drop",
                                 "whole", "bytes")))
    if kind == "replace":
        key = draw(st.sampled_from(sorted(base)))
        base[key] = draw(json_values)
        return Case(route, _dumps(base), f"{key} replaced")
    if kind == "add":
        key = draw(st.sampled_from(FIELDS))
        base[key] = draw(json_values)
        return Case(route, _dumps(base), f"{key} added")
    if kind == "messages":
        base["messages"] = draw(st.lists(_message(), max_size=3))
        return Case(route, _dumps(base), "messages reshaped")
    if kind == "tokens":
        ids = draw(st.lists(token_ids, min_size=1, max_size=6))
        key = draw(st.sampled_from(("tokens", "prompt", "content", "logit_bias", "input")))
        if key == "logit_bias":
            base[key] = draw(st.sampled_from((
                {str(i): 1.0 for i in ids}, [[i, 1.0] for i in ids])))
        elif key == "prompt" and draw(st.booleans()):
            base[key] = [ids, "x"]  # a batch of prompts, one of them tokens
        else:
            base[key] = ids
        return Case(route, _dumps(base), f"{key} with token ids")
    if kind == "drop":
        key = draw(st.sampled_from(sorted(base)))
        del base[key]
        return Case(route, _dumps(base), f"{key} dropped")
    if kind == "whole":
        return Case(route, _dumps(draw(json_values)), "whole body any JSON")
    raw = draw(st.sampled_from((b"", b"x", b"{", b"[]", b"null", b"\"\\ud800\"",
                                b"{\"a\":1,\"a\":2}", b"\xff\xfe{}", b"1e400", b"{\"prompt\"")))
    return Case(route, raw, "raw bytes")
