"""The configuration objects the supervisor, the snapshot store and the front run on, built
from the table: each setting's field has the table's name, type and default; what a setting
gives in other units is converted where it is used (the properties below)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, fields
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.config.apikeys import checked_table
from mtpwrap.config.coerce import convert
from mtpwrap.config.table import AUDIT, PERSIST, PROXY, REFUSED, SUPERVISOR, TOP, Key, MiB
from mtpwrap.errors import ConfigError

_S = {name: key.default for name, key in SUPERVISOR.items()}
_P = {name: key.default for name, key in PERSIST.items()}
_X = {name: key.default for name, key in PROXY.items()}
_A = {name: key.default for name, key in AUDIT.items()}


@dataclass(frozen=True)
class SupervisorConfig:
    """The `supervisor.*` settings (the tristate ones as `up` decided them) and the
    supervisor's fixed knobs."""

    host: str = "127.0.0.1"
    load_stall_s: float = _S["load_stall_s"]
    probe_timeout_s: float = _S["probe_timeout_s"]
    poll_interval_s: float = 0.02  # /health polling while starting (cheap: no model work)
    monitor_interval_s: float = _S["monitor_interval_s"]
    health_failures: int = 3  # consecutive failed /health checks while ready → restart
    backoff_initial_s: float = _S["backoff_initial_s"]
    backoff_max_s: float = _S["backoff_max_s"]
    max_failures: int = _S["max_failures"]
    failure_window_s: float = _S["failure_window_s"]
    oom_max_retries: int = _S["oom_max_retries"]
    #: `up` turns the setting's "auto" into on or off from the memory plan
    oom_step_down: bool = False
    oom_step_after: int = 2  # consecutive OOM starts before stepping down
    stop_grace_s: float = _S["stop_grace_s"]
    wedge_s: float = _S["wedge_s"]
    rss_limit_mb: int = _S["rss_limit_mb"]
    memory_interval_s: float = _S["memory_interval_s"]
    recycle_drain_s: float = _S["recycle_drain_s"]
    log_file: Path | None = None
    log_max_bytes: int = 10 * MiB
    log_backups: int = 3
    log_lines_per_s: float = 20.0

    @property
    def rss_limit_bytes(self) -> int:
        return self.rss_limit_mb * MiB


def supervisor_config(values: Mapping[str, Any], *, near_edge: bool,
                      log_file: Path | None = None) -> SupervisorConfig:
    """The supervisor's configuration from the `supervisor.*` values; `near_edge`: the memory
    plan leaves the GPU near its edge, where an out-of-memory start is likely (what
    oom_step_down: auto turns on for). exit_on_failed is the service's, not the supervisor's."""
    kwargs = {k: v for k, v in values.items() if k != "exit_on_failed"}
    if kwargs.get("oom_step_down", "auto") == "auto":
        kwargs["oom_step_down"] = near_edge
    return SupervisorConfig(log_file=log_file, **kwargs)


def exit_on_failed(value: bool | str, *, under_systemd: bool) -> bool:
    """`supervisor.exit_on_failed`: `auto` exits when the supervisor gives up only under
    systemd, whose restart policy then decides; elsewhere the front stays up and says why.
    (The other `auto` of the section, oom_step_down, is decided in `supervisor_config`.)"""
    return under_systemd if value == "auto" else bool(value)


def default_snapshot_dir() -> Path:
    """On disk beside the models and builds (under systemd /var/lib/mtpwrap), not in the state
    directory, which systemd puts on a RAM-backed /run."""
    return paths.home() / "documents"


@dataclass(frozen=True)
class PersistConfig:
    """The `persist.*` settings: the document store."""

    enabled: bool = _P["enabled"]
    dir: str | None = _P["dir"]
    min_tokens: int = _P["min_tokens"]
    max_mb: int = _P["max_mb"]  # 0: a share of the free disk, measured when the store opens
    retention_days: int = _P["retention_days"]

    @property
    def directory(self) -> Path:
        return Path(self.dir).expanduser() if self.dir else default_snapshot_dir()

    @property
    def max_bytes(self) -> int:
        return self.max_mb * MiB


@dataclass(frozen=True)
class AuditConfig:
    """The `audit.*` settings: the audit trail's sink, its directory and retention."""

    sink: str = _A["sink"]
    dir: str | None = _A["dir"]
    retention_days: int = _A["retention_days"]

    @property
    def directory(self) -> Path:
        """Beside the models, like the snapshots: the state directory is RAM under systemd."""
        return Path(self.dir).expanduser() if self.dir else paths.home() / "audit"


#: the front's fields that `up` sets, never a config file: the keys (from api_key_file and
#: MTPWRAP_API_KEYS), the listen address (`host`), the slots (the launch's -np)
SET_BY_UP: dict[str, Key] = {
    "api_keys": Key("list", ()),
    "listen_host": Key("str", TOP["host"].default),
    "max_concurrency": Key("int", 8, check=lambda v: v >= 1, expect="an integer >= 1"),
}


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of the HTTP front (the `proxy.*` keys, see the table for each one's meaning).

    Which ops endpoints are open: `/livez` and `/readyz` never need a key (probes from systemd,
    Kubernetes or a load balancer carry none, and they reveal only up/ready and a reason);
    `/healthz` and `/metrics` need one when keys are configured, unless `healthz_public` /
    `metrics_public` say otherwise.
    """

    api_keys: tuple[str, ...] = SET_BY_UP["api_keys"].default
    allowed_hosts: tuple[str, ...] = _X["allowed_hosts"]
    listen_host: str = SET_BY_UP["listen_host"].default
    max_body_bytes: int = _X["max_body_bytes"]
    #: requests sent to llama-server at once: its slots (-np), set from the launch, never by hand
    max_concurrency: int = SET_BY_UP["max_concurrency"].default
    queue_size: int = _X["queue_size"]
    queue_timeout_s: float = _X["queue_timeout_s"]
    batch_queue_timeout_s: float = _X["batch_queue_timeout_s"]
    priority_aging_s: float = _X["priority_aging_s"]
    stream_stall_s: float = _X["stream_stall_s"]
    prefill_stall_s: float = _X["prefill_stall_s"]
    keepalive_s: float = _X["keepalive_s"]
    write_timeout_s: float = _X["write_timeout_s"]
    connect_timeout_s: float = _X["connect_timeout_s"]
    retry_after_s: int = _X["retry_after_s"]
    enable_paths: tuple[str, ...] = _X["enable_paths"]
    max_n_probs: int = _X["max_n_probs"]
    max_choices: int = _X["max_choices"]
    max_predict: int = _X["max_predict"]
    # The connection layer (see mtpwrap.front.http_server): time to a complete request head and
    # body, idle keep-alive, open connections, and the size and count of request headers.
    header_timeout_s: float = _X["header_timeout_s"]
    body_timeout_s: float = _X["body_timeout_s"]
    body_min_rate: int = _X["body_min_rate"]
    idle_timeout_s: float = _X["idle_timeout_s"]
    max_connections: int = _X["max_connections"]
    max_header_bytes: int = _X["max_header_bytes"]
    max_headers: int = _X["max_headers"]
    metrics_public: bool = _X["metrics_public"]
    healthz_public: bool = _X["healthz_public"]
    backend_metrics_timeout_s: float = _X["backend_metrics_timeout_s"]
    cors_origins: tuple[str, ...] = _X["cors_origins"]
    reread_threshold_tokens: int = _X["reread_threshold_tokens"]
    #: what errors name as the values' origin (a config file, "settings")
    source: InitVar[str] = "proxy config"

    def __post_init__(self, source: str) -> None:
        for name, k in (*PROXY.items(), *SET_BY_UP.items()):
            value = getattr(self, name)
            if not k.accepts(value):  # the table's rule, as the coercer applies it
                raise ConfigError(f"{source}: proxy.{name}: expected {k.expected()}, got "
                                  f"{value!r}.")
        checked_table(self.api_keys, f"{source}: proxy.api_keys")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, source: str) -> ProxyConfig:
        """Build from a `proxy:` mapping (plus what `up` sets); ConfigError names source and
        key."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: proxy: must be a mapping, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            dotted = f"proxy.{name}"
            key = SET_BY_UP.get(name) or PROXY.get(name)
            if key is None:
                if dotted in REFUSED:
                    raise ConfigError(f"{source}: {dotted}: {REFUSED[dotted]}")
                known = sorted(f.name for f in fields(cls))
                raise ConfigError(f"{source}: {dotted}: unknown key; known keys: "
                                  f"{', '.join(known)}")
            kwargs[name] = convert(value, key, source, dotted, strict=True)
        return cls(**kwargs, source=source)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def listen_is_loopback(self) -> bool:
        return is_loopback(self.listen_host)


def is_loopback(host: str) -> bool:
    """`host` (an address or `localhost`) reaches this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
