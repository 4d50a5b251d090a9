"""`mtpwrap up`: settings → hardware → profile → plan → argv → supervisor + HTTP front.

One asyncio loop runs the supervisor (which owns llama-server), the HTTP front (uvicorn) and
mtpwrap's own service loop (sd_notify WATCHDOG/STATUS, the state file). Signal handlers only
set flags; the shutdown order is fixed: readiness drops (DRAINING) → STOPPING=1 → the front
drains in-flight requests within the drain budget → the supervisor stops llama-server
(SIGTERM, bounded wait, SIGKILL of its group) → the front closes → the state file goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.config.objects import PersistConfig, ProxyConfig, SupervisorConfig
from mtpwrap.config.objects import supervisor_config as build_supervisor_config
from mtpwrap.config.settings import Settings, load_settings
from mtpwrap.decide.vocab import SPELLINGS
from mtpwrap.errors import ConfigError, MtpwrapError
from mtpwrap.run import instance
from mtpwrap.run.child import ChildSpec
from mtpwrap.run.persist import SnapshotStore
from mtpwrap.run.supervisor import LaunchFactory, State, Supervisor
from mtpwrap.run.systemd import Notifier

log = logging.getLogger("mtpwrap.runner")



@dataclass
class Launch:
    """Everything `up` decided before starting anything."""

    factory: LaunchFactory
    info: dict[str, Any]  # static facts: summary, /healthz, state file
    decisions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    supervisor: dict[str, Any] = field(default_factory=dict)  # profile's supervisor settings
    proxy: dict[str, Any] = field(default_factory=dict)  # profile's proxy settings
    slots: int = 1  # llama-server's -np: the front forwards at most this many requests at once
    #: work that only informs (the summary), run once llama-server is starting
    deferred: Callable[[], None] | None = None
    resolved: Any = None  #: the decide.resolve.Resolved this launch renders


# --------------------------------------------------------------------------- resolving


def resolve_launch(settings: Settings) -> Launch:
    """`up`'s launch: the one resolve (decide/resolve.py) on this machine, binary and profile,
    and the factory the supervisor calls for each start (port, key, step-down rung)."""
    from mtpwrap.decide import resolve

    inp = resolve.gather(settings.profile, model=settings.model, binary=settings.binary,
                         replay=settings.hw_replay)
    skip = settings.plan == "skip"
    r = resolve.resolve_inputs(inp, plan=False if skip else None)
    gpu = resolve.on_device(inp.profile, inp.snapshot)
    warnings = list(inp.warnings)
    if skip:
        r.plan_text = "skipped (--no-plan)"
        if gpu:
            warnings.append("the memory plan is skipped (--no-plan): this GPU launch is not "
                            "checked against the GPU's free memory")
    cfg = r.launch
    first = r.render(port=0, api_key="x")  # spells every flag now: a bad one fails here

    def factory(port: int, api_key: str, step: int) -> ChildSpec | None:
        rung = r.step_down(step)
        if rung is None:
            return None
        spec = r.render(port=port, api_key=api_key, cfg=rung)
        return ChildSpec(argv=spec.argv, env=spec.env, note=rung.note or "", launch=rung)

    info: dict[str, Any] = {
        "profile": inp.profile.name, "profile_reason": inp.profile_reason,
        "binary": str(inp.binary), "commit": inp.commit, "model": cfg.model,
        "context": cfg.context, "kv": f"{cfg.cache_k} / {cfg.cache_v}",
        "speculation": cfg.spec_type or "none", "near_edge": r.near_edge,
        "memory_plan": r.memory_text,
    }
    info["spec_policy"] = _spec_policy_info(inp.profile, inp.manifest)
    result = Launch(factory=factory, info=info,
                    decisions=[f"{d.flag} {d.value or ''}".strip() + f": {d.reason}"
                               for d in first.decisions],
                    warnings=[*warnings, *first.warnings],
                    supervisor=dict(inp.profile.supervisor), proxy=dict(inp.profile.proxy),
                    slots=cfg.slots, resolved=r)
    if not r.planned and not skip:
        # Without a device to fit into, the plan can refuse nothing and chooses nothing; it is
        # made after llama-server has started, for the summary only.
        def plan_later() -> None:
            try:
                info["memory_plan"] = resolve.ensure_plan(r).memory_text
            except Exception as exc:  # informational only: never stop serving over it
                info["memory_plan"] = f"not planned ({exc})"

        result.deferred = plan_later
    return result


def supervisor_values(settings: Settings, launch: Launch) -> dict[str, Any]:
    """The `supervisor.*` settings: flag, variable or config file, else the profile's section,
    else the default."""
    return {**settings.supervisor, **settings.layered("supervisor", launch.supervisor)}


def supervisor_config(settings: Settings, launch: Launch) -> SupervisorConfig:
    return build_supervisor_config(supervisor_values(settings, launch),
                                   near_edge=bool(launch.info.get("near_edge")),
                                   log_file=paths.log_dir() / "llama-server.log")


# --------------------------------------------------------------------------- reload

#: llama-server's directory for slot files: mtpwrap's snapshot directory, never a client's
#: (a profile's extra_args may not set it: decide.launch.RESERVED)
SLOT_SAVE_FLAG = SPELLINGS["slot_save_path"][0]


def persist_config(settings: Settings) -> PersistConfig | None:
    """The snapshot settings (`persist:`); None when persistence is off."""
    cfg = PersistConfig(**settings.persist)
    return cfg if cfg.enabled else None


def with_slot_save_path(factory: LaunchFactory, directory: Path) -> LaunchFactory:
    """The factory whose commands also name mtpwrap's snapshot directory."""
    def wrapped(port: int, api_key: str, step: int) -> ChildSpec | None:
        spec = factory(port, api_key, step)
        if spec is None:
            return None
        return dataclasses.replace(spec, argv=[*spec.argv, SLOT_SAVE_FLAG, str(directory)])
    return wrapped


def reload_inputs(settings: Settings) -> dict[str, Any]:
    """What `load_settings` needs to read the same settings again: the flags given, the
    MTPWRAP_* variables that set a key, the config file. No secrets (API keys are read from
    their file or variable again)."""
    cli: dict[str, Any] = {}
    env: dict[str, str] = {}
    for key, source in settings.sources.items():
        if source.startswith("--"):
            value = settings.value(key)
            cli[key] = list(value) if isinstance(value, tuple) else value
        elif source.startswith("MTPWRAP_") and source in os.environ:
            env[source] = os.environ[source]
    return {"cli": cli, "env": env,
            "config": str(settings.config_file) if settings.config_file else None}


def reread_settings(inputs: dict[str, Any]) -> Settings:
    env = {**os.environ, **dict(inputs.get("env") or {})}
    return load_settings(dict(inputs.get("cli") or {}), env=env, config=inputs.get("config"))


def prepare(settings: Settings) -> tuple[Launch, SupervisorConfig, ProxyConfig]:
    """Every check `up` makes before starting anything, for a new configuration: the launch,
    the supervisor's and the front's settings. Raises ConfigError and starts nothing."""
    launch = resolve_launch(settings)
    cfg = supervisor_config(settings, launch)
    front_config = proxy_config(settings, launch)
    return launch, cfg, front_config


def child_factory(launch: Launch, store: SnapshotStore | None) -> LaunchFactory:
    if store is None:
        return launch.factory
    return with_slot_save_path(launch.factory, store.directory)


# --------------------------------------------------------------------------- serving


def bind_public(host: str, port: int) -> socket.socket:
    """Bind the public socket before anything starts, so a port in use is a clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve ({exc.strerror}).") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {host}:{port} is already in use.",
                              hint="Choose another port with --port (MTPWRAP_PORT), or stop "
                                   "what holds it (`mtpwrap down`).") from exc
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: not allowed to bind {host}:{port}.",
                              hint="Use a port above 1023.") from exc
        raise ConfigError(f"--host {host}: cannot bind {host}:{port} ({exc.strerror}).") from exc
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def public_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    return f"http://{shown}:{port}"


def proxy_config(settings: Settings, launch: Launch) -> ProxyConfig:
    """The front's configuration, checked before anything starts (proxy.max_concurrency is
    refused where a file sets it: the front sends llama-server at most its slots)."""
    paths_on = [*launch.proxy.get("enable_paths", []), *settings.proxy.get("enable_paths", [])]
    if "slot-actions" in paths_on and settings.persist["enabled"]:
        raise ConfigError(
            f"{settings.proxy_source}: proxy.enable_paths: slot-actions would let clients "
            "read and write files in the directory that holds mtpwrap's KV snapshots; remove "
            "slot-actions, or turn snapshots off with persist.enabled: false.")
    mapping = {"listen_host": settings.host, **settings.layered("proxy", launch.proxy),
               "api_keys": list(settings.api_keys), "max_concurrency": launch.slots}
    return ProxyConfig.from_mapping(mapping, settings.proxy_source)


def make_front(supervisor: Supervisor, launch: Launch, config: ProxyConfig) -> Any:
    from mtpwrap.serve.front import Front

    return Front(supervisor, config, launch.info)


@contextlib.contextmanager
def _signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
             force: asyncio.Event) -> Iterator[None]:
    def handler(signum: int) -> None:
        # Only flags here; the shutdown sequence runs in the main coroutine.
        if stop.is_set():
            log.warning("second %s: skipping the rest of the drain",
                        signal.Signals(signum).name)
            force.set()
        else:
            log.info("%s received: shutting down", signal.Signals(signum).name)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def _reload_signals(loop: asyncio.AbstractEventLoop,
                    handler: Callable[[str], None]) -> Iterator[None]:
    """SIGHUP: reload the configuration; SIGUSR2: restart llama-server as it is."""
    kinds = {signal.SIGHUP: "reload", signal.SIGUSR2: "restart"}
    for sig, kind in kinds.items():
        loop.add_signal_handler(sig, handler, kind)
    try:
        yield
    finally:
        for sig in kinds:
            loop.remove_signal_handler(sig)


def open_snapshots(settings: Settings) -> SnapshotStore | None:
    """The snapshot directory, created 0700 and emptied; None when persistence is off."""
    pcfg = persist_config(settings)
    if pcfg is None:
        return None
    store = SnapshotStore(pcfg)
    try:
        store.open()
    except OSError as exc:
        raise ConfigError(f"persist.dir: cannot use {pcfg.directory} for KV snapshots "
                          f"({exc.strerror}).",
                          hint="Point persist.dir at a directory the service user can create, "
                               "or set persist.enabled: false.") from exc
    return store


@dataclass
class ReloadResult:
    outcome: str  # "ok" | "refused" | "failed"
    message: str
    exit_code: int
    launch: Launch | None = None
    config: SupervisorConfig | None = None
    settings: Settings | None = None


async def apply_reload(kind: str, sup: Supervisor, store: SnapshotStore | None,
                       inputs: dict[str, Any], settings: Settings, front_config: ProxyConfig
                       ) -> ReloadResult:
    """`restart`: the same command again. `reload`: re-read the settings and the profile,
    check them like `up` does (a refusal leaves the running child untouched), then swap."""
    if kind == "restart":
        ok, message = await sup.reload(None, settings.drain_s)
        return ReloadResult("ok" if ok else "failed", message, 0 if ok else 1)
    try:
        new_settings = await asyncio.to_thread(reread_settings, inputs)
        launch, cfg, new_front = await asyncio.to_thread(prepare, new_settings)
    except MtpwrapError as exc:
        return ReloadResult("refused", f"not reloaded, llama-server left as it was: {exc}",
                            exc.exit_code)
    notes = []
    if (new_settings.host, new_settings.port) != (settings.host, settings.port):
        notes.append("the listen address changes only when mtpwrap restarts")
    if new_front != front_config:
        notes.append("proxy settings change only when mtpwrap restarts")
    if persist_config(new_settings) != (store.config if store is not None else None):
        notes.append("persist settings change only when mtpwrap restarts")
    ok, message = await sup.reload(child_factory(launch, store), new_settings.drain_s)
    message = "; ".join([message, *notes])
    if not ok:
        return ReloadResult("failed", message, 1)
    return ReloadResult("ok", message, 0, launch, cfg, new_settings)


async def serve(settings: Settings, launch: Launch, sock: socket.socket,
                notifier: Notifier | None = None, front_config: ProxyConfig | None = None,
                announce: Callable[[], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT. 0 after a clean stop, 1 after a runtime failure."""
    notifier = notifier or Notifier()
    if front_config is None:
        front_config = proxy_config(settings, launch)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    cfg = supervisor_config(settings, launch)
    inputs = reload_inputs(settings)
    store = open_snapshots(settings)
    sup = Supervisor(child_factory(launch, store), cfg, snapshots=store)
    url = public_url(settings.host, settings.port)
    t0 = time.monotonic()
    first_ready = asyncio.Event()
    exit_code = 0
    exit_on_failed = supervisor_values(settings, launch)["exit_on_failed"]
    if exit_on_failed == "auto":
        exit_on_failed = notifier.enabled  # under systemd its restart policy decides
    base = {"pid": os.getpid(), "url": url, "host": settings.host, "port": settings.port,
            "profile": launch.info.get("profile"), "model": launch.info.get("model"),
            "binary": launch.info.get("binary"), "log_file": str(cfg.log_file),
            "drain_s": settings.drain_s, "stop_grace_s": cfg.stop_grace_s,
            "reload_inputs": inputs,
            "persist_dir": str(store.directory) if store is not None else None}
    reload_state: dict[str, Any] = {"generation": 0, "result": None, "message": None}

    def record() -> None:
        st = sup.status()
        # SupervisorStatus.pid is the child's; the file's pid is mtpwrap's own.
        data = {**st.to_dict(), **sup.timeline(), **base, "child_pid": st.pid,
                "child_pgid": st.pid, "updated_at": time.time(), "reload": reload_state,
                "persist": sup.persist_report}
        with contextlib.suppress(OSError):
            instance.write_instance(data)

    def on_state(old: State, new: State, reason: str | None) -> None:
        record()
        if new is State.READY and not first_ready.is_set():
            first_ready.set()
            took = time.monotonic() - t0
            log.info("ready in %.2fs: %s/v1", took, url)
            notifier.ready(f"ready: {launch.info.get('profile')} at {url}")
        else:
            notifier.status(f"{new.value}" + (f": {reason}" if reason else ""))
        if new is State.FAILED and exit_on_failed:
            log.error("failed: exiting 1 so that the service manager's restart policy takes "
                      "over (supervisor.exit_on_failed)")
            stop.set()

    sup.add_listener(on_state)
    sup.on_persist = record
    record()
    # Start llama-server first and import the HTTP stack while it loads: the imports cost
    # a few hundred milliseconds that would otherwise add to the time to ready.
    await sup.start()
    for _ in range(200):
        if sup.status().pid is not None or sup.state is not State.STARTING:
            break
        await asyncio.sleep(0.005)
    if announce is not None:
        announce()  # the summary, printed while llama-server loads
    try:
        import uvicorn

        front = make_front(sup, launch, front_config)
        server_config = front.server_config(timeout_graceful_shutdown=5)
        sup.busy = lambda: front.forwarding
        front.info["reload"] = reload_state
    except BaseException:
        await sup.stop()  # never leave a child behind a front that could not start
        raise

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # mtpwrap owns the signals (see `_signals`)

    server = _Server(server_config)

    async def service_loop() -> None:
        # WATCHDOG=1 comes from this loop, not from the child's health: a crashed child is
        # the supervisor's job, a hung mtpwrap is systemd's.
        interval = notifier.watchdog_interval()
        extend_every = 5.0
        next_extend = 0.0
        while True:
            if interval:
                notifier.watchdog()
            now = time.monotonic()
            if not first_ready.is_set() and sup.state is not State.FAILED \
                    and now >= next_extend:
                # The model may take minutes to load; each progress-bounded wait extends the
                # start timeout (the supervisor's stall timer decides what is stuck). Once
                # failed, nothing is loading: TimeoutStartSec may act again.
                notifier.extend_timeout(cfg.load_stall_s + 30)
                next_extend = now + extend_every
            await asyncio.sleep(min(interval or 1.0, 1.0))

    requests: asyncio.Queue[str] = asyncio.Queue()

    async def reload_loop() -> None:
        nonlocal launch, settings
        while True:
            kind = await requests.get()
            if stop.is_set():
                return
            reload_state.update(generation=reload_state["generation"] + 1, kind=kind,
                                result="running", message=None, exit_code=None,
                                started_at=time.time(), finished_at=None)
            record()
            notifier.status(f"{kind}ing llama-server")
            try:
                res = await apply_reload(kind, sup, store, inputs, settings,
                                         front_config)
            except Exception as exc:  # a reload must never take the service down
                log.exception("%s failed", kind)
                res = ReloadResult("failed", f"{kind} failed: {exc}", 1)
            if res.launch is not None and res.config is not None and res.settings is not None:
                # The new drain budgets count from now on; the listen address and the front's
                # settings stay until mtpwrap restarts (the message says so).
                launch = res.launch
                settings = dataclasses.replace(res.settings, host=settings.host,
                                               port=settings.port)
                sup.config = res.config
                base.update(drain_s=settings.drain_s, stop_grace_s=res.config.stop_grace_s)
                base.update(profile=launch.info.get("profile"), model=launch.info.get("model"),
                            binary=launch.info.get("binary"))
                front.info.update(launch.info)
            reload_state.update(result=res.outcome, message=res.message,
                                exit_code=res.exit_code, finished_at=time.time())
            front.metrics.reloads.labels(res.outcome).inc()
            (log.info if res.outcome == "ok" else log.warning)("%s %s: %s", kind, res.outcome,
                                                               res.message)
            notifier.status(f"{kind} {res.outcome}: {res.message}"[:200])
            record()

    def on_signal(kind: str) -> None:
        if not stop.is_set():
            log.info("%s requested", kind)
            requests.put_nowait(kind)

    with _signals(loop, stop, force), _reload_signals(loop, on_signal):
        server_task = asyncio.create_task(server.serve(sockets=[sock]), name="front")
        service = asyncio.create_task(service_loop(), name="service")
        reloader = asyncio.create_task(reload_loop(), name="reload")
        waits = [asyncio.create_task(stop.wait()), server_task]
        if settings.ready_timeout_s > 0:
            async def ready_deadline() -> None:
                if await sup.wait_ready(settings.ready_timeout_s) is None and not stop.is_set():
                    log.error("not ready within %.0fs (%s)", settings.ready_timeout_s,
                              sup.status().reason)
                    stop.set()
            waits.append(asyncio.create_task(ready_deadline()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done():
            exit_code = 1
            exc = server_task.exception() if not server_task.cancelled() else None
            log.error("the HTTP front stopped unexpectedly: %s", exc)
        elif sup.state is State.FAILED or (settings.ready_timeout_s > 0
                                           and not first_ready.is_set()):
            exit_code = 1

        # The documented shutdown order.
        if settings.drain_grace_s > 0 and not force.is_set():
            # Leave the balancer's rotation first: readiness drops, requests are still served.
            front.leaving = True
            notifier.status(f"leaving rotation for {settings.drain_grace_s:g}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(force.wait(), settings.drain_grace_s)
        sup.begin_drain()
        notifier.stopping("draining: finishing in-flight requests")
        drain_task = asyncio.create_task(front.drain(settings.drain_s))
        force_task = asyncio.create_task(force.wait())
        await asyncio.wait([drain_task, force_task], timeout=settings.drain_s + 5,
                           return_when=asyncio.FIRST_COMPLETED)
        for t in (drain_task, force_task):
            t.cancel()
        notifier.status("stopping llama-server")
        reloader.cancel()
        await sup.stop(0.0 if force.is_set() else sup.config.stop_grace_s)
        if store is not None:
            store.clear()  # a clean stop: the snapshots (the clients' prompts) go
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server_task, 10)
        aclose = getattr(front, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        service.cancel()
        for t in waits:
            t.cancel()
        with contextlib.suppress(OSError):
            instance.instance_path().unlink()
        notifier.status("stopped")
    return exit_code


# --------------------------------------------------------------------------- entry points


def _configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_mtpwrap", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: "
                                               "%(message)s"))
        handler._mtpwrap = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Access lines carry paths and client addresses, nothing the journal needs by default.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def summary_lines(settings: Settings, launch: Launch) -> list[str]:
    i = launch.info
    keys = (f"{len(settings.api_keys)} API key(s) required" if settings.api_keys
            else "no API keys: open to anyone who can reach it")
    rows = [
        ("profile", f"{i.get('profile')} ({i.get('profile_reason')})"),
        ("binary", f"{i.get('binary')}" + (f" (commit {i['commit']})" if i.get("commit") else "")),
        ("model", i.get("model")),
        ("context", i.get("context")),
        ("KV cache", i.get("kv")),
        ("speculation", i.get("speculation")),
        ("memory plan", i.get("memory_plan")),
        ("URL", f"{public_url(settings.host, settings.port)}/v1 ({keys})"),
        ("logs", str(paths.log_dir() / "llama-server.log")),
        ("snapshots", str(snaps.directory) if (snaps := persist_config(settings)) else "off"),
    ]
    out = ["mtpwrap up"] + [f"  {k:<12} {v}" for k, v in rows]
    out += [f"  warning: {w}" for w in launch.warnings]
    return out


def run_up(settings: Settings) -> int:
    """`mtpwrap up`: every check that can fail on bad input runs before anything starts."""
    _configure_logging(settings.log_level)
    previous = instance.read_instance()
    if instance.instance_running(previous):
        assert previous is not None
        raise ConfigError(f"an mtpwrap instance is already running (pid {previous['pid']}, "
                          f"{previous.get('url')}).",
                          hint="Stop it with `mtpwrap down`, or set MTPWRAP_STATE_DIR to run "
                               "another one beside it.")
    instance.reap_leftovers(previous)
    launch, _, front_config = prepare(settings)
    sock = bind_public(settings.host, settings.port)

    def announce() -> None:
        from mtpwrap import console

        if launch.deferred is not None:
            launch.deferred()
        for line in summary_lines(settings, launch):
            console.out.print(line, markup=False)

    try:
        return asyncio.run(serve(settings, launch, sock, front_config=front_config,
                                 announce=announce))
    finally:
        sock.close()


def _spec_policy_info(prof: Any, manifest: Any) -> dict[str, Any] | None:
    """What the front's speculation policy needs: the profile's spec and whether the binary
    honours a request's own draft depth (recorded by `mtpwrap build`; unknown otherwise)."""
    from mtpwrap.serve import spec_policy

    status = (manifest.spec_depth or {}).get("status") if manifest is not None else None
    return spec_policy.launch_info(prof.to_dict()["spec"], status)
