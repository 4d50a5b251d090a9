"""Every setting of `mtpwrap up`, declared once: type, default, unit, help and the checks.

A setting is a key of the config file (`port`, `supervisor.backoff_max_s`, `proxy.queue_size`),
an environment variable (`MTPWRAP_PORT`, `MTPWRAP_SUPERVISOR_BACKOFF_MAX_S`) and a flag of
`up` (`--port`, `--supervisor-backoff-max-s`); the names follow from the key. Precedence: flag >
environment > config file > a profile's own section (supervisor, proxy) > default.

This module imports nothing heavy: the command table, the reference generator and the loader
all read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mtpwrap.units import MiB

#: the config file read when no --config is given and it exists
DEFAULT_CONFIG_FILE = "/etc/mtpwrap/mtpwrap.yaml"
ENV_PREFIX = "MTPWRAP_"

KINDS = ("str", "int", "float", "bool", "tristate", "list")


@dataclass(frozen=True)
class Key:
    kind: str  # one of KINDS; "tristate" is true, false or "auto"; "list" a list of strings
    default: Any
    help: str = ""
    unit: str = ""  # "s", "MiB", "bytes", "tokens", ...
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # how to describe a valid value in an error
    choices: tuple[str, ...] = ()
    metavar: str = ""  # how --help shows the value (default: from the kind, e.g. TEXT)

    def accepts(self, value: Any) -> bool:
        if self.choices and value not in self.choices:
            return False
        return self.check is None or self.check(value)

    def expected(self) -> str:
        if self.expect:
            return self.expect
        if self.choices:
            return f"one of {', '.join(self.choices)}" if len(self.choices) > 2 else \
                " or ".join(self.choices)
        return {"bool": "true or false", "int": "an integer", "float": "a number",
                "str": "a string", "list": "a list of strings",
                "tristate": "true, false or auto"}[self.kind]


def _port(v: int) -> bool:
    return 1 <= v <= 65535


def _nonneg(v: float) -> bool:
    return v >= 0


def _pos(v: float) -> bool:
    return v > 0


def _seconds(default: float, help: str, *, zero: str | None = None, positive: bool = False
             ) -> Key:
    """A duration: > 0 when `positive`, else >= 0 (`zero` says what 0 means)."""
    if positive:
        return Key("float", default, help, "s", _pos, "a number of seconds > 0")
    tail = f" (0: {zero})" if zero else ""
    return Key("float", default, help, "s", _nonneg, f"a number of seconds >= 0{tail}")


TOP: dict[str, Key] = {
    "profile": Key("str", "auto", "Profile name or file, or `auto` for this machine."),
    "model": Key("str", None, "Model path or name, overriding the profile's."),
    "host": Key("str", "127.0.0.1", "Address the HTTP front listens on; an address other than "
                                  "loopback needs API keys, or allow_open_listen."),
    "allow_open_listen": Key("bool", False, "Let the front listen on an address other than "
                                            "loopback without API keys: anyone who reaches it "
                                            "may use the model and read /metrics, /healthz and "
                                            "the status page; refused at start without it."),
    "port": Key("int", 8080, "Port of the HTTP front.", "", _port, "an integer 1..65535"),
    "binary": Key("str", None, "llama-server to run (default: the one `mtpwrap build` made).",
                  metavar="PATH"),
    "hw_replay": Key("str", None, "A hardware recording (`mtpwrap hw --record`) to plan for "
                                  "instead of this machine's GPUs.", metavar="PATH"),
    "plan": Key("str", "auto", "The memory plan that gates a GPU launch: auto refuses what "
                               "does not fit or cannot be planned, skip launches unchecked "
                               "(`up --no-plan`).", choices=("auto", "skip")),
    "api_key_file": Key("str", None, "File with one client API key per line, optionally "
                                     "followed by its scopes; keys also come from "
                                     "MTPWRAP_API_KEYS (comma separated).", metavar="PATH"),
    "drain_s": _seconds(30.0, "Seconds in-flight requests get on shutdown (the unit's "
                              "TimeoutStopSec covers it)."),
    "drain_grace_s": _seconds(0.0, "Before draining, seconds /readyz says 503 while requests "
                                   "are still taken, so a load balancer moves traffic away "
                                   "first.", zero="drain at once"),
    "ready_timeout_s": _seconds(0.0, "Give up when llama-server is not ready this long after "
                                     "the start.", zero="no limit"),
    "log_level": Key("str", "info", "mtpwrap's own log level.",
                     choices=("debug", "info", "warning", "error")),
}

SUPERVISOR: dict[str, Key] = {
    "load_stall_s": _seconds(120.0, "No output and no /health change for this long while "
                                    "loading: the load is stuck.", positive=True),
    "probe_timeout_s": _seconds(60.0, "Time allowed for the one-token readiness generation.",
                                positive=True),
    "monitor_interval_s": _seconds(1.0, "Seconds between health checks while ready.",
                                   positive=True),
    "backoff_initial_s": _seconds(1.0, "First wait before restarting a crashed llama-server "
                                       "(then 2, 4 ... times as long).",
                                  positive=True),
    "backoff_max_s": _seconds(30.0, "Longest wait between restarts.", positive=True),
    "max_failures": Key("int", 5, "Crashes within failure_window_s before giving up (failed).",
                        "", _pos, "an integer >= 1"),
    "failure_window_s": _seconds(300.0, "The window max_failures counts in.", positive=True),
    "oom_max_retries": Key("int", 8, "Out-of-memory starts within the window before giving "
                                     "up.", "", _pos, "an integer >= 1"),
    "oom_step_down": Key("tristate", "auto", "Step down to cheaper launches after "
                                             "out-of-memory starts; auto: on when the memory "
                                             "plan leaves the GPU near its edge."),
    "stop_grace_s": _seconds(10.0, "Seconds llama-server gets after SIGTERM before SIGKILL of "
                                   "its process group."),
    "wedge_s": _seconds(60.0, "No decode progress this long while requests are processing: "
                              "restart.", zero="off"),
    "rss_limit_mb": Key("int", 0, "llama-server's RSS + swap above this: drain and recycle it.",
                        "MiB", _nonneg, "an integer number of MiB >= 0 (0: off)"),
    "memory_interval_s": _seconds(5.0, "Seconds between memory readings for rss_limit_mb.",
                                  positive=True),
    "recycle_drain_s": _seconds(60.0, "Seconds in-flight requests get before a recycle."),
    "exit_on_failed": Key("tristate", "auto", "After a crash loop, exit 1 instead of staying "
                                              "failed; auto: when started by systemd "
                                              "(NOTIFY_SOCKET set), so its Restart= and start "
                                              "limits take over."),
}

#: the document store: every document llama-server read, kept on disk (mtpwrap.front.store)
PERSIST: dict[str, Key] = {
    "enabled": Key("bool", True, "Keep the state of every document llama-server reads on disk "
                                 "and restore it into the slot before a question on it (after "
                                 "a restart, a reload, a crash, on another node); false: a "
                                 "restart reads every document again."),
    "dir": Key("str", None, "The document store, 0700 with files 0600; may be shared by several "
                            "nodes (default: <MTPWRAP_HOME>/documents; under systemd "
                            "/var/lib/mtpwrap/documents; a disk of its own is best).",
               metavar="DIR"),
    "min_tokens": Key("int", 4096, "Prompts shorter than this are not kept, and a state is "
                                   "restored only when it saves this many tokens more than "
                                   "llama-server holds.", "tokens", _pos,
                      "an integer number of tokens >= 1"),
    "max_mb": Key("int", 0, "Bound on the store's size, least recently used out first.", "MiB",
                  _nonneg, "an integer number of MiB >= 0 (0: a quarter of the free disk)"),
    "retention_days": Key("int", 30, "A state unused this long is removed.", "days", _pos,
                          "an integer number of days >= 1"),
}


#: the audit trail and usage (mtpwrap.front.audit)
AUDIT: dict[str, Key] = {
    "sink": Key("str", "file", "Where the audit trail goes: one JSON line per request in a daily "
                               "file, journald's structured fields, or off.",
                choices=("file", "journald", "off")),
    "dir": Key("str", None, "Audit files (0600, one per UTC day) and the budgets' counts "
                            "(default: <MTPWRAP_HOME>/audit; under systemd "
                            "/var/lib/mtpwrap/audit).", metavar="DIR"),
    "retention_days": Key("int", 90, "Audit files older than this many days are deleted.",
                          "days", _pos, "an integer number of days >= 1"),
}


#: the gated llama-server routes `proxy.enable_paths` may open (mtpwrap.front.access maps
#: each to its paths)
FEATURES: tuple[str, ...] = (
    "slots", "slot-actions", "props-write", "lora-adapters", "backend-metrics", "webui",
    "control", "resumable-streams",
)

#: the HTTP front (mtpwrap.config.objects.ProxyConfig checks the values' ranges)
def _count(default: int, help: str, unit: str = "", *, zero: str | None = None,
           positive: bool = True) -> Key:
    """A whole number: >= 1 when `positive`, else >= 0 (`zero` says what 0 means)."""
    what = f"an integer number of {unit}" if unit and unit not in ("s",) else "an integer"
    if positive:
        return Key("int", default, help, unit, _pos, f"{what} >= 1")
    tail = f" (0: {zero})" if zero else ""
    return Key("int", default, help, unit, _nonneg, f"{what} >= 0{tail}")


def _features(v: tuple[str, ...]) -> bool:
    return all(name in FEATURES for name in v)


def _exact_origins(v: tuple[str, ...]) -> bool:
    return "*" not in v


PROXY: dict[str, Key] = {
    "allowed_hosts": Key("list", (), "Host names the front answers to (`*`: any); default: "
                                     "loopback names and the listen address."),
    "max_body_bytes": _count(8 * MiB, "Largest request body.", "bytes"),
    "queue_size": _count(32, "Requests waiting for a free slot beyond those running.",
                         positive=False),
    "queue_timeout_s": _seconds(30.0, "Longest wait in the queue before 503 (keys of class "
                                "interactive).", positive=True),
    "batch_queue_timeout_s": _seconds(600.0, "Longest wait in the queue before 503 for keys "
                                      "of class batch.", positive=True),
    "priority_aging_s": _seconds(30.0, "A queued batch request counts as interactive once it "
                                 "has waited this long (batch work is never starved).",
                                 positive=True),
    "stream_stall_s": _seconds(60.0, "A stream that sends nothing this long is cut.",
                               positive=True),
    "prefill_stall_s": _seconds(600.0, "Longest wait for the first byte of the answer with "
                                "no progress: llama-server's read of a long prompt, and its "
                                "generation of an answer not streamed, count as progress.",
                                positive=True),
    "keepalive_s": _seconds(15.0, "Seconds between keep-alive comments on a quiet stream.",
                            positive=True),
    "write_timeout_s": _seconds(30.0, "A client that reads nothing this long is dropped.",
                                positive=True),
    "connect_timeout_s": _seconds(5.0, "Connecting to llama-server.", positive=True),
    "retry_after_s": _count(5, "Retry-After of a 503, in seconds.", "s"),
    "enable_paths": Key("list", (), "Gated llama-server routes to open: "
                                    + ", ".join(FEATURES) + ".", check=_features,
                        expect="a list of strings, each one of " + ", ".join(FEATURES)),
    "max_n_probs": _count(100, "Most top tokens per position a request may ask for.",
                          positive=False),
    "max_choices": _count(1, "Most choices per request (`n`)."),
    "max_predict": _count(0, "Most tokens to generate per request.", "tokens", positive=False,
                          zero="no cap beyond the context"),
    "header_timeout_s": _seconds(10.0, "Time to a complete request head.", positive=True),
    "body_timeout_s": _seconds(10.0, "Time to a complete request body after its head, plus 1 s"
                               " for every body_min_rate bytes that arrive.", positive=True),
    "body_min_rate": _count(1024, "The slowest request body the front waits for.", "bytes/s"),
    "idle_timeout_s": _seconds(30.0, "Idle keep-alive connections are closed after this.",
                               positive=True),
    "max_connections": _count(1024, "Open client connections."),
    "max_header_bytes": _count(32 * 1024, "Size of the request headers.", "bytes"),
    "max_headers": _count(64, "Number of request headers."),
    "metrics_public": Key("bool", False, "/metrics without an API key."),
    "healthz_public": Key("bool", False, "/healthz without an API key."),
    "backend_metrics_timeout_s": _seconds(5.0, "Reading llama-server's own /metrics.",
                                          positive=True),
    "cors_origins": Key("list", (), "Browser origins allowed to call the API.",
                        check=_exact_origins,
                        expect="a list of strings, each an exact origin (never `*`)"),
    "reread_threshold_tokens": _count(2048, "A request to the chat model that reads more than "
                                      "this many tokens of its prompt again (not from the "
                                      "cache) gets a cause in the audit line, /metrics and the "
                                      "status page.", "tokens"),
}

#: one item of a profile's `companions:` list: an embedding or rerank model served by its own
#: llama-server next to the chat model. Profile keys only (no flag, no variable): a companion is
#: part of what a profile runs, like its model and context.
COMPANION_ROLES = ("embedding", "rerank")
#: llama-server's --pooling values; a reranker always pools with rank
POOLING = ("none", "mean", "cls", "last", "rank")


def _name(v: str) -> bool:
    return bool(v) and len(v) <= 64 and all(c.isalnum() or c in "._-" for c in v) \
        and v[0].isalnum()


COMPANION: dict[str, Key] = {
    "role": Key("str", None, "What the companion serves: embedding (/v1/embeddings) or rerank "
                             "(/v1/rerank).", choices=COMPANION_ROLES),
    "model": Key("str", None, "The companion's GGUF: a path, or a file name in the models "
                              "directory (`mtpwrap models pull`/`import` put it there)."),
    "name": Key("str", None, "The name clients send as `model` and /v1/models lists (default: "
                             "the role); letters, digits, '.', '_' and '-'.", check=_name,
                expect="a name of letters, digits, '.', '_' and '-' (at most 64)"),
    "device": Key("str", "cpu", "Where it computes: cpu (RAM, and threads taken from the chat "
                                "model's share) or gpu (its bytes come off the GPU before the "
                                "chat model is planned).", choices=("cpu", "gpu")),
    "context": Key("int", 2048, "Tokens of context, shared by its slots.", "tokens",
                   lambda v: 64 <= v <= 1 << 20, "an integer 64..1048576"),
    "slots": Key("int", 1, "Requests it computes at once (llama-server's -np).", "",
                 lambda v: 1 <= v <= 64, "an integer 1..64"),
    "threads": Key("int", None, "CPU threads (default: a quarter of the cores, at least 1, on "
                                "the CPU; 1 on the GPU).", "",
                   lambda v: 1 <= v <= 1024, "an integer 1..1024"),
    "pooling": Key("str", None, "How token vectors become one embedding (default: the model's "
                                "own, from its header; an embedding companion whose pooling "
                                "would be none is refused; a reranker pools with rank).",
                   choices=POOLING),
    "ubatch": Key("int", None, "Physical batch in tokens; an input longer than it is refused "
                               "by llama-server (default: the context).", "tokens",
                  lambda v: 1 <= v <= 1 << 20, "an integer 1..1048576"),
}
COMPANION_REQUIRED = ("role", "model")

SECTIONS: dict[str, dict[str, Key]] = {
    "supervisor": SUPERVISOR, "persist": PERSIST, "proxy": PROXY, "audit": AUDIT,
}

#: keys that are refused, with what to do instead
REFUSED: dict[str, str] = {
    "proxy.api_keys": "keys do not belong in the config file; put them in the file named by "
                      "api_key_file (mode 0600) or in MTPWRAP_API_KEYS.",
    "proxy.api_keys_file": "this setting is api_key_file at the top of the file (flag "
                           "--api-key-file, MTPWRAP_API_KEY_FILE); move it there.",
    "proxy.listen_host": "the front listens on `host`; set host instead.",
    "persist.checkpoints": "every document read is kept in the document store now; remove "
                           "this key.",
    "persist.checkpoint_tokens": "every document read is kept in the document store now; "
                                 "remove this key (persist.min_tokens sets what is kept).",
    "proxy.max_concurrency": "the front sends llama-server at most as many requests as it has "
                             "slots; remove this key and set the profile's slots instead.",
}

#: sections whose YAML values must already have their key's type ("3" is not 3)
STRICT_SECTIONS = ("proxy",)


def env_name(dotted: str) -> str:
    """`supervisor.backoff_max_s` -> MTPWRAP_SUPERVISOR_BACKOFF_MAX_S."""
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def flag_name(dotted: str) -> str:
    """`supervisor.backoff_max_s` -> --supervisor-backoff-max-s."""
    return "--" + dotted.replace(".", "-").replace("_", "-")


def strict(dotted: str) -> bool:
    return dotted.partition(".")[0] in STRICT_SECTIONS


def key(dotted: str) -> Key:
    section, _, name = dotted.rpartition(".")
    return (SECTIONS[section] if section else TOP)[name]


def default(dotted: str) -> Any:
    return key(dotted).default


def every_key() -> Iterator[tuple[str, Key]]:
    """(dotted name, key) of every setting, in the order of the reference."""
    yield from TOP.items()
    for section, keys in SECTIONS.items():
        for name, k in keys.items():
            yield f"{section}.{name}", k
