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
from mtpwrap.errors import ConfigError
from mtpwrap.run import instance
from mtpwrap.run.child import ChildSpec
from mtpwrap.run.supervisor import LaunchFactory, State, Supervisor, SupervisorConfig
from mtpwrap.run.systemd import Notifier
from mtpwrap.settings import SUPERVISOR, Settings, convert

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


# --------------------------------------------------------------------------- resolving


def resolve_launch(settings: Settings) -> Launch:
    """The one place that asks hardware, profiles, the planner and the launch builder."""
    from mtpwrap.build import builder
    from mtpwrap.decide import models

    binary = builder.find_binary(explicit=settings.binary)
    manifest = builder.load_manifest()
    built = manifest.binaries.get("llama-server", {}).get("path") if manifest else None
    if built != str(binary):
        manifest = None  # another binary (--binary, MTPWRAP_LLAMA_SERVER): its own facts count
    commit = manifest.commit if manifest is not None else None
    from mtpwrap.decide import capabilities, hardware, launch, profiles

    snap = hardware.snapshot()
    if settings.profile == "auto":
        prof, why = profiles.select_profile(snap)
    else:
        prof, why = profiles.load_profile(settings.profile), "chosen with --profile"
    what = "--model" if settings.model else f"profile {prof.name}: model"
    model = models.resolve_model(settings.model or prof.model, what=what)
    caps = (capabilities.Capabilities.from_dict(manifest.capabilities)
            if manifest is not None and manifest.capabilities
            else capabilities.probe(binary))
    # The flags that do not depend on the plan (KV types the binary offers, speculation):
    # building them first also makes a bad profile or a missing capability fail right here.
    first = launch.build_command(prof, caps, snap, model=model, listen_host="127.0.0.1",
                                 listen_port=0, api_key="x", plan=None, binary=binary)
    chosen = {d.flag: d.value for d in first.decisions}
    kv_sizes = _kv_sizes(manifest)
    gpus = list(getattr(snap, "gpus", None) or [])
    if prof.context == "max" or (gpus and prof.hardware.requires_gpu):
        plan, plan_text = _memory_plan(prof, model, snap, chosen, kv_sizes)
        if plan is not None:
            first = launch.build_command(prof, caps, snap, model=model, listen_host="127.0.0.1",
                                         listen_port=0, api_key="x", plan=plan, binary=binary)
    else:
        # Without a device to fit into, the plan can refuse nothing and chooses nothing; it is
        # made after llama-server has started, for the summary only (it costs the `gguf`
        # package's import, a few hundred milliseconds of time to ready).
        plan, plan_text = None, None

    def factory(port: int, api_key: str, step: int) -> ChildSpec | None:
        spec = launch.build_command(prof, caps, snap, model=model, listen_host="127.0.0.1",
                                    listen_port=port, api_key=api_key, plan=plan, binary=binary)
        return step_down(ChildSpec(argv=spec.argv, env=spec.env), step)

    values = {d.flag: d.value for d in first.decisions}
    slots = values.get("-np") or values.get("--parallel") or 1
    info = {
        "profile": prof.name, "profile_reason": why, "binary": str(binary),
        "commit": commit or getattr(caps, "commit", None),
        "model": str(model), "context": values.get("-c") or values.get("--ctx-size"),
        "kv": f"{values.get('-ctk') or values.get('--cache-type-k')} / "
              f"{values.get('-ctv') or values.get('--cache-type-v')}",
        "speculation": values.get("--spec-type") or "none", "memory_plan": plan_text,
    }
    info["spec_policy"] = _spec_policy_info(prof, manifest)
    result = Launch(factory=factory, info=info,
                    decisions=[f"{d.flag} {d.value or ''}".strip() + f": {d.reason}"
                               for d in first.decisions],
                    warnings=list(first.warnings), supervisor=dict(prof.supervisor),
                    proxy=dict(prof.proxy), slots=int(slots))
    if plan_text is None:
        def plan_later() -> None:
            try:
                info["memory_plan"] = _memory_plan(prof, model, snap, chosen, kv_sizes)[1]
            except Exception as exc:  # informational only: never stop serving over it
                info["memory_plan"] = f"not planned ({exc})"

        result.deferred = plan_later
    return result


def _kv_sizes(manifest: Any) -> dict[str, Any] | None:
    """KV type sizes measured from the built binary (fork types such as tbq4_0 included)."""
    from mtpwrap.build.calibrate import load_kv_sizes

    return load_kv_sizes(manifest)


def _memory_plan(prof: Any, model: Path, snap: Any, chosen: dict[str, str | None],
                 kv_sizes: dict[str, Any] | None) -> tuple[Any, str]:
    """The memory plan for this profile, model and GPU, with the KV types the launch chose;
    (None, why not) when it cannot be made. A plan that does not fit is a ConfigError with
    the numbers (nothing starts)."""
    from mtpwrap.decide import gguf_facts, planner

    gpus = list(getattr(snap, "gpus", None) or [])
    on_gpu = bool(gpus) and prof.hardware.requires_gpu
    device = getattr(gpus[0], "memory_free", None) if on_gpu else None
    spec = prof.spec

    def pick(*flags: str, default: str) -> str:
        return next((v for f in flags if (v := chosen.get(f))), default)

    try:
        facts = gguf_facts.read_facts(model)
        n_ctx = prof.context if isinstance(prof.context, int) else 0
        cfg = planner.PlanConfig(
            n_ctx=n_ctx or int(getattr(facts, "n_ctx_train", 0) or 4096),
            type_k=pick("-ctk", "--cache-type-k", default=prof.kv.k[0]),
            type_v=pick("-ctv", "--cache-type-v", default=prof.kv.v[0]),
            n_slots=1 if spec.kind == "mtp" else prof.slots, spec=spec.kind,
            draft_depth=spec.depth or 3,
            type_k_draft=pick("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft",
                              default="f16"),
            type_v_draft=pick("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft",
                              default="f16"),
            ubatch=prof.ubatch or 512, batch=prof.batch or 2048,
            backend="cuda" if on_gpu else "cpu")
        if prof.context == "max" and device:
            n = planner.largest_context(facts, cfg, device, kv_sizes)
            if n > 0:
                from dataclasses import replace

                cfg = replace(cfg, n_ctx=n)
        p = planner.plan(facts, cfg, device, kv_sizes)
    except ConfigError as exc:
        # e.g. a KV type the planner has no size for yet: plan nothing rather than refuse.
        return None, f"not planned ({exc})"
    planner.check_fits(p)
    gib = 2**30
    where = "GPU" if on_gpu else "host"
    text = f"{p.total / gib:.2f} GiB on the {where} at context {p.context:,}"
    if p.headroom is not None:
        text += f", headroom {p.headroom / gib:.2f} GiB"
    return p, text


def step_down(spec: ChildSpec, step: int) -> ChildSpec | None:
    """The `step`-th cheaper variant of a command after out-of-memory starts: half the
    context, then no speculation, then q4_0 KV (steps that do not apply are skipped).
    None when there is no such step."""
    if step <= 0:
        return spec

    def at(argv: list[str], *flags: str) -> int | None:
        return next((i + 1 for i, a in enumerate(argv[:-1]) if a in flags), None)

    def halve_context(argv: list[str]) -> str | None:
        i = at(argv, "-c", "--ctx-size")
        if i is None or not argv[i].isdigit() or int(argv[i]) <= 4096:
            return None
        argv[i] = str(max(4096, int(argv[i]) // 2))
        return f"context {argv[i]}"

    def no_speculation(argv: list[str]) -> str | None:
        if at(argv, "--spec-type") is None:
            return None
        for flag in ("--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "-ctkd",
                     "-ctvd"):
            i = at(argv, flag)
            if i is not None:
                del argv[i - 1:i + 1]
        return "no speculation"

    def cheaper_kv(argv: list[str]) -> str | None:
        changed = False
        for flags in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
            i = at(argv, *flags)
            if i is not None and argv[i] != "q4_0":
                argv[i], changed = "q4_0", True
        return "KV q4_0" if changed else None

    argv = list(spec.argv)
    notes = [n for n in (t(argv) for t in (halve_context, no_speculation, cheaper_kv)) if n]
    if step > len(notes):
        return None
    # Re-apply only the first `step` applicable changes.
    argv = list(spec.argv)
    done: list[str] = []
    for t in (halve_context, no_speculation, cheaper_kv):
        if len(done) == step:
            break
        trial = list(argv)
        note = t(trial)
        if note:
            argv = trial
            done.append(note)
    return ChildSpec(argv=argv, env=spec.env, note=f"step-down {step}: " + ", ".join(done))


def supervisor_config(settings: Settings, launch: Launch) -> SupervisorConfig:
    values = dict(settings.supervisor)
    # The profile's supervisor section fills in what no flag, variable or config file set.
    for key, raw in launch.supervisor.items():
        if key not in SUPERVISOR:
            raise ConfigError(f"profile {launch.info.get('profile')}: supervisor.{key}: "
                              f"unknown key.")
        if settings.sources.get(f"supervisor.{key}") == "default":
            values[key] = convert(raw, SUPERVISOR[key], f"profile {launch.info.get('profile')}",
                                   f"supervisor.{key}")
    rss = int(values.pop("rss_limit_mb")) * 2**20
    values.pop("exit_on_failed")
    return SupervisorConfig(rss_limit_bytes=rss,
                            log_file=paths.log_dir() / "llama-server.log", **values)


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


def proxy_config(settings: Settings, launch: Launch) -> Any:
    """The front's configuration, checked before anything starts. ProxyConfig lives in a
    light module (no ASGI imports), so checking it early costs nothing."""
    from mtpwrap.serve.policy import ProxyConfig

    for where, section in ((f"profile {launch.info.get('profile')}", launch.proxy),
                           (settings.proxy_source, settings.proxy)):
        if "max_concurrency" in section:
            raise ConfigError(
                f"{where}: proxy.max_concurrency: the front sends llama-server at most as many "
                f"requests as it has slots ({launch.slots} here); remove this key and set the "
                "profile's slots instead.")
    mapping = {"listen_host": settings.host, **launch.proxy, **settings.proxy,
               "api_keys": list(settings.api_keys), "max_concurrency": launch.slots}
    return ProxyConfig.from_mapping(mapping, settings.proxy_source)


def make_front(supervisor: Supervisor, launch: Launch, config: Any) -> Any:
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


async def serve(settings: Settings, launch: Launch, sock: socket.socket,
                notifier: Notifier | None = None, front_config: Any = None,
                announce: Callable[[], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT. 0 after a clean stop, 1 after a runtime failure."""
    notifier = notifier or Notifier()
    if front_config is None:
        front_config = proxy_config(settings, launch)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    cfg = supervisor_config(settings, launch)
    sup = Supervisor(launch.factory, cfg)
    url = public_url(settings.host, settings.port)
    t0 = time.monotonic()
    first_ready = asyncio.Event()
    exit_code = 0
    base = {"pid": os.getpid(), "url": url, "host": settings.host, "port": settings.port,
            "profile": launch.info.get("profile"), "model": launch.info.get("model"),
            "binary": launch.info.get("binary"), "log_file": str(cfg.log_file),
            "drain_s": settings.drain_s, "stop_grace_s": cfg.stop_grace_s}

    def record() -> None:
        st = sup.status()
        # SupervisorStatus.pid is the child's; the file's pid is mtpwrap's own.
        data = {**st.to_dict(), **sup.timeline(), **base, "child_pid": st.pid,
                "child_pgid": st.pid, "updated_at": time.time()}
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
        if new is State.FAILED and settings.supervisor.get("exit_on_failed"):
            stop.set()

    sup.add_listener(on_state)
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
            if not first_ready.is_set() and now >= next_extend:
                # The model may take minutes to load; each progress-bounded wait extends the
                # start timeout (the supervisor's stall timer decides what is stuck).
                notifier.extend_timeout(cfg.load_stall_s + 30)
                next_extend = now + extend_every
            await asyncio.sleep(min(interval or 1.0, 1.0))

    with _signals(loop, stop, force):
        server_task = asyncio.create_task(server.serve(sockets=[sock]), name="front")
        service = asyncio.create_task(service_loop(), name="service")
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
        await sup.stop(0.0 if force.is_set() else cfg.stop_grace_s)
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
    launch = resolve_launch(settings)
    supervisor_config(settings, launch)  # validates the profile's supervisor section
    front_config = proxy_config(settings, launch)
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
