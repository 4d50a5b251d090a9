"""The campaign's oracle: is an answer one the front promises (docs/reliability.md)?

- A client's mistake is a 4xx with an error object that has a message, from either layer.
- The front itself answers 5xx only with 502/503/504, and 503 always with `Retry-After`.
- A relayed 5xx other than 501 (a feature this launch does not serve) is a failure: either the
  front should have refused the request, or llama-server is at fault for a valid one.
- No answer carries a Python traceback or a C++ exception's text left unparsed.

`verdict` names the failure's class (stable across cases, so that failures group) or None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mtpwrap.front.replies import error_message

ANSWERED_BY = "x-mtpwrap-answered-by"
#: front-made 5xx allowed in a campaign without injected faults (503: busy or not ready)
FRONT_5XX_WITHOUT_FAULTS = frozenset({503})
FRONT_5XX_WITH_FAULTS = frozenset({502, 503, 504})


def normalise(message: str) -> str:
    """A message with its numbers, quoted values and positions taken out, to group by."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", message)
    text = re.sub(r"\d+", "N", text)
    return text[:90]


def verdict(route: str, status: int, headers: Mapping[str, str], body: bytes,
            faults: bool = False) -> str | None:
    """The failure class of one answer, or None when it keeps the promises."""
    by = headers.get(ANSWERED_BY, "")
    if by not in ("front", "llama-server"):
        return f"unmarked {status}"
    if b"Traceback (most recent call last)" in body:
        return f"traceback in a {status} from the {by}"
    if status < 400:
        return None
    message = error_message(body)
    if status < 500:
        if message is None and not body.startswith(b"data:"):
            return f"{status} from the {by} without an error message"
        return None
    if by == "front":
        allowed = FRONT_5XX_WITH_FAULTS if faults else FRONT_5XX_WITHOUT_FAULTS
        if status not in allowed:
            return f"front {status}: {normalise(message or '')}"
        if status == 503 and "retry-after" not in headers:
            return "front 503 without Retry-After"
        return None
    if status == 501:
        return None
    return f"relayed {status} on {route}: {normalise(message or body[:60].decode('latin-1'))}"
