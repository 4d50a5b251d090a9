"""`mtpwrap reload` (SIGHUP), `mtpwrap restart` (SIGUSR2) and `mtpwrap documents forget`
(SIGUSR1) of a running `up`.

`restart`: the same command again. `forget`: the same command again (its slots and RAM cache
start empty) and the document store emptied: no document is left in llama-server or on disk.
`reload`: the settings and the profile are read again from what `up` was given (`reload_inputs`: the
flags, the MTPWRAP_* variables that set a key, the config file) and checked as `up` checks them;
a refusal changes nothing. Then the front's API keys (with their scopes, classes and budgets)
are swapped in place (`keys.KeyWatch`), and the supervisor swaps llama-server for the new
command only when the command (argv and environment) differs from the running one's — the same
goes for each companion. The listen address, the front's other settings and the document
store's change only when mtpwrap restarts.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mtpwrap.config.apikeys import key_table
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.config.settings import Settings, load_settings
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.errors import EXIT_CONFIG, MtpwrapError
from mtpwrap.front.store import Shelf
from mtpwrap.service.keys import KeyWatch
from mtpwrap.service.startup import CompanionRun, Runtime, load_runtime, persist_config
from mtpwrap.supervision.state import State
from mtpwrap.supervision.supervisor import LaunchFactory, Supervisor

#: what a reload answers of a llama-server it left running
UNCHANGED = "llama-server unchanged (same command line): not restarted"


class ReloadKind(str, enum.Enum):
    RELOAD = "reload"  # SIGHUP: the configuration read again
    RESTART = "restart"  # SIGUSR2: the same command again
    FORGET = "forget"  # SIGUSR1: the same command again, cold: every document forgotten


class ReloadOutcome(str, enum.Enum):
    RUNNING = "running"
    OK = "ok"
    REFUSED = "refused"  # the new configuration did not pass `up`'s checks
    FAILED = "failed"  # the new llama-server did not start; the previous one is back


@dataclass
class ReloadState:
    """The last reload, for the state file and /healthz."""

    generation: int = 0
    kind: ReloadKind | None = None
    result: ReloadOutcome | None = None
    message: str | None = None
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None

    def begin(self, kind: ReloadKind) -> None:
        self.generation += 1
        self.kind, self.result, self.started_at = kind, ReloadOutcome.RUNNING, time.time()
        self.message = self.exit_code = self.finished_at = None

    def end(self, res: ReloadResult) -> None:
        self.result, self.message, self.exit_code = res.outcome, res.message, res.exit_code
        self.finished_at = time.time()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value if self.kind else None
        out["result"] = self.result.value if self.result else None
        return out


@dataclass
class ReloadResult:
    outcome: ReloadOutcome
    message: str
    exit_code: int
    #: what the service runs on from now on (None: it keeps what it ran on)
    runtime: Runtime | None = None


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


def same_command(running: LaunchFactory, step: int, new: LaunchFactory) -> bool:
    """Whether `new` would start what `running` runs (at its step-down rung `step`): the same
    argv and environment, both rendered on one stand-in endpoint and key (the real ones are
    each start's own)."""
    where = Endpoint(port=0)
    now, then = running(where, "probe-key", step), new(where, "probe-key", 0)
    return (now is not None and then is not None
            and (list(now.argv), dict(now.env)) == (list(then.argv), dict(then.env)))


def _proxy_changes(running: ProxyConfig | None, new: ProxyConfig) -> list[str]:
    """The front's settings that differ, by name; the keys, which a reload swaps, aside."""
    if running is None:
        return []
    return [f.name for f in fields(ProxyConfig)
            if f.name != "api_keys" and getattr(running, f.name) != getattr(new, f.name)]


async def _swap_companions(companions: Mapping[str, Supervisor], runtime: Runtime | None,
                           drain_s: float, unchanged: frozenset[str] = frozenset()
                           ) -> tuple[list[str], list[str]]:
    """Restart every ready companion (with its new command when `runtime` is given), together:
    (what failed, what else to say), one phrase each. A companion whose command is `unchanged`
    is left running; one still starting takes its new command at its start, unrestarted;
    one that has failed stays failed until mtpwrap restarts (the supervisor gave up on it)."""
    factories = {c.name: c for c in runtime.companions} if runtime is not None else {}
    notes: list[str] = []
    asked: list[str] = []
    for name, csup in companions.items():
        state = csup.status().state
        if name in unchanged:
            notes.append(f"companion {name} unchanged: not restarted")
        elif state is State.FAILED:
            notes.append(f"companion {name} has failed and starts again only when mtpwrap "
                         "restarts")
        elif state is not State.READY and runtime is None:
            notes.append(f"companion {name} is {state.value}: not restarted")
        else:
            asked.append(name)
    results = await asyncio.gather(*(companions[n].reload(factories.get(n), drain_s)
                                     for n in asked))
    failed = [f"companion {n}: {msg}" for n, (ok, msg) in zip(asked, results, strict=True)
              if not ok]
    return failed, notes


def _companions_changed(running: Sequence[CompanionRun], new: Sequence[CompanionRun]
                        ) -> str | None:
    """What a reload may not change of the companions (the front routes and admits by it),
    in words; None when it is only what a restart of each child takes (context, threads,
    pooling, device)."""
    def key(c: CompanionRun) -> tuple[str, str, str, int]:
        return c.name, c.role, c.model, c.slots

    now, then = sorted(map(key, running)), sorted(map(key, new))
    if now == then:
        return None
    def show(rows: list[tuple[str, str, str, int]]) -> str:
        return ", ".join(f"{n} ({r}, {Path(m).name}, {k} slot(s))" for n, r, m, k in rows) \
            or "none"
    return f"the companions would change from {show(now)} to {show(then)}"


async def apply_reload(kind: ReloadKind, sup: Supervisor, store: Shelf | None,
                       inputs: dict[str, Any], running: Runtime,
                       front_config: ProxyConfig | None,
                       companions: Mapping[str, Supervisor] | None = None,
                       keys: KeyWatch | None = None) -> ReloadResult:
    """`restart`: the same command again. `reload`: re-read the settings and the profile and
    derive a new runtime as `up` does (a refusal changes nothing), swap the front's keys
    (`keys`), then restart llama-server and the companions (`companions`, by name) whose
    command differs from what `running` (the runtime they run on now) renders. An answer with
    a runtime: the service runs on it from now on."""
    companions, settings = companions or {}, running.settings
    if kind is ReloadKind.FORGET:
        ok, message = await sup.reload(None, settings.drain_s)
        removed = await asyncio.to_thread(store.forget) if store is not None else 0
        if not ok:
            return ReloadResult(ReloadOutcome.FAILED, f"{message}; {removed} kept document "
                                "state(s) removed", 1)
        return ReloadResult(ReloadOutcome.OK, f"{message} cold: its slots and RAM prompt cache "
                            f"are empty, {removed} kept document state(s) removed", 0)
    if kind is ReloadKind.RESTART:
        (ok, message), (failed, notes) = await asyncio.gather(
            sup.reload(None, settings.drain_s),
            _swap_companions(companions, None, settings.drain_s))
        message = "; ".join([message, *failed, *notes])
        return ReloadResult(ReloadOutcome.OK if ok and not failed else ReloadOutcome.FAILED,
                            message, 0 if ok and not failed else 1)
    try:
        new_settings = await asyncio.to_thread(reread_settings, inputs)
        # llama-server keeps the running store's directory (persist settings wait for a restart)
        runtime = await asyncio.to_thread(
            load_runtime, new_settings, store.directory if store is not None else None, running)
    except MtpwrapError as exc:
        return ReloadResult(ReloadOutcome.REFUSED,
                            f"not reloaded, llama-server left as it was: {exc}", exc.exit_code)
    if runtime.socket != sup.socket:
        # the socket (or loopback TCP) is the running service's; the front's pool is bound to it
        return ReloadResult(
            ReloadOutcome.REFUSED, "not reloaded, llama-server left as it was: the new binary "
            f"listens on {runtime.endpoint.describe()}, the running one on "
            f"{'unix socket ' + str(sup.socket) if sup.socket else 'loopback TCP'}; restart "
            "mtpwrap to change where llama-server listens.", EXIT_CONFIG)
    if (change := _companions_changed(running.companions, runtime.companions)) is not None:
        return ReloadResult(
            ReloadOutcome.REFUSED, f"not reloaded, llama-server left as it was: {change}; "
            "restart mtpwrap to add, remove or rename a companion or change its role, model or "
            "slots.", EXIT_CONFIG)
    notes = []
    if (new_settings.host, new_settings.port) != (settings.host, settings.port):
        notes.append("the listen address changes only when mtpwrap restarts")
    if changed := _proxy_changes(front_config, runtime.front):
        notes.append(f"proxy settings ({', '.join(changed)}) change only when mtpwrap "
                     "restarts")
    if persist_config(new_settings) != (store.config if store is not None else None):
        notes.append("persist settings (the document store) change only when mtpwrap "
                     "restarts")
    said = []
    if keys is not None:
        # before any restart: a revoked key is refused now, not once a model has loaded
        swapped = keys.swap(key_table(runtime.front.api_keys, "proxy.api_keys"), "reload")
        keys.follow(new_settings)
        said.append(f"API keys: {swapped}" if swapped else "API keys unchanged")
    old_companions = {c.name: c for c in running.companions}
    unchanged = frozenset(c.name for c in runtime.companions if c.name in old_companions
                          and same_command(old_companions[c.name], 0, c))

    async def chat() -> tuple[bool, str]:
        if same_command(running, sup.status().step, runtime):
            return True, UNCHANGED
        return await sup.reload(runtime, new_settings.drain_s)

    (ok, message), (failed, more) = await asyncio.gather(
        chat(), _swap_companions(companions, runtime, new_settings.drain_s, unchanged))
    message = "; ".join([*said, message, *failed, *more, *notes])
    if not ok:
        return ReloadResult(ReloadOutcome.FAILED, message, 1)
    # the chat model runs the new runtime: the service takes it even when a companion failed
    return ReloadResult(ReloadOutcome.FAILED if failed else ReloadOutcome.OK, message,
                        1 if failed else 0, runtime)
