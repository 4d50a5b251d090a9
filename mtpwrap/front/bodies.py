"""What a request body may hold: JSON llama-server can parse safely, and fields within limits.

Pure functions, no I/O, tested with tables.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any


class BadBody(Exception):
    """A request body the front refuses (400), with a message for the client."""


#: JSON nested deeper than this is refused: no request llama-server understands comes close,
#: and a parser that recurses (Python's does) must never meet thousands of levels.
MAX_JSON_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise BadBody(f"The request body contains {name}, which is not a JSON number; send a "
                  "finite number.")


def _float(text: str) -> float:
    # llama-server's JSON parser (nlohmann) fails on a number beyond a double's range ("number
    # overflow"), where Python's reads an infinity or a huge integer.
    v = float(text)
    if not math.isfinite(v):
        raise BadBody(f"The request body has the number {text[:24]}, which is beyond the range "
                      "of a 64-bit float; send a finite number.")
    return v


def _int(text: str) -> int:
    # Python reads up to 4300 digits; nlohmann reads past uint64 as a double, so the limit is
    # the double's range (309 digits), checked on the length before any conversion.
    if len(text.lstrip("-")) > 308:
        raise BadBody(f"The request body has an integer of {len(text.lstrip('-'))} digits, "
                      "beyond the range of a 64-bit float.")
    return int(text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for k, _v in pairs:
            if k in seen:
                raise BadBody(f"The request body has the key {json.dumps(k)[:60]} twice in one "
                              "object; send each key once.")
            seen.add(k)
    return doc


#: a JSON escape of a UTF-16 surrogate: the only way a lone one gets into Python's strings
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, or BadBody with one sentence: never another exception.

    Stricter than `json.loads` where llama-server's parser is: UTF-8 only (Python also reads
    UTF-16 and UTF-32), no NaN or infinity and no number beyond a double's range, no lone
    surrogate in a string, and no key twice in one object (the front's checks and llama-server
    must read the same value)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadBody(f"The request body is not valid UTF-8 (byte {err.start}).") from err
    try:
        doc = json.loads(text.removeprefix("\ufeff"), parse_constant=_no_constant,
                         parse_float=_float, parse_int=_int, object_pairs_hook=_no_duplicates)
    except BadBody:
        raise
    except json.JSONDecodeError as err:
        raise BadBody(
            f"The request body is not valid JSON: {err.msg} "
            f"at line {err.lineno} column {err.colno}."
        ) from err
    except RecursionError as err:
        raise BadBody(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep.") \
            from err
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise BadBody(f"The request body has a number that cannot be read: {err}.") from err
    _check_depth(doc, _SURROGATE_ESCAPE.search(body) is not None)
    return doc


def require_object(doc: Any, empty: bool) -> None:
    """Refuse a body that is not a JSON object (`empty`: no body at all) where llama-server
    reads one: it answers such a body with a 500."""
    if empty:
        raise BadBody("This route needs a JSON object as the request body; the body is empty.")
    if not isinstance(doc, dict):
        raise BadBody(f"The request body must be a JSON object, got a JSON "
                      f"{_json_type(doc)}.")


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, dict):
        return "object"
    return "string" if isinstance(v, str) else "array"


def _check_depth(doc: Any, surrogates: bool) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and (when `surrogates`: the body has a
    surrogate escape) a string or key holding a lone surrogate, which is not Unicode."""
    if surrogates and isinstance(doc, str):
        _unicode((doc,))
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadBody(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep.")
        if isinstance(node, dict):
            if surrogates:
                _unicode(node.keys())
                _unicode(v for v in node.values() if isinstance(v, str))
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            if surrogates:
                _unicode(v for v in node if isinstance(v, str))
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _unicode(strings: Any) -> None:
    for s in strings:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadBody(f"The request body has a string with a lone UTF-16 surrogate "
                          f"(\\u{ord(s[err.start]):04x}), which is not text; escape whole "
                          "characters only.") from err


def _number(doc: Mapping[str, Any], key: str) -> float | None:
    """A numeric field as llama-server would read it; None when absent or not a number
    (llama-server then uses its default). Non-finite values are refused here."""
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        raise BadBody(f"{key} must be a finite number, got {v}.")
    return v


def _check_range(doc: Mapping[str, Any], keys: tuple[str, ...], low: int, high: int | None,
                 what: str) -> None:
    for key in keys:
        v = _number(doc, key)
        if v is None:
            continue
        if v < low or (high is not None and v > high):
            bound = f"{low}..{high}" if high is not None else f"{low} or more"
            raise BadBody(f"{key} must be {bound} ({what}), got {_short(v)}.")


def _short(v: float) -> str:
    text = str(v)
    return text if len(text) <= 24 else text[:20] + "…"


#: Every spelling of the fields that size a response, by what they size.
PROBS_FIELDS = ("n_probs", "top_logprobs")
CHOICE_FIELDS = ("n", "n_cmpl")
PREDICT_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")


def check_fields(doc: Any, max_n_probs: int, max_choices: int = 1, max_predict: int = 0
                 ) -> None:
    """Refuse fields with values that have crashed, corrupted or flooded llama-server.

    negative `n_discard` (out-of-bounds write); huge `n_probs`/`top_logprobs`/integer
    `logprobs` (the legacy completions spelling) — a 75 MB answer for 16 tokens; more choices
    than allowed (`n`, `n_cmpl`); more tokens than allowed under any of their names; slot ids
    below -1 (out-of-range index); `n_keep` below -1; NaN and infinities anywhere among these.
    """
    if not isinstance(doc, dict):
        return
    _check_range(doc, ("n_discard",), 0, None, "tokens to discard")
    _check_range(doc, PROBS_FIELDS, 0, max_n_probs, "top tokens per position")
    lp = doc.get("logprobs")
    if not isinstance(lp, bool):
        _check_range(doc, ("logprobs",), 0, max_n_probs, "top tokens per position")
    _check_range(doc, CHOICE_FIELDS, 1, max_choices, "choices per request")
    # -1 is llama-server's "until the context is full": not within a cap
    _check_range(doc, PREDICT_FIELDS, 0 if max_predict else -1, max_predict or None,
                 "tokens to generate")
    _check_range(doc, ("id_slot", "slot_id"), -1, None, "-1 is any slot")
    _check_range(doc, ("n_keep",), -1, None, "-1 keeps the whole prompt")


#: Fields that hold prompts llama-server reads as token ids where they are integers.
TOKEN_FIELDS = ("prompt", "tokens", "input", "content", "input_extra", "input_prefix",
                "input_suffix")


def check_tokens(doc: Any, n_vocab: int | None) -> None:
    """Refuse token ids outside the model's vocabulary, wherever llama-server accepts them:
    token prompts (and batches of them), `/detokenize`'s `tokens`, `logit_bias` keys. Past the
    vocabulary llama-server indexes out of range (a 500, or the end of the process)."""
    if not isinstance(doc, dict) or not n_vocab:
        return
    for key in TOKEN_FIELDS:
        if key in doc:
            _token_ids(doc[key], key, n_vocab, 0)
    bias = doc.get("logit_bias")
    if isinstance(bias, dict):
        for k in bias:
            if k.lstrip("-").isdigit() and _out_of(int(k), n_vocab):
                raise BadBody(_beyond("logit_bias", int(k), n_vocab))
    elif isinstance(bias, list):
        for pair in bias:
            if isinstance(pair, list) and pair and _is_int(pair[0]) \
                    and _out_of(pair[0], n_vocab):
                raise BadBody(_beyond("logit_bias", pair[0], n_vocab))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _out_of(v: int, n_vocab: int) -> bool:
    return v < 0 or v >= n_vocab


def _beyond(key: str, v: int, n_vocab: int) -> str:
    return (f"{key} has the token id {_short(v)}, outside this model's vocabulary "
            f"(0..{n_vocab - 1}).")


def _token_ids(v: Any, key: str, n_vocab: int, depth: int) -> None:
    if _is_int(v):
        if _out_of(v, n_vocab):
            raise BadBody(_beyond(key, v, n_vocab))
    elif isinstance(v, list) and depth < 3:
        for x in v:
            _token_ids(x, key, n_vocab, depth + 1)
    elif isinstance(v, dict) and depth < 3:  # {"prompt_string": ..., "multimodal_data": ...}
        for x in v.values():
            if isinstance(x, list):
                _token_ids(x, key, n_vocab, depth + 1)


#: Grammar groups nested deeper than this are refused: llama.cpp's grammar parser recurses once
#: per group, and tens of thousands exhaust its stack (a SIGSEGV).
MAX_GRAMMAR_NESTING = 256


def check_grammar(doc: Any) -> None:
    """Refuse a GBNF `grammar` nested deeper than MAX_GRAMMAR_NESTING groups (counted outside
    string literals, character classes and comments)."""
    if not isinstance(doc, dict):
        return
    g = doc.get("grammar")
    if not isinstance(g, str) or g.count("(") <= MAX_GRAMMAR_NESTING:
        return
    depth = deepest = 0
    i, n = 0, len(g)
    while i < n:
        c = g[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and g[i] != close:
                i += 2 if g[i] == "\\" else 1
        elif c == "#":
            while i < n and g[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise BadBody(f"grammar nests {deepest} groups deep; at most {MAX_GRAMMAR_NESTING} are "
                      "accepted.")


def check_messages(doc: Any) -> None:
    """The shape of a chat's `messages` (OpenAI's and Anthropic's routes alike): an array of
    objects, each `role` a string, each `content` a string, null or an array of parts that are
    objects with a string `type`. llama-server answers another shape with a 500."""
    if not isinstance(doc, dict) or "messages" not in doc:
        return
    msgs = doc["messages"]
    if not isinstance(msgs, list):
        raise BadBody(f"messages must be an array of message objects, got a JSON "
                      f"{_json_type(msgs)}.")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadBody(f"messages[{i}] must be an object, got a JSON {_json_type(m)}.")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadBody(f"messages[{i}].role must be a string, got "
                          f"{'nothing' if 'role' not in m else 'a JSON ' + _json_type(role)}.")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadBody(f"messages[{i}].content must be a string or an array of parts, got a "
                          f"JSON {_json_type(content)}.")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadBody(f"messages[{i}].content[{j}] must be an object with a string "
                              "type.")


#: llama.cpp's reasoning formats (common_reasoning_format_from_name): another name is a 500
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def check_reasoning_format(doc: Any) -> None:
    """`reasoning_format`, where given, is one of llama.cpp's names: it throws a plain runtime
    error (a 500) for another string, and a type error for anything but a string."""
    if not isinstance(doc, dict) or "reasoning_format" not in doc:
        return
    value = doc["reasoning_format"]
    if value not in REASONING_FORMATS:
        got = (json.dumps(value, ensure_ascii=False)[:40] if isinstance(value, str)
               else f"a JSON {_json_type(value)}")
        raise BadBody(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                      f"{got}.")


def check_tools(doc: Any) -> None:
    """OpenAI's `tools` and each message's `tool_calls` as llama-server reads them: arrays of
    objects of type "function", the only tool type it has (another shape or type is a 500
    there). Anthropic's tools, which have no type, are converted by llama-server itself: this
    is for the OpenAI-shaped routes."""
    if not isinstance(doc, dict):
        return
    if doc.get("tools") is not None:
        _functions(doc["tools"], "tools")
    msgs = doc.get("messages")
    for i, m in enumerate(msgs if isinstance(msgs, list) else ()):
        if isinstance(m, dict) and m.get("tool_calls") is not None:
            _functions(m["tool_calls"], f"messages[{i}].tool_calls")


def _functions(value: Any, where: str) -> None:
    if not isinstance(value, list):
        raise BadBody(f"{where} must be an array, got a JSON {_json_type(value)}.")
    for j, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadBody(f"{where}[{j}] must be an object, got a JSON {_json_type(item)}.")
        kind = item.get("type")
        if kind != "function":
            got = "nothing" if "type" not in item else json.dumps(kind)[:40]
            raise BadBody(f'{where}[{j}].type must be "function" (the only tool type '
                          f"llama-server has), got {got}.")

