"""Who may do what through the HTTP front: the path allow-list, hosts, keys and their scopes,
and `Access`, the one check of a request line against them.

Pure functions and data, no I/O and no ASGI imports, so they are tested with tables; the guard
in front of the app (front/app.py) asks `Access.check` and answers what it says.
"""

from __future__ import annotations

import base64
import hmac
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from mtpwrap.config.apikeys import ApiKey, KeyTable, key_table
from mtpwrap.config.objects import ProxyConfig

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
    #: llama-server reads the body as one JSON object (the model APIs): an empty body or
    #: another JSON value gets its 500, so the front refuses it with a 400
    object_body: bool = False


def _feature(method: str, path: str) -> tuple[str | None, str]:
    """The allow-list's feature for a request line ("" = always on, None = not listed) and
    its metrics label."""
    if method == "HEAD":
        method = "GET"
    feature = _EXACT.get((method, path))
    if feature is None and method == "POST" and _SLOT_ACTION.match(path):
        return "slot-actions", "/slots/{id}"
    return feature, path


def route_label(method: str, path: str) -> str:
    """The metrics and audit label of a request line: the allow-list's route, or "other"."""
    feature, label = _feature(method, path)
    return "other" if feature is None else label


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
    json_body = method == "POST" and path not in FORM_PATHS
    return Route(0, label, UPSTREAM_PATH.get(path, path), slot=path in SLOT_PATHS,
                 json_body=json_body, object_body=json_body and feature == "")


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


#: the status page (front/status.py): a browser gives the key as Basic authentication's
#: password, and a key with either scope may see it
STATUS_PAGES = frozenset({"/status", "/status.json"})
STATUS_SCOPES = frozenset({"metrics", "admin"})


def presented_key(headers: Mapping[str, str], basic: bool = False) -> str | None:
    """The key a client sent as `Authorization: Bearer K` or `X-Api-Key: K`; with `basic`
    (the status page), also as the password of `Authorization: Basic`."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        if basic and scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                return None
            password = decoded.partition(":")[2]
            return password or None
        return None
    key = headers.get("x-api-key")
    return key.strip() if key else None


def find_key(presented: str | None, keys: KeyTable) -> ApiKey | None:
    """The configured key presented; None when it is none of them. Constant-time: every
    configured key is compared (no early exit on a match)."""
    if presented is None:
        return None
    given = presented.encode("utf-8", "surrogateescape")
    found: ApiKey | None = None
    for k in keys:
        if hmac.compare_digest(given, k.secret):
            found = k
    return found


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


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------

#: probes carry no key and reveal only up/ready (answered whatever the Host)
OPEN_PATHS = frozenset({"/livez", "/readyz"})


@dataclass(frozen=True)
class Denial:
    """A request refused before anything else looks at it."""

    status: int
    reason: str          # the `mtpwrap_refused` label
    message: str
    #: close the connection after the answer: always, or only when a body was declared
    close: bool | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    #: the key presented, when it was a configured one (a 403 for its scope)
    key: ApiKey | None = None


@dataclass(frozen=True)
class Access:
    """The host names, keys and open pages of one front (from its ProxyConfig)."""

    keys: KeyTable = ()
    hosts: frozenset[str] | None = None
    metrics_public: bool = False
    healthz_public: bool = False

    @classmethod
    def from_config(cls, cfg: ProxyConfig) -> Access:
        return cls(keys=key_table(cfg.api_keys, "proxy.api_keys"),
                   hosts=derive_allowed_hosts(cfg), metrics_public=cfg.metrics_public,
                   healthz_public=cfg.healthz_public)

    def check(self, method: str, path: str, headers: Mapping[str, str]
              ) -> Denial | ApiKey | None:
        """What to answer when the request may not go on; else the key it presented (None when
        it needs none). `headers`: lower-case names, the first value of each."""
        if "transfer-encoding" in headers and "content-length" in headers:
            # RFC 9112 §6.1: a sign of request smuggling; the parser refuses it too.
            return Denial(400, "bad_request", "Content-Length and Transfer-Encoding together "
                          "are not allowed.", close=True)
        # Probes (/livez, /readyz) answer whatever Host a balancer or kubelet sends: they carry
        # no key and reveal only up/ready, so DNS rebinding gains nothing from them.
        if (self.hosts is not None and path not in OPEN_PATHS
                and host_of(headers.get("host", "")) not in self.hosts):
            return Denial(421, "host", "This server does not answer for that Host.", close=True)
        needs_key = bool(self.keys) and path not in OPEN_PATHS and not (
            (path == "/metrics" and self.metrics_public)
            or (path == "/healthz" and self.healthz_public))
        page = path in STATUS_PAGES
        key = find_key(presented_key(headers, basic=page), self.keys) if self.keys else None
        if not needs_key:
            return key
        if key is None:
            # Without a key nothing of the body is read: the connection closes after the 401.
            # The status page asks a browser for the key (as Basic authentication's password).
            challenge = b'Basic realm="mtpwrap status", charset="UTF-8"' if page else b"Bearer"
            return Denial(401, "auth", "Invalid or missing API key.",
                          headers=((b"www-authenticate", challenge),))
        if page:
            if not key.scopes & STATUS_SCOPES:
                return Denial(403, "scope", f"This API key may not use {path}: that needs a "
                              "key with the metrics or admin scope.", key=key)
            return key
        if (need := required_scope(method, path)) not in key.scopes:
            return Denial(403, "scope", f"This API key may not use {path}: that needs a key "
                          f"with the {need} scope.", key=key)
        return key
