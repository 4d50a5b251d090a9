"""What the HTTP front lets through: its settings, the path allow-list, key checks, body guards.

Pure functions and data, no I/O and no ASGI imports, so they are tested with tables.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError
from mtpwrap.settings import Key, convert

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

FEATURES: tuple[str, ...] = (
    "slots", "slot-actions", "props-write", "lora-adapters", "backend-metrics", "webui",
    "control", "resumable-streams",
)

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


def _key_for(default: Any) -> Key:
    """How a `proxy:` key is read, from its default's type."""
    if isinstance(default, tuple):
        return Key("list", default)
    if isinstance(default, bool):
        return Key("bool", default)
    if isinstance(default, int):
        return Key("int", default)
    if isinstance(default, float):
        return Key("float", default)
    return Key("str", default)


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

#: What a key may do: `inference` the model APIs, `admin` what changes the server or shows
#: other users' data (slots, POST /props, LoRA adapters), `metrics` /metrics and /healthz.
#: A key listed without scopes has all of them.
SCOPES = ("inference", "admin", "metrics")

#: The scope a request needs, by allow-list feature ("" = the model APIs) ...
FEATURE_SCOPES: dict[str, str] = {
    "": "inference", "webui": "inference", "control": "inference",
    "resumable-streams": "inference", "slots": "admin", "slot-actions": "admin",
    "props-write": "admin", "lora-adapters": "admin", "backend-metrics": "metrics",
}
#: ... and for the front's own pages (/livez and /readyz need no key at all).
OPS_SCOPES = {"/metrics": "metrics", "/healthz": "metrics"}

KeyTable = tuple[tuple[bytes, frozenset[str]], ...]


def required_scope(method: str, path: str) -> str:
    """The scope a key needs for this request line; paths the allow-list does not know need
    `inference` (they are 404 anyway)."""
    if path in OPS_SCOPES:
        return OPS_SCOPES[path]
    feature, _label = _feature(method, path)
    return FEATURE_SCOPES[feature or ""]


def parse_key(entry: str, where: str) -> tuple[str, frozenset[str]]:
    """One key as written in a key file: `KEY` or `KEY SCOPE[,SCOPE...]`. The message of a
    bad entry never repeats the key."""
    secret, *rest = entry.split(None, 1) or [""]
    if not rest:
        return secret, frozenset(SCOPES)
    scopes = rest[0].replace(",", " ").split()
    for x in scopes:
        if x not in SCOPES:
            raise ConfigError(f"{where}: unknown scope {x!r}; known scopes: "
                              f"{', '.join(SCOPES)} (a key without scopes has them all)")
    return secret, frozenset(scopes)


def key_table(entries: tuple[str, ...], where: str) -> KeyTable:
    """Key entries → (key bytes, scopes) for `key_scopes`; the same key twice is refused."""
    table: dict[str, frozenset[str]] = {}
    for entry in entries:
        secret, scopes = parse_key(entry, where)
        if table.get(secret, scopes) != scopes:
            raise ConfigError(f"{where}: one key is listed twice with different scopes; "
                              "list each key once")
        table[secret] = scopes
    return tuple((k.encode("utf-8", "surrogateescape"), v) for k, v in table.items())


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
# Settings
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProxyConfig:
    """Settings of the HTTP front (config file section `proxy:`).

    Which ops endpoints are open: `/livez` and `/readyz` never need a key (probes from systemd,
    Kubernetes or a load balancer carry none, and they reveal only up/ready and a reason);
    `/healthz` and `/metrics` need one when keys are configured, unless `healthz_public` /
    `metrics_public` say otherwise.
    """

    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    listen_host: str = "127.0.0.1"
    max_body_bytes: int = 8 * MiB
    #: requests sent to llama-server at once: its slots (-np), set from the launch, never by hand
    max_concurrency: int = 8
    queue_size: int = 32
    queue_timeout_s: float = 30.0
    stream_stall_s: float = 60.0
    prefill_stall_s: float = 600.0
    keepalive_s: float = 15.0
    write_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    retry_after_s: int = 5
    enable_paths: tuple[str, ...] = ()
    max_n_probs: int = 100
    max_choices: int = 1
    max_predict: int = 0  # 0: no cap beyond the context
    # The connection layer (see mtpwrap.http_server): time to a complete request head, idle
    # keep-alive, open connections, and the size and count of request headers.
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 1024
    max_header_bytes: int = 32 * 1024
    max_headers: int = 64
    metrics_public: bool = False
    healthz_public: bool = False
    backend_metrics_timeout_s: float = 5.0
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._validate("proxy config")

    def _validate(self, source: str) -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: proxy.{key}: {msg}")

        positive = ("max_body_bytes", "max_concurrency", "queue_timeout_s", "stream_stall_s",
                    "prefill_stall_s", "keepalive_s", "write_timeout_s", "connect_timeout_s",
                    "retry_after_s", "backend_metrics_timeout_s", "max_choices",
                    "header_timeout_s", "idle_timeout_s", "max_connections",
                    "max_header_bytes", "max_headers")
        for key in positive:
            if getattr(self, key) <= 0:
                raise bad(key, f"must be greater than 0, got {getattr(self, key)}")
        if self.queue_size < 0:
            raise bad("queue_size", f"must be 0 or more, got {self.queue_size}")
        if self.max_n_probs < 0:
            raise bad("max_n_probs", f"must be 0 or more, got {self.max_n_probs}")
        if self.max_predict < 0:
            raise bad("max_predict", f"must be 0 (no cap) or more, got {self.max_predict}")
        for name in self.enable_paths:
            if name not in FEATURES:
                raise bad("enable_paths", f"unknown feature {name!r}; known: {', '.join(FEATURES)}")
        if any(len(k) < 8 for k, _ in key_table(self.api_keys, f"{source}: proxy.api_keys")):
            raise bad("api_keys", "each key must be at least 8 characters without spaces")
        for o in self.cors_origins:
            if o == "*":
                raise bad("cors_origins", "'*' is not allowed; list the exact origins")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str) -> ProxyConfig:
        """Build from the `proxy:` mapping of a config file; ConfigError names source and key."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: proxy: must be a mapping, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        data = dict(data)
        keys_file = data.pop("api_keys_file", None)
        file_keys: tuple[str, ...] = ()
        if keys_file is not None:
            file_keys = read_keys_file(keys_file, f"{source}: proxy.api_keys_file")
        for key, value in data.items():
            if key not in known:
                raise ConfigError(
                    f"{source}: proxy.{key}: unknown key; known keys: {', '.join(sorted(known))}"
                )
            kwargs[key] = convert(value, _key_for(known[key].default), source, f"proxy.{key}",
                                  strict=True)
        if file_keys:
            kwargs["api_keys"] = tuple(kwargs.get("api_keys", ())) + file_keys
        cfg = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(cfg, f.name, kwargs.get(f.name, f.default))
        cfg._validate(source)
        return cfg

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def listen_is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.listen_host.strip("[]")).is_loopback
        except ValueError:
            return self.listen_host == "localhost"


def read_keys_file(path: Any, where: str) -> tuple[str, ...]:
    """API keys from a file: one per line, optionally followed by its scopes (`KEY
    inference,metrics`, see `parse_key`); blank lines and lines starting with # are skipped."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: must be a file path")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {path}: {err.strerror or err}; create it with "
                          "one key per line, readable only by the service user") from err
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.strip().startswith("#"):
            parse_key(line, f"{where}: {path} line {n}")
            keys.append(" ".join(line.split()))
    if not keys:
        raise ConfigError(f"{where}: {path} holds no key; put one key per line")
    return tuple(keys)


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
