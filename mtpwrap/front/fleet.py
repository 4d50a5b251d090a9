"""Several mtpwrap nodes behind one address: the HAProxy configuration and the Prometheus scrape
configuration for a fleet, rendered from one list of nodes.

Each node is one `mtpwrap up` (one GPU, one llama-server). The load balancer asks each node's
`/readyz`, never llama-server: mtpwrap's readiness already means "the model answers and this
node is not draining". What the rendered HAProxy configuration does, and why:

- Chat affinity, then `balance leastconn`: a stick table on a client header naming the chat
  (`affinity_header`; Open WebUI's `X-OpenWebUI-Chat-Id` by default) sends a chat's next
  questions to the node that read its document (slot, RAM cache), where they re-read only the
  question; a chat's first request, and any without the header, go to the node with the fewest
  open requests. A chat whose node is down moves once, and stays where it moved.
- `option httpchk` GET `/readyz` every `check_interval_s` (1 s), each check given at most that
  long (`timeout check`): a node that is loading, restarting llama-server, failed, draining or
  gone leaves the rotation after `fall` (2) failed checks, so within about 3 s, and comes back
  after `rise` passed ones. Not `/livez`: a live but unready node must get no traffic.
- No `on-marked-down shutdown-sessions`: a draining node answers `/readyz` 503 at once, and the
  streams it is still serving must be allowed to finish within its drain budget.
- `retry-on conn-failure empty-response 503`, `retries 1` and `option redispatch 1`: a node
  that is gone (refused connection), that closed the connection without a byte of answer, or
  that refused the request without forwarding it is retried once, on another node. The 503 is
  safe to retry because mtpwrap's front answers 503 only before the request reaches
  llama-server (draining, not ready, queue timeout); without it every request that meets a
  node between its SIGTERM and HAProxy's next check would fail. Nothing else is retried, and
  never once a response has begun: a generation is not idempotent.
- `maxconn` per server, the node's `slots` (else `max_per_node`): requests beyond it wait in
  HAProxy's queue (for at most `timeout queue`), where the first node to free a slot takes
  them (a chat's waits for its node), not in a node's own queue. A node's `weight` sets its
  share of new requests relative to the others (a faster GPU: a higher weight).
- `timeout server`/`timeout client` cover the longest silence of a node: a non-streamed long
  generation sends nothing until it is done; `timeout tunnel` covers upgraded connections.
- `option http-no-delay`: HAProxy 2.6 otherwise holds small response chunks back to fill
  packets, so SSE tokens arrive bunched; with it each chunk is sent as it comes.
- Optional TLS termination (`tls_cert`). The stats page listens on loopback only (`stats_bind`);
  the Prometheus exporter may listen elsewhere (`metrics_bind`). `Authorization` goes to the
  nodes untouched: they check the keys.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mtpwrap import proc
from mtpwrap.config.yamlfile import read_yaml
from mtpwrap.errors import ConfigError, MissingToolError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_HOST = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")
_BACKEND = "mtpwrap"


#: HAProxy's server weights run from 0 (no new requests) to 256.
_MAX_WEIGHT = 256


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int
    #: requests this node serves at once (its profile's slots, llama-server's -np): `maxconn`;
    #: None = the fleet-wide `HaproxyOptions.max_per_node`.
    slots: int | None = None
    #: its share of new requests relative to the others (HAProxy `weight`); None = 1.
    weight: int | None = None
    #: where it was given, for messages: "node 'SPEC'" or "--inventory 'FILE', node N".
    source: str = field(default="", compare=False)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(entry: str, what: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets) -> (host, port); `what` names the flag in the error."""
    host, sep, port = entry.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {entry!r}: expected HOST:PORT with a port from 1 to 65535, "
                          "for example 127.0.0.1:8080.")
    return host, int(port)


def _whole(value: object, key: str, low: int, high: int | None, where: str) -> int:
    """`value` as a whole number from `low` to `high` (None: no top); `where` names its node."""
    text = str(value).strip()
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and text.isdigit())
    number = int(text) if ok else None
    if number is None or number < low or (high is not None and number > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ConfigError(f"{where}: {key} must be a whole number {span}, got {value!r}.")
    return number


def _node(name: str, host: str, port: int, slots: object, weight: object, where: str) -> Node:
    if not _NAME.match(name):
        raise ConfigError(f"{where}: the name {name!r} must be letters, digits, '_', '.' or '-' "
                          "(at most 63), as in gpu1=10.0.0.5:8080.")
    if not _HOST.match(host):
        raise ConfigError(f"{where}: the host {host!r} must be a host name or an address, "
                          "such as 10.0.0.5.")
    return Node(name, host, port,
                None if slots is None else _whole(slots, "slots", 1, None, where),
                None if weight is None else _whole(weight, "weight", 0, _MAX_WEIGHT, where),
                where)


def parse_node(entry: str, index: int) -> Node:
    """One `[NAME=]HOST:PORT[,slots=N][,weight=W]`; the name defaults to node<index>."""
    where = f"node {entry!r}"
    first, *extras = entry.strip().split(",")
    name, eq, addr = first.partition("=")
    if not eq:
        name, addr = f"node{index}", first
    try:
        host, port = parse_address(addr, "--node")
    except ConfigError:
        raise ConfigError(f"{where}: expected [NAME=]HOST:PORT[,slots=N][,weight=W] with a port "
                          "from 1 to 65535, for example 10.0.0.5:8080,slots=4.") from None
    keys: dict[str, str] = {}
    for extra in extras:
        key, eq, value = extra.partition("=")
        key = key.strip()
        if not eq or key not in ("slots", "weight"):
            raise ConfigError(f"{where}: {extra!r} is not slots=N or weight=W; a node is "
                              "[NAME=]HOST:PORT[,slots=N][,weight=W].")
        if key in keys:
            raise ConfigError(f"{where}: {key} is given twice.")
        keys[key] = value.strip()
    return _node(name, host, port, keys.get("slots"), keys.get("weight"), where)


_INVENTORY_KEYS = ("name", "host", "port", "slots", "weight")


def load_inventory(path: Path) -> list[Node]:
    """Nodes from a YAML file: a list of {host, port, slots, weight, name (optional)}, or a
    mapping whose `nodes` key holds that list."""
    where = f"--inventory {str(path)!r}"
    doc = read_yaml(path, where, what="inventory")
    if isinstance(doc, dict) and set(doc) == {"nodes"}:
        doc = doc["nodes"]
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"{where}: expected a list of nodes, each with host, port, slots and "
                          "weight (name optional).")
    nodes = []
    for i, entry in enumerate(doc, 1):
        at = f"{where}, node {i}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: expected a mapping with host, port, slots and weight, "
                              f"got {entry!r}.")
        unknown = [str(k) for k in entry if k not in _INVENTORY_KEYS]
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r}; the keys are "
                              f"{', '.join(_INVENTORY_KEYS)}.")
        for key in ("host", "port"):
            if entry.get(key) in (None, ""):
                raise ConfigError(f"{at}: the key {key!r} is missing.")
        host = str(entry["host"]).strip("[]")
        port = _whole(entry["port"], "port", 1, 65535, at)
        name = entry.get("name")
        nodes.append(_node(f"node{i}" if name is None else str(name), host, port,
                           entry.get("slots"), entry.get("weight"), at))
    return nodes


def parse_nodes(entries: Iterable[str], inventory: Path | None = None) -> list[Node]:
    """Every node: those in `inventory` (a YAML file), then each `[NAME=]HOST:PORT[,slots=N]
    [,weight=W]` of `entries`; names default to node1, node2, ... and must differ."""
    nodes = load_inventory(inventory) if inventory is not None else []
    for entry in entries:
        nodes.append(parse_node(entry, len(nodes) + 1))
    if not nodes:
        raise ConfigError("no nodes: give each mtpwrap node as HOST:PORT[,slots=N][,weight=W] "
                          "(also --node, or MTPWRAP_FLEET_NODES separated by spaces), or "
                          "--inventory FILE.")
    for attr in ("name", "address"):
        seen: set[str] = set()
        for n in nodes:
            if getattr(n, attr) in seen:
                raise ConfigError(f"{n.source}: the {attr} {getattr(n, attr)!r} is given twice; "
                                  "each node once.")
            seen.add(getattr(n, attr))
    return nodes


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) only ever reaches this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _duration(seconds: float) -> str:
    """A duration both HAProxy and Prometheus read: whole seconds, else milliseconds."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


@dataclass(frozen=True)
class HaproxyOptions:
    bind: str = "127.0.0.1:8000"
    #: where HAProxy's own Prometheus exporter (/metrics) listens; None = not at all.
    metrics_bind: str | None = "127.0.0.1:8404"
    #: where the stats page (/stats, with its CSV) listens: loopback only; None = not at all.
    stats_bind: str | None = "127.0.0.1:8405"
    #: a PEM file (certificate, then key) to terminate TLS on `bind`; None = plain HTTP.
    tls_cert: Path | None = None
    #: a client header naming a chat, to keep it on the node that read its document; None =
    #: none (leastconn only).
    affinity_header: str | None = "X-OpenWebUI-Chat-Id"
    #: how long a chat's node is remembered after its last request.
    affinity_expire_s: float = 1800.0
    #: a UNIX socket for the runtime API (`set server mtpwrap/NAME state drain`); None = none.
    admin_socket: Path | None = None
    #: the Host the /readyz checks send: one the nodes answer to (`proxy.allowed_hosts`;
    #: `localhost` is among the defaults).
    check_host: str = "localhost"
    check_interval_s: float = 1.0
    fall: int = 2
    rise: int = 2
    #: open requests per node before HAProxy queues; 0 = no limit.
    max_per_node: int = 8
    #: how long a request may wait in HAProxy's queue for a node.
    queue_timeout_s: float = 60.0
    #: the longest silence from a node (a non-streamed long generation sends nothing until done).
    server_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    retries: int = 1
    #: consecutive 5xx answers that take a node out of rotation before its checks do.
    error_limit: int = 2

    def __post_init__(self) -> None:
        parse_address(self.bind, "--bind")
        if self.metrics_bind is not None:
            parse_address(self.metrics_bind, "--metrics-bind")
        if self.stats_bind is not None:
            host, _ = parse_address(self.stats_bind, "--stats-bind")
            if not is_loopback(host):
                raise ConfigError(f"--stats-bind {self.stats_bind!r}: the stats page shows every "
                                  "node and must listen on loopback, such as 127.0.0.1:8405.")
        if self.tls_cert is not None and not self.tls_cert.is_file():
            raise ConfigError(f"--tls-cert {str(self.tls_cert)!r}: no such file; give a PEM "
                              "file holding the certificate and then its private key.")
        if self.affinity_header is not None and not re.match(r"^[A-Za-z0-9-]{1,64}$",
                                                             self.affinity_header):
            raise ConfigError(f"--affinity-header {self.affinity_header!r}: expected a header "
                              "name of letters, digits and '-', such as X-Session-Id.")
        if not re.match(r"^[A-Za-z0-9.:\[\]-]+$", self.check_host):
            raise ConfigError(f"--check-host {self.check_host!r}: expected a host name or "
                              "address that the nodes answer to, such as localhost.")
        for key in ("check_interval_s", "queue_timeout_s", "server_timeout_s",
                    "connect_timeout_s", "affinity_expire_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"--{key.replace('_', '-')}: must be above 0, "
                                  f"got {getattr(self, key)}.")
        for key, low in (("fall", 1), ("rise", 1), ("max_per_node", 0), ("retries", 0),
                          ("error_limit", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"--{key.replace('_', '-')}: must be at least {low}, "
                                  f"got {getattr(self, key)}.")


def render_haproxy(nodes: Sequence[Node], opts: HaproxyOptions) -> str:
    """haproxy.cfg (HAProxy 2.6 or later) for `nodes`; see the module docstring for the why."""
    inter = _duration(opts.check_interval_s)
    maxconn = f" maxconn {opts.max_per_node}" if opts.max_per_node else ""
    tls = f" ssl crt {opts.tls_cert}" if opts.tls_cert is not None else ""
    lines = [
        "# Generated by `mtpwrap fleet haproxy`. Check with `haproxy -c -f FILE`.",
        "global",
        "    maxconn 4096",
    ]
    if opts.tls_cert is not None:
        lines.append("    ssl-default-bind-options ssl-min-ver TLSv1.2")
    if opts.admin_socket is not None:
        lines.append(f"    stats socket {opts.admin_socket} mode 600 level admin")
    lines += [
        "",
        "defaults",
        "    mode http",
        f"    timeout connect {_duration(opts.connect_timeout_s)}",
        "    timeout http-request 30s",
        f"    timeout queue {_duration(opts.queue_timeout_s)}",
        "    # A long generation may send nothing for minutes (not streamed), or stream for",
        "    # minutes: neither side's silence may end it before this.",
        f"    timeout client {_duration(opts.server_timeout_s)}",
        f"    timeout server {_duration(opts.server_timeout_s)}",
        f"    timeout tunnel {_duration(opts.server_timeout_s)}",
        f"    timeout check {inter}",
        "    # Send each response chunk as it comes: without it HAProxy 2.6 holds SSE tokens",
        "    # back to fill packets, and a stream arrives in bunches.",
        "    option http-no-delay",
        "",
        "frontend mtpwrap",
        f"    bind {opts.bind}{tls}",
        "    # The balancer's own liveness, independent of the nodes.",
        "    monitor-uri /haproxy-livez",
    ]
    if opts.tls_cert is not None:
        lines.append("    http-request set-header X-Forwarded-Proto https")
    lines += [
        "    # Authorization goes to the nodes as the client sent it: they check the keys.",
        f"    default_backend {_BACKEND}",
        "",
        f"backend {_BACKEND}",
        "    balance leastconn",
    ]
    if opts.affinity_header is not None:
        lines += [
            f"    # A chat ({opts.affinity_header}) goes back to the node that read its",
            "    # document while it is up; a first request, and one without it, by leastconn.",
            "    stick-table type string len 64 size 100k expire "
            f"{_duration(opts.affinity_expire_s)}",
            f"    stick on req.hdr({opts.affinity_header})",
        ]
    lines += [
        "    # Traffic only while a node's /readyz says its model answers and it is not draining.",
        "    option httpchk",
        "    # mtpwrap answers only Host names it knows (else 421), so the check names one.",
        f"    http-check send meth GET uri /readyz ver HTTP/1.1 hdr Host {opts.check_host}",
        "    http-check expect status 200",
        "    # Only what never reached llama-server is retried, once, on another node: a",
        "    # refused connection, a connection closed with no answer, or mtpwrap's own 503",
        "    # (draining, not ready, queue timeout: the front sends it before forwarding).",
        "    # Never a retry once a response has begun.",
        f"    retries {opts.retries}",
        "    retry-on conn-failure empty-response 503",
        "    # A retry needs the whole request in HAProxy's buffer: wait for the body before",
        "    # connecting. A body larger than the buffer (tune.bufsize, 16 KB) is streamed",
        "    # and not retried; its client gets the node's 503 and Retry-After.",
        "    option http-buffer-request",
        "    option redispatch 1",
        "    # Which node answered, for clients and for debugging.",
        "    http-response set-header X-Mtpwrap-Node %s",
        "    # A node answering 503 looks idle to leastconn and would draw the retries; that",
        "    # many consecutive 5xx (observe layer7) take it out until its checks pass again.",
        f"    default-server check inter {inter} fastinter {inter} downinter {inter} "
        f"fall {opts.fall} rise {opts.rise}{maxconn} "
        f"observe layer7 error-limit {opts.error_limit} on-error mark-down",
    ]
    lines += [f"    server {n.name} {n.address}"
              + (f" maxconn {n.slots}" if n.slots is not None else "")
              + (f" weight {n.weight}" if n.weight is not None else "") for n in nodes]
    if opts.metrics_bind is not None:
        lines += [
            "",
            "frontend haproxy-metrics",
            f"    bind {opts.metrics_bind}",
            "    http-request use-service prometheus-exporter if { path /metrics }",
            "    http-request deny",
        ]
    if opts.stats_bind is not None:
        lines += [
            "",
            "# Every node's state and counters: loopback only.",
            "frontend haproxy-stats",
            f"    bind {opts.stats_bind}",
            "    stats enable",
            "    stats uri /stats",
            "    stats refresh 5s",
        ]
    return "\n".join(lines) + "\n"


def check_haproxy(text: str, haproxy: str = "haproxy") -> None:
    """Run `haproxy -c` on a configuration; ConfigError with HAProxy's own words when it fails."""
    exe = shutil.which(haproxy)
    if exe is None:
        raise MissingToolError("haproxy is not installed, so the configuration cannot be "
                               "checked: install it (apt-get install haproxy) or drop --check.")
    with tempfile.NamedTemporaryFile("w", suffix=".cfg", prefix="mtpwrap-haproxy-") as f:
        f.write(text)
        f.flush()
        r = proc.run([exe, "-c", "-f", f.name], timeout=30, what="haproxy -c")
    if r.returncode != 0:
        why = " ".join(ln.strip() for ln in (r.stderr + r.stdout).splitlines()
                       if "ALERT" in ln)[:800]
        raise ConfigError(f"haproxy -c rejected the configuration: {why or r.stderr.strip()}")


@dataclass(frozen=True)
class PrometheusOptions:
    scrape_interval_s: float = 15.0
    #: HAProxy's exporter (`HaproxyOptions.metrics_bind`), scraped as job `haproxy`; None = not.
    haproxy_metrics: str | None = "127.0.0.1:8404"
    #: rule files Prometheus loads (relative paths are relative to the config file).
    rule_files: tuple[str, ...] = ("mtpwrap-rules.yml",)
    #: a file holding an API key, for nodes whose /metrics needs one.
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if self.scrape_interval_s <= 0:
            raise ConfigError(f"--scrape-interval-s: must be above 0, "
                              f"got {self.scrape_interval_s}.")
        if self.haproxy_metrics is not None:
            parse_address(self.haproxy_metrics, "--haproxy-metrics")


def render_prometheus(nodes: Sequence[Node], opts: PrometheusOptions) -> str:
    """prometheus.yml scraping every node (job `mtpwrap`, label `node`) and HAProxy."""
    every = _duration(opts.scrape_interval_s)
    job: dict[str, object] = {
        "job_name": "mtpwrap",
        "metrics_path": "/metrics",
        # A node's scrape reads llama-server's page too; it must end before the next one.
        "scrape_timeout": _duration(min(10.0, opts.scrape_interval_s)),
        "static_configs": [{"targets": [n.address], "labels": {"node": n.name}}
                           for n in nodes],
    }
    if opts.key_file is not None:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(opts.key_file)}
    jobs = [job]
    if opts.haproxy_metrics is not None:
        jobs.append({"job_name": "haproxy",
                     "static_configs": [{"targets": [opts.haproxy_metrics]}]})
    doc = {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "rule_files": list(opts.rule_files),
        "scrape_configs": jobs,
    }
    return ("# Generated by `mtpwrap fleet prometheus`. Check with "
            "`promtool check config FILE`.\n" + yaml.safe_dump(doc, sort_keys=False))
