"""Request classes for speculation: what kind of text a request will most likely produce,
decided from the request body alone, without tokenising.

Draft acceptance depends on the text: code and structured output are predictable, prose less so,
and how much less depends on the language. The classes, checked in this order:

- `structured`: the request asks for JSON (`response_format` json_object/json_schema, a
  `json_schema` or `grammar` field) or offers tools (`tools`, `functions`, `tool_choice`);
- `code`: the prompt has a code fence (```) or many code symbols ({}();=<>[] and friends make
  up more than 6 % of its non-space characters, over at least 40 of them);
- `ko-prose`, `ja-prose`, `zh-prose`, `en-prose`: prose by its script: Hangul, Kana (with or
  without Han), Han alone, Latin — whichever holds at least 60 % of the letters (Kana needs 15 %,
  since Japanese mixes it with Han);
- `other`: anything else (mixed scripts, no text, another script).

Only the first SAMPLE_CHARS characters of the request's text are looked at, so the cost is
bounded whatever the prompt's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CLASSES = ("structured", "code", "ko-prose", "ja-prose", "zh-prose", "en-prose", "other")
SAMPLE_CHARS = 4000
CODE_SYMBOLS = frozenset("{}()[];=<>|&*/\\$#_`:")
CODE_SYMBOL_SHARE = 0.06
CODE_MIN_CHARS = 40
SCRIPT_SHARE = 0.60
KANA_SHARE = 0.15


@dataclass(frozen=True)
class Shares:
    """Script shares of the letters in a text sample, and its code-symbol density."""

    hangul: float
    han: float
    kana: float
    latin: float
    other: float
    letters: int
    symbol_density: float
    fenced: bool


def _script(ch: str) -> str | None:
    o = ord(ch)
    if 0xAC00 <= o <= 0xD7A3 or 0x1100 <= o <= 0x11FF or 0x3130 <= o <= 0x318F:
        return "hangul"
    if 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0xF900 <= o <= 0xFAFF:
        return "han"
    if 0x3040 <= o <= 0x30FF or 0x31F0 <= o <= 0x31FF or 0xFF66 <= o <= 0xFF9F:
        return "kana"
    if ch.isascii():
        return "latin" if ch.isalpha() else None
    if ch.isalpha():
        return "latin" if 0x00C0 <= o <= 0x024F else "other"
    return None


def shares(text: str) -> Shares:
    sample = text[:SAMPLE_CHARS]
    counts = {"hangul": 0, "han": 0, "kana": 0, "latin": 0, "other": 0}
    symbols = visible = 0
    for ch in sample:
        if ch.isspace():
            continue
        visible += 1
        if ch in CODE_SYMBOLS:
            symbols += 1
            continue
        script = _script(ch)
        if script is not None:
            counts[script] += 1
    letters = sum(counts.values())
    total = letters or 1
    return Shares(counts["hangul"] / total, counts["han"] / total, counts["kana"] / total,
                  counts["latin"] / total, counts["other"] / total, letters,
                  symbols / visible if visible else 0.0, "```" in sample)


def classify_text(text: str) -> str:
    """The class of a text by its content alone (never `structured`)."""
    s = shares(text)
    if s.fenced or (s.symbol_density > CODE_SYMBOL_SHARE and s.letters >= CODE_MIN_CHARS):
        return "code"
    if not s.letters:
        return "other"
    if s.hangul >= SCRIPT_SHARE:
        return "ko-prose"
    if s.kana >= KANA_SHARE and s.kana + s.han >= SCRIPT_SHARE:
        return "ja-prose"
    if s.han >= SCRIPT_SHARE:
        return "zh-prose"
    if s.latin >= SCRIPT_SHARE:
        return "en-prose"
    return "other"


def _texts(value: Any, budget: list[int]) -> Iterator[str]:
    """The text parts of a prompt, messages or content value, until the budget is spent."""
    if budget[0] <= 0:
        return
    if isinstance(value, str):
        budget[0] -= len(value)
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item, budget)
    elif isinstance(value, dict):
        for key in ("content", "text", "input", "prompt", "system"):
            if key in value:
                yield from _texts(value[key], budget)


def wants_structure(doc: dict[str, Any]) -> bool:
    fmt = doc.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return True
    if doc.get("json_schema") or doc.get("grammar"):
        return True
    return bool(doc.get("tools") or doc.get("functions") or doc.get("tool_choice"))


def classify(doc: Any) -> str:
    """The class of a parsed request body (/completion, /v1/completions, /v1/chat/completions,
    /v1/messages, /v1/responses)."""
    if not isinstance(doc, dict):
        return "other"
    if wants_structure(doc):
        return "structured"
    budget = [SAMPLE_CHARS]
    parts: list[str] = []
    for key in ("system", "messages", "prompt", "input", "content"):
        if key in doc:
            parts.extend(_texts(doc[key], budget))
    return classify_text("\n".join(parts))
