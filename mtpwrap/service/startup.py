"""What `up` decides before it starts anything: the `Runtime` (one resolve on this machine,
binary and profile; the supervisor's and the front's settings) and the snapshots' settings.
Every check that can fail on bad input runs here, so a refusal starts nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mtpwrap import paths
from mtpwrap.config.objects import (
    AuditConfig,
    PersistConfig,
    ProxyConfig,
    SupervisorConfig,
    is_loopback,
)
from mtpwrap.config.objects import supervisor_config as build_supervisor_config
from mtpwrap.config.settings import Settings
from mtpwrap.decide import resolve
from mtpwrap.decide.endpoint import Endpoint, listen_on
from mtpwrap.errors import ConfigError
from mtpwrap.front.info import ServeInfo
from mtpwrap.supervision import inputs, sockets
from mtpwrap.supervision.child import ChildCommand
from mtpwrap.supervision.supervisor import LaunchFactory, Supervisor

if TYPE_CHECKING:
    from mtpwrap.build.manifest import Manifest
    from mtpwrap.decide.resolve import Resolved
    from mtpwrap.front.app import Front
    from mtpwrap.front.store import Documents, Shelf


@dataclass(frozen=True)
class CompanionRun:
    """What `up` decided for one companion: its name (the `model` clients send), role, model
    file and slots, where it listens and its memory plan. Its supervisor calls it for each
    start's command; a companion has no cheaper rung: after out-of-memory starts it backs off
    and fails like any crash, without touching the chat model."""

    name: str
    role: str
    model: str
    slots: int
    resolved: Resolved
    endpoint: Endpoint
    plan: str
    n_vocab: int | None = None  #: its vocabulary's size, from its header

    def __call__(self, endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        if step:
            return None
        return self.resolved.render(cfg=self.resolved.companion(self.name).launch,
                                    api_key=api_key,
                                    endpoint=dataclasses.replace(endpoint, why=self.endpoint.why))

    @property
    def socket(self) -> Path | None:
        return Path(self.endpoint.socket) if self.endpoint.socket is not None else None

    def log_file(self) -> Path:
        return paths.log_dir() / f"llama-server-{self.name}.log"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "model": self.model, "slots": self.slots,
                "plan": self.plan, "log_file": str(self.log_file())}


@dataclass(frozen=True)
class Runtime:
    """Everything derived for one run (`load_runtime`: settings + profile + hardware +
    binary): the settings it came from, the resolved launch, the supervisor's and the front's
    configuration, the companions. Called, it is the supervisor's `LaunchFactory`: each start's
    rung of the step-down ladder (`Resolved.step_down`), rendered with that start's endpoint
    and key and with the snapshot directory decided with it.

    Frozen: a reload derives a new one and the service swaps it whole; the memory plan made
    once llama-server is starting (`with_plan`) is a new one too."""

    settings: Settings
    info: ServeInfo  # static facts: summary, /healthz, state file
    supervisor: SupervisorConfig
    front: ProxyConfig
    resolved: Resolved | None = None
    #: mtpwrap's KV snapshot directory, llama-server's --slot-save-path (None: persistence off)
    slot_save_path: Path | None = None
    #: the front serves llama-server's web UI (proxy.enable_paths lists webui)
    webui: bool = False
    #: where llama-server listens (its port, over TCP, is the supervisor's at each start)
    endpoint: Endpoint = field(default_factory=Endpoint)
    #: the embedding and rerank models served next to the chat model, each its own child
    companions: tuple[CompanionRun, ...] = ()
    warnings: tuple[str, ...] = ()
    #: `supervisor.exit_on_failed` as set ("auto", or a boolean)
    exit_on_failed: bool | str = "auto"
    #: the chat model's command where it is no resolved launch (a stand-in llama-server)
    command: LaunchFactory | None = None

    def __call__(self, endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        if self.command is not None:
            return self.command(endpoint, api_key, step)
        r = self.resolved
        assert r is not None
        rung = r.step_down(step)
        if rung is None:
            return None
        return r.render(endpoint=dataclasses.replace(endpoint, why=self.endpoint.why),
                        api_key=api_key, cfg=rung, slot_save_path=self.slot_save_path,
                        webui=self.webui)

    @property
    def socket(self) -> Path | None:
        return Path(self.endpoint.socket) if self.endpoint.socket is not None else None

    def companion_config(self, c: CompanionRun) -> SupervisorConfig:
        """A companion's supervisor settings: the chat model's, with its own log file."""
        return dataclasses.replace(self.supervisor, log_file=c.log_file())

    def with_plan(self) -> Runtime:
        """This runtime with its memory plan, where it was left for later: without a device
        to fit into, the plan can refuse nothing and chooses nothing, so it is made once
        llama-server is starting, for the summary only (and the step-down ladder's order)."""
        r = self.resolved
        if r is None or r.planned:
            return self
        try:
            planned = resolve.ensure_plan(r)
        except Exception as exc:  # informational only: never stop serving over it
            return dataclasses.replace(
                self, info=dataclasses.replace(self.info, memory_plan=f"not planned ({exc})"))
        return dataclasses.replace(self, resolved=planned, info=dataclasses.replace(
            self.info, memory_plan=planned.memory_text))


def load_runtime(settings: Settings,
                 slot_save_path: Path | None | Literal["settings"] = "settings",
                 running: Runtime | None = None) -> Runtime:
    """Every check `up` makes before starting anything, and all it derives: the one resolve
    (decide/resolve.py) on this machine, binary and profile, the supervisor's and the front's
    settings. Raises ConfigError and starts nothing.

    slot_save_path: the KV snapshot directory llama-server saves slots in, decided here once:
    "settings" for the settings' own `persist.dir` (None when persistence is off) — the
    directory of the store a new service opens —, else the directory of the store a running
    service keeps across a reload (None: no store). running: the runtime a reload replaces; the
    RAM it read before it started its children (which hold some of it now) sizes the cache."""
    check_open_listen(settings)  # first: before a binary is even asked for its --help
    inp = inputs.gather(settings.profile, model=settings.model, binary=settings.binary,
                        replay=settings.hw_replay)
    then = running.resolved.inputs.snapshot if running and running.resolved else None
    if then is not None and inp.snapshot is not None and then.source == inp.snapshot.source:
        inp = dataclasses.replace(inp, snapshot=dataclasses.replace(
            inp.snapshot, ram_available=then.ram_available, ram_read_at=then.ram_read_at))
    skip = settings.plan == "skip"
    r = inputs.resolve_inputs(inp, plan=False if skip else None)
    warnings = list(inp.warnings)
    if skip:
        r = dataclasses.replace(r, plan_text="skipped (--no-plan)")
        if resolve.on_device(inp.profile, inp.snapshot):
            warnings.append("the memory plan is skipped (--no-plan): this GPU launch is not "
                            "checked against the GPU's free memory")
    cfg = r.launch
    pcfg = persist_config(settings)
    snapshots = pcfg.directory if pcfg is not None else None
    listen = upstream_endpoint(r)
    # spells every flag now, with the settings' own persist.dir: a bad one fails here
    webui_on = "webui" in [*inp.profile.proxy.get("enable_paths", []),
                           *settings.proxy.get("enable_paths", [])]
    first = r.render(endpoint=dataclasses.replace(listen, port=listen.port or 0),
                     api_key="x", slot_save_path=snapshots, webui=webui_on)
    companions = []
    for c in r.companions:
        where = upstream_endpoint(r, c.name)
        # spelled now too: a binary without --embeddings or --reranking fails here
        r.render(cfg=c.launch, api_key="x",
                 endpoint=dataclasses.replace(where, port=where.port or 0))
        companions.append(CompanionRun(
            name=c.name, role=c.role, model=c.launch.model, slots=c.launch.slots, resolved=r,
            endpoint=where, plan=c.plan_text, n_vocab=c.n_vocab))

    depth = _per_request_depth(inp.manifest)
    webui = (inp.manifest.webui or {}) if inp.manifest is not None else {}
    info = ServeInfo(
        profile=inp.profile.name, profile_reason=inp.profile_reason,
        binary=str(inp.binary), commit=inp.commit, model=str(cfg.model),
        context=cfg.context, kv=f"{cfg.cache_k} / {cfg.cache_v}",
        n_vocab=r.facts.n_vocab if r.facts is not None and r.facts.n_vocab > 0 else None,
        speculation_type=cfg.spec_type or "none", speculation=inp.profile.spec,
        per_request_depth=depth[0], per_request_depth_detail=depth[1],
        near_edge=bool(r.near_edge),
        memory_plan=r.memory_text, log_file=str(child_log_file()),
        webui=webui.get("in_binary"), webui_why=str(webui.get("why") or ""),
        upstream=listen.transport, upstream_why=listen.why,
        lacks=inp.manifest.lacks() if inp.manifest is not None else (),
        documents=r.documents.to_dict() if r.documents is not None else None)
    values = {**settings.supervisor, **settings.layered("supervisor", inp.profile.supervisor)}
    runtime = Runtime(
        settings=settings, info=info,
        supervisor=build_supervisor_config(values, near_edge=info.near_edge,
                                           log_file=child_log_file()),
        front=proxy_config(settings, inp.profile.proxy, cfg.slots), resolved=r,
        slot_save_path=snapshots if isinstance(slot_save_path, str) else slot_save_path,
        webui=webui_on, endpoint=listen, companions=tuple(companions),
        warnings=(*warnings, *first.warnings),
        exit_on_failed=values.get("exit_on_failed", "auto"))
    audit_config(settings)
    return runtime


def upstream_endpoint(r: Resolved, companion: str | None = None) -> Endpoint:
    """Where this launch's llama-server (or its companion named `companion`) listens: its UNIX
    socket (`supervision.sockets.socket_place`) when the binary binds one, else loopback TCP;
    the port is the supervisor's."""
    caps = r.inputs.caps
    place = (sockets.socket_place() if companion is None
             else sockets.socket_place(name=f"companion-{companion}.sock"))
    if caps is None:
        return Endpoint(why="loopback TCP: no binary to ask")
    return listen_on(caps, str(place.path), socket_why=place.why)


def _per_request_depth(manifest: Manifest | None) -> tuple[str, str]:
    """Whether the binary honours a request's own draft depth, as `mtpwrap build` probed it
    (ServeInfo's fields; unknown for a binary it did not build)."""
    probe = (manifest.spec_depth or {}) if manifest is not None else {}
    return str(probe.get("status") or "unknown"), str(probe.get("detail") or "")


def child_log_file() -> Path:
    """Where llama-server's whole output goes (rotated; `supervisor.log_*`)."""
    return paths.log_dir() / "llama-server.log"


def supervisor_config(settings: Settings, profile: Mapping[str, Any] | None = None, *,
                      near_edge: bool = False) -> SupervisorConfig:
    """The `supervisor.*` settings: flag, variable or config file, else the profile's section,
    else the default."""
    values = {**settings.supervisor, **settings.layered("supervisor", dict(profile or {}))}
    return build_supervisor_config(values, near_edge=near_edge, log_file=child_log_file())


def proxy_config(settings: Settings, profile: Mapping[str, Any], slots: int) -> ProxyConfig:
    """The front's configuration, checked before anything starts (proxy.max_concurrency is
    refused where a file sets it: the front sends llama-server at most its slots)."""
    paths_on = [*profile.get("enable_paths", []), *settings.proxy.get("enable_paths", [])]
    if "slot-actions" in paths_on and settings.persist["enabled"]:
        raise ConfigError(
            f"{settings.proxy_source}: proxy.enable_paths: slot-actions would let clients "
            "read and write files in the directory that holds mtpwrap's KV snapshots; remove "
            "slot-actions, or turn snapshots off with persist.enabled: false.")
    mapping = {"listen_host": settings.host, **settings.layered("proxy", dict(profile)),
               "api_keys": list(settings.api_keys), "max_concurrency": slots}
    return ProxyConfig.from_mapping(mapping, settings.proxy_source)


def check_open_listen(settings: Settings) -> None:
    """A front on an address other than loopback without API keys serves anyone who reaches
    it: refused (ConfigError) unless `allow_open_listen` says the operator means it."""
    if settings.api_keys or settings.allow_open_listen or is_loopback(settings.host):
        return
    src = settings.sources.get("host", "host")
    where = (f"{src} {settings.host}" if src.startswith("--") else
             f"{src}={settings.host}" if src.startswith("MTPWRAP_") else
             f"{src}: host {settings.host}")
    raise ConfigError(
        f"{where}: the front would listen beyond loopback with no API keys configured, open to "
        "anyone who can reach it.",
        hint="Set api_key_file (or MTPWRAP_API_KEYS), listen on 127.0.0.1, or allow an open "
             "front explicitly with --allow-open-listen true (MTPWRAP_ALLOW_OPEN_LISTEN=true).")


def audit_config(settings: Settings) -> AuditConfig:
    """The audit trail's settings (`audit:`), its directory created (0700) or journald's socket
    found; ConfigError before anything starts otherwise."""
    cfg = AuditConfig(**settings.audit)
    if cfg.sink == "journald":
        from mtpwrap.front.audit import JOURNAL_SOCKET

        if not Path(JOURNAL_SOCKET).exists():
            raise ConfigError(f"audit.sink: journald, but there is no journald socket at "
                              f"{JOURNAL_SOCKET}.",
                              hint="Run under systemd, or set audit.sink: file.")
    try:
        cfg.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = cfg.directory / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"audit.dir: cannot use {cfg.directory} for the audit trail and "
                          f"the budgets' counts ({exc.strerror}).",
                          hint="Point audit.dir at a directory the service user can write.") \
            from exc
    return cfg


def make_front(supervisor: Supervisor, runtime: Runtime, audit: AuditConfig | None = None,
               companions: Mapping[str, Supervisor] | None = None,
               documents: Documents | None = None) -> Front:
    """The front for this runtime; `companions`: each companion's supervisor, by name."""
    # Imported here: the ASGI stack loads while llama-server does (see Service.startup).
    from mtpwrap.front.app import Front
    from mtpwrap.front.companions import CompanionInfo

    sups = companions or {}
    return Front(supervisor, runtime.front, runtime.info, audit,
                 companions=[(CompanionInfo(c.name, c.role, c.model, c.slots, c.n_vocab),
                              sups[c.name])
                             for c in runtime.companions if c.name in sups],
                 documents=documents)


# --------------------------------------------------------------------------- KV snapshots

def persist_config(settings: Settings) -> PersistConfig | None:
    """The snapshot settings (`persist:`); None when persistence is off."""
    cfg = PersistConfig(**settings.persist)
    return cfg if cfg.enabled else None


def open_store(settings: Settings, info: ServeInfo) -> tuple[Shelf | None, Documents | None]:
    """The document store's directory, created 0700, and its decisions; (None, None) when
    persistence is off."""
    from mtpwrap.front.store import Documents, Shelf

    pcfg = persist_config(settings)
    if pcfg is None:
        return None, None
    shelf = Shelf(pcfg)
    try:
        shelf.open()
    except OSError as exc:
        raise ConfigError(f"persist.dir: cannot use {pcfg.directory} for the document store "
                          f"({exc.strerror}).",
                          hint="Point persist.dir at a directory the service user can create, "
                               "or set persist.enabled: false.") from exc
    return shelf, Documents(shelf)
