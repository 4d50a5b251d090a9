"""What the HTTP front lets through: its settings, the path allow-list, key checks, body guards.

Pure functions and data, no I/O and no ASGI imports, so they are tested with tables.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtpwrap.config.apikeys import KeyTable
from mtpwrap.config.objects import ProxyConfig

MiB = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# The allow-list. Every llama-server route the front forwards is named here; anything else is
# 404 without reaching the child. Routes with side effects on the server, or that leak other
# users' data, carry a feature name and stay 403 until `proxy.enable_paths` lists that name.
# ---------------------------------------------------------------------------------------------

#: (method, path) -> feature name ("" = always on)
_EXACT: dict[tuple[str, str], str] = {}


def _add(method: str, feature: str, *paths: str) -> None:
    for p in paths:
        _EXACT[(method, p)] = feature


_add("GET", "", "/health", "/v1/health", "/props", "/models", "/v1/models")
_add(
    "POST", "",
    "/completion", "/completions", "/v1/completions",
    "/chat/completions", "/v1/chat/completions",
    "/responses", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens",
    "/infill",
    "/embedding", "/embeddings", "/v1/embeddings",
    "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
    "/tokenize", "/detokenize", "/apply-template",
    "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
    "/responses/input_tokens", "/v1/responses/input_tokens",
    "/audio/transcriptions", "/v1/audio/transcriptions",
)
# /slots lists every slot with its prompt: it shows one client what another one asked.
_add("GET", "slots", "/slots")
_add("POST", "props-write", "/props")
_add("GET", "lora-adapters", "/lora-adapters")
_add("POST", "lora-adapters", "/lora-adapters")
# The child's own Prometheus page; mtpwrap's /metrics re-exports it under mtpwrap_backend_.
_add("GET", "backend-metrics", "/backend/metrics")
_add("GET", "webui", "/", "/index.html")
_add("POST", "control", "/v1/chat/completions/control")
_add("GET", "resumable-streams", "/v1/stream")
_add("DELETE", "resumable-streams", "/v1/stream")
_add("POST", "resumable-streams", "/v1/streams/lookup")

#: POST /slots/<id>?action=save|restore|erase reads and writes files on the server
#: (CVE-2026-43629).
_SLOT_ACTION = re.compile(r"^/slots/[0-9]{1,4}$")

#: where a gated path is forwarded to, when it differs from the path the client used
UPSTREAM_PATH = {"/backend/metrics": "/metrics"}

# Only plain ASCII path characters; percent-encoding, backslashes, dot segments and empty
# segments never reach the lookup, so `/v1/%2e%2e/slots`, `//slots` and `/v1/../slots` all fail.
_SAFE_PATH = re.compile(r"^(/[A-Za-z0-9_\-]+(\.[A-Za-z0-9]+)?)*/?$")


#: Routes whose request takes one of llama-server's slots (a generation, an embedding, ...):
#: only these count against the slots; the rest (tokenize, props, models, ...) llama-server
#: answers from its HTTP threads without a slot.
SLOT_PATHS = frozenset({
    "/completion", "/completions", "/v1/completions",
    "/chat/completions", "/v1/chat/completions", "/responses", "/v1/responses", "/v1/messages",
    "/infill", "/embedding", "/embeddings", "/v1/embeddings",
    "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
    "/audio/transcriptions", "/v1/audio/transcriptions",
})
#: POST routes whose body llama-server reads as a multipart form, not as JSON.
FORM_PATHS = frozenset({"/audio/transcriptions", "/v1/audio/transcriptions"})


@dataclass(frozen=True)
class Route:
    """The verdict on one request line."""

    status: int          # 0 = forward; otherwise the status to answer with
    label: str           # metrics label: the route pattern, or "other" (bounded cardinality)
    upstream_path: str = ""
    message: str = ""
    slot: bool = False   # the request occupies one of llama-server's slots
    json_body: bool = False  # llama-server parses the body as JSON, whatever its Content-Type


def _feature(method: str, path: str) -> tuple[str | None, str]:
    """The allow-list's feature for a request line ("" = always on, None = not listed) and
    its metrics label."""
    if method == "HEAD":
        method = "GET"
    feature = _EXACT.get((method, path))
    if feature is None and method == "POST" and _SLOT_ACTION.match(path):
        return "slot-actions", "/slots/{id}"
    return feature, path


def classify(method: str, raw_path: bytes, enabled: frozenset[str]) -> Route:
    try:
        path = raw_path.decode("ascii")
    except UnicodeDecodeError:
        return Route(400, "other", message="The request path is not plain ASCII.")
    if not _SAFE_PATH.match(path) or "/." in path:
        return Route(404, "other", message="Not found.")
    if method == "HEAD":
        method = "GET"
    feature, label = _feature(method, path)
    if feature is None:
        known = any(p == path for (_m, p) in _EXACT)
        if known:
            return Route(405, label, message=f"Method {method} is not allowed on {path}.")
        return Route(404, "other", message="Not found.")
    if feature and feature not in enabled:
        return Route(
            403, label,
            message=(f"{path} is disabled on this server; the operator can enable it with "
                     f"proxy.enable_paths: [{feature}]."),
        )
    return Route(0, label, UPSTREAM_PATH.get(path, path), slot=path in SLOT_PATHS,
                 json_body=method == "POST" and path not in FORM_PATHS)


# ---------------------------------------------------------------------------------------------
# Keys and their scopes
# ---------------------------------------------------------------------------------------------

#: The scope a request needs, by allow-list feature ("" = the model APIs) ...
FEATURE_SCOPES: dict[str, str] = {
    "": "inference", "webui": "inference", "control": "inference",
    "resumable-streams": "inference", "slots": "admin", "slot-actions": "admin",
    "props-write": "admin", "lora-adapters": "admin", "backend-metrics": "metrics",
}
#: ... and for the front's own pages (/livez and /readyz need no key at all).
OPS_SCOPES = {"/metrics": "metrics", "/healthz": "metrics"}



def required_scope(method: str, path: str) -> str:
    """The scope a key needs for this request line; paths the allow-list does not know need
    `inference` (they are 404 anyway)."""
    if path in OPS_SCOPES:
        return OPS_SCOPES[path]
    feature, _label = _feature(method, path)
    return FEATURE_SCOPES[feature or ""]


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client sent as `Authorization: Bearer K` or `X-Api-Key: K` (nothing else)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() if key else None


def key_scopes(presented: str | None, keys: KeyTable) -> frozenset[str] | None:
    """The scopes of the presented key; None when it is no configured key. Constant-time:
    every configured key is compared (no early exit on a match)."""
    if presented is None:
        return None
    given = presented.encode("utf-8", "surrogateescape")
    found: frozenset[str] | None = None
    for k, scopes in keys:
        if hmac.compare_digest(given, k):
            found = scopes
    return found


# ---------------------------------------------------------------------------------------------
# Bodies
# ---------------------------------------------------------------------------------------------

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


def error_body(status: int, message: str, kind: str, path: str) -> bytes:
    """An error in the shape of the API the client called: Anthropic's for /v1/messages,
    else OpenAI's, which llama-server's native endpoints share."""
    if path.startswith("/v1/messages"):
        return json.dumps({"type": "error", "error": {"type": kind, "message": message}}
                          ).encode()
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


# ---------------------------------------------------------------------------------------------
# Hosts
# ---------------------------------------------------------------------------------------------

def derive_allowed_hosts(cfg: ProxyConfig) -> frozenset[str] | None:
    """Host names (without port) the front answers to; None = any (only when told "*")."""
    if "*" in cfg.allowed_hosts:
        return None
    hosts = {h.lower().strip("[]") for h in cfg.allowed_hosts}
    if cfg.allowed_hosts:
        return frozenset(hosts)
    hosts |= {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    listen = cfg.listen_host.strip("[]").lower()
    if listen in ("0.0.0.0", "::", ""):
        # Wildcard bind: every address of this machine and its names; anything else (a DNS
        # rebinding name, a typo) is refused.
        hosts |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        try:
            import psutil

            for addrs in psutil.net_if_addrs().values():
                for a in addrs:
                    if a.family in (socket.AF_INET, socket.AF_INET6):
                        hosts.add(a.address.split("%")[0].lower())
        except Exception:
            pass
    else:
        hosts.add(listen)
    return frozenset(hosts)


def host_of(header: str) -> str:
    """`Host` header value without its port, lower case, IPv6 brackets removed."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    if h.count(":") == 1:
        return h.rsplit(":", 1)[0]
    return h
