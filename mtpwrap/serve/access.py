"""Who may do what through the HTTP front: its settings, the path allow-list, hosts, keys and
their scopes, and `Access`, the one check of a request line against them.

Pure functions and data, no I/O and no ASGI imports, so they are tested with tables; the guard
in front of the app (serve/front.py) asks `Access.check` and answers what it says.
"""

from __future__ import annotations

import hmac
import ipaddress
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

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> Denial | None:
        """None when the request may go on; else what to answer. `headers`: lower-case names,
        the first value of each."""
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
        if not needs_key:
            return None
        scopes = key_scopes(presented_key(headers), self.keys)
        if scopes is None:
            # Without a key nothing of the body is read: the connection closes after the 401.
            return Denial(401, "auth", "Invalid or missing API key.",
                          headers=((b"www-authenticate", b"Bearer"),))
        if (need := required_scope(method, path)) not in scopes:
            return Denial(403, "scope", f"This API key may not use {path}: that needs a key "
                          f"with the {need} scope.")
        return None
