"""The front `bench docs` measures, and what it does to it between questions: a running front
(`Target.running`), or one `mtpwrap up` started for the run in a process of its own
(`OwnFront`, the same `up` a person runs, with its state, logs and snapshots in the report's
folder); `mtpwrap reload` and `mtpwrap restart` run as a person runs them, and a crash is a
SIGKILL of the llama-server child whose pid the front's /healthz gives."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from mtpwrap import hashing, proc
from mtpwrap.bench import suite
from mtpwrap.bench.runner import Client
from mtpwrap.config.table import env_name
from mtpwrap.errors import ConfigError, RuntimeFailure
from mtpwrap.supervision import instance

if TYPE_CHECKING:
    from mtpwrap.bench.docs import DocsPlan

#: how often a wait asks the front again
POLL_S = 0.2
#: what /readyz, /healthz and /props may take to answer
PROBE_TIMEOUT_S = 10.0


def _mtpwrap(*args: str) -> list[str]:
    return [sys.executable, "-m", "mtpwrap", *args]


def wait_until(what: str, ok: Callable[[], bool], timeout: float,
               gone: Callable[[], str | None] | None = None) -> float:
    """Seconds until `ok()` held; RuntimeFailure naming `what` when it did not within
    `timeout`, or as soon as `gone()` says why it never will."""
    t0 = time.monotonic()
    while not ok():
        why = gone() if gone else None
        if why:
            raise RuntimeFailure(f"{what}: {why}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeFailure(f"{what}: not within {timeout:.0f} s (--timeout).")
        time.sleep(POLL_S)
    return time.monotonic() - t0


class Target:
    """The front the questions go to: its client, and the actions between steps."""

    def __init__(self, url: str, api_key: str | None, timeout: float,
                 env: Mapping[str, str] | None = None,
                 gone: Callable[[], str | None] | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        #: the environment `mtpwrap reload` / `restart` run in (None: this process's)
        self.env = env
        self.gone = gone
        self.client = Client(self.url, api_key, timeout)

    @classmethod
    def running(cls, url: str, api_key: str | None, timeout: float) -> Target:
        t = cls(url, api_key, timeout)
        try:
            t.client.http.get("/livez", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            t.close()
            raise RuntimeFailure(f"{url} did not answer ({type(exc).__name__}); is the front "
                                 "running at --url?") from exc
        return t

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str) -> httpx.Response | None:
        try:
            return self.client.http.get(path, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None

    def ready(self) -> bool:
        r = self._get("/readyz")
        return r is not None and r.status_code == 200

    def health(self, required: bool = True) -> dict:
        """The front's /healthz: model, binary, commit, profile, llama-server's pid. Not
        `required` (the report's provenance): a key without the metrics scope gives
        {"unavailable": why} instead of an error."""
        r = self._get("/healthz")
        if r is None or r.status_code in (401, 403):
            why = (f"{self.url}/healthz refused the key or did not answer; an --api-key with "
                   "the metrics scope lets the report name the model and the binary")
            if not required:
                return {"unavailable": why}
            raise ConfigError(why + " (and the crash step find llama-server).")
        if r.status_code != 200:
            raise RuntimeFailure(f"{self.url}/healthz answered {r.status_code}.")
        return dict(r.json())

    def slot_context(self) -> int | None:
        """Tokens of context one slot holds (/props)."""
        props = self.client.props()
        n = (props.get("default_generation_settings") or {}).get("n_ctx")
        return int(n) if isinstance(n, int) and n > 0 else None

    def wait_ready(self, what: str) -> float:
        return wait_until(what, self.ready, self.timeout, self.gone)

    def act(self, name: str) -> dict:
        """`reload`, `restart` or `crash`, then the wait until the front is ready again."""
        if name == "crash":
            return self.crash()
        self._check_local(name)
        t0 = time.monotonic()
        done = proc.run(_mtpwrap(name), timeout=self.timeout, env=self.env,
                        merge_stderr=True, what=f"mtpwrap {name}")
        took = time.monotonic() - t0
        if done.returncode != 0:
            raise RuntimeFailure(f"`mtpwrap {name}` ended with "
                                 f"{proc.describe_returncode(done.returncode)}: "
                                 f"{done.last_line()}")
        waited = self.wait_ready(f"the front ready after `mtpwrap {name}`")
        return {"action": name, "command_s": took, "ready_after_s": took + waited,
                "output": done.output[-500:]}

    def _check_local(self, name: str) -> None:
        """`mtpwrap reload`/`restart` signal the instance of this machine's state file: it must
        be the one at the URL measured."""
        if self.env is not None:
            return  # the front this run started: its own state file
        data = instance.read_instance()
        if not instance.instance_running(data):
            raise ConfigError(f"The {name} step needs the front running on this machine, but "
                              f"no mtpwrap instance is recorded at {instance.instance_path()}; "
                              "leave the step out (--steps) or run bench docs where it runs.")
        assert data is not None
        if str(data.get("url", "")).rstrip("/") != self.url:
            raise ConfigError(f"The {name} step would act on the instance at {data.get('url')}, "
                              f"not on --url {self.url}; give --url as `mtpwrap status` shows it.")

    def check_actions(self, steps: list[str]) -> None:
        """Before anything is measured: the actions among `steps` can act on this front."""
        for name in ("reload", "restart"):
            if name in steps:
                self._check_local(name)
        if "crash" in steps:
            self._child(self.health())

    def _child(self, health: dict) -> int:
        """The pid of the front's llama-server, a process of this machine."""
        pid = health.get("child_pid")
        if not isinstance(pid, int) or pid <= 1:
            raise RuntimeFailure(f"{self.url}/healthz names no llama-server pid (state "
                                 f"{health.get('state')}).")
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            cmd = ""
        if Path(cmd).name != Path(str(health.get("binary") or "llama-server")).name:
            raise ConfigError(f"The crash step kills llama-server (pid {pid}), which is not a "
                              "process on this machine; leave the step out (--steps) or run "
                              "bench docs where the front runs.")
        return pid

    def crash(self) -> dict:
        """SIGKILL llama-server (the pid /healthz gives), then wait for a new one, ready."""
        before = self.health()
        pid = self._child(before)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def replaced() -> bool:
            r = self._get("/healthz")
            if r is None or r.status_code != 200:
                return False
            h = r.json()
            return h.get("child_pid") not in (None, pid) and bool(h.get("ready"))

        wait_until("a new llama-server after the crash", replaced, self.timeout, self.gone)
        self.wait_ready("the front ready after the crash")
        return {"action": "crash", "killed_pid": pid, "ready_after_s": time.monotonic() - t0,
                "restarts_before": before.get("restarts")}


class OwnFront:
    """`mtpwrap up --profile P` in a process of its own on a free loopback port, its state,
    logs, KV snapshots and audit in `folder`; stopped (SIGTERM, as systemd stops it) on exit."""

    def __init__(self, profile: str | None, binary: str | None, model: str | None,
                 folder: Path, timeout: float, api_key: str | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "up.log"
        port = proc.free_loopback_port()
        argv = _mtpwrap("up", "--profile", profile or "auto", "--host", "127.0.0.1",
                        "--port", str(port))
        if binary:
            argv += ["--binary", str(binary)]
        if model:
            argv += ["--model", str(model)]
        env = dict(os.environ)
        env.update({"MTPWRAP_STATE_DIR": str(folder / "state"),
                    "MTPWRAP_LOG_DIR": str(folder / "logs"),
                    env_name("persist.dir"): str(folder / "documents"),
                    env_name("audit.dir"): str(folder / "audit")})
        self.argv = argv
        with self.log.open("w") as out:
            self.process = proc.start(argv, env=env, stdout=out, stderr=proc.STDOUT,
                                      what="mtpwrap up")
        self.target = Target(f"http://127.0.0.1:{port}", api_key, timeout, env=env,
                             gone=self._gone)
        try:
            self.target.wait_ready("mtpwrap up ready")
        except BaseException:
            self.close()
            raise

    def _gone(self) -> str | None:
        rc = self.process.poll()
        if rc is None:
            return None
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return (f"mtpwrap up ended with {proc.describe_returncode(rc)}: "
                f"{lines[-1] if lines else ''} (log {self.log})")

    def close(self) -> None:
        self.target.close()
        self.process.stop(grace=120.0)

    def __enter__(self) -> OwnFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def digest(path: object) -> str | None:
    """The sha256 of a file of this machine, None where there is none."""
    p = Path(str(path)) if path else None
    return hashing.sha256_file(p) if p is not None and p.is_file() else None


def provenance(plan: DocsPlan, health: dict) -> dict[str, Any]:
    """The model (file, size, sha256), the binary (its own sha256, manifest, version) and the
    profile the front said it runs, taken before the first read: a binary replaced at its path
    during the run is what a restart starts, and the report compares the digests."""
    model = health.get("model")
    binary = health.get("binary")
    return {"model": suite.model_provenance(Path(model)) if model else None,
            "binary": suite.build_provenance(Path(binary)) if binary else None,
            "binary_sha256": digest(binary),
            "commit": health.get("commit"), "profile": health.get("profile"),
            "context": health.get("context"), "kv": health.get("kv"),
            "speculation": health.get("speculation"),
            "started_by_bench": plan.url is None}
