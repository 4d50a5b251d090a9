"""What a request body may hold: JSON llama-server can parse safely, and fields within limits.

Pure functions, no I/O, tested with tables.
"""

from __future__ import annotations

import json
import math
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


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, or BadBody with one sentence: never another exception."""
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except BadBody:
        raise
    except UnicodeDecodeError as err:
        raise BadBody("The request body is not valid UTF-8 JSON.") from err
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
    _check_depth(doc)
    return doc


def _check_depth(doc: Any) -> None:
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadBody(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep.")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


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
    _check_range(doc, PREDICT_FIELDS, -1, max_predict or None, "tokens to generate")
    _check_range(doc, ("id_slot", "slot_id"), -1, None, "-1 is any slot")
    _check_range(doc, ("n_keep",), -1, None, "-1 keeps the whole prompt")
