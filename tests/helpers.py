"""Plain helpers shared by test modules: running the CLI as a person would, requiring a system
tool, an `mtpwrap up` instance, a supervisor over the fake llama-server, recorded GPU snapshots
and a carried build. Fixtures live in conftest.py; test modules import from here, never from
conftest or from each other."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from mtpwrap import proc

if TYPE_CHECKING:
    from tests.hub_server import FakeHub

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SNAPSHOTS = DATA / "snapshots"
FAKE_LLAMA_SERVER = Path(__file__).resolve().parent / "fakes" / "fake_llama_server.py"


# --------------------------------------------------------------------------- the tiny hybrid

def tiny_hybrid_profile(folder: Path, name: str, threads: int = 1) -> Path:
    """A profile serving the tiny hybrid qwen35 with its MTP head (the flagship's architecture:
    recurrent layers, so a prompt is reused back to a context checkpoint only), 32K context, one
    slot (the document store serves one), on the CPU. The model is written beside it."""
    import yaml

    from mtpwrap.build.tiny_gguf import write_tiny_random

    model = write_tiny_random(folder / "tiny-qwen35-mtp-32k.gguf", "qwen35", mtp=True,
                              context=32768)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "description": "The tiny hybrid model with its MTP head, one slot",
        "hardware": {"requires_gpu": False}, "model": str(model), "context": 32768,
        "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "mtp", "depth": 2},
        "gpu_layers": 0, "slots": 1, "threads": threads}))
    return path


# --------------------------------------------------------------------------- the CLI


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("NO_COLOR", "1")
    env.setdefault("COLUMNS", "200")
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> proc.Completed:
    """Run `python -m mtpwrap ARGS` as a person would, from this checkout."""
    return proc.run([sys.executable, "-m", "mtpwrap", *args], env=env or cli_env(),
                    timeout=timeout, cwd=cwd or REPO)


def require_tool(name: str, package: str) -> str:
    """Path of a system tool a test needs. Missing: a failure in CI (CI=true), else a skip
    that says how to install it."""
    path = shutil.which(name)
    if path is None:
        how = (f"{name} is not installed: run `sudo make system-deps` "
               f"(or `apt-get install {package}`)")
        if os.environ.get("CI") == "true":
            pytest.fail(how)
        pytest.skip(how)
    return path


# --------------------------------------------------------------------------- recorded GPUs


def load_snapshot(name: str) -> dict[str, Any]:
    """A recorded NVML snapshot from tests/data/snapshots/NAME.json, as a dict."""
    data: dict[str, Any] = json.loads((SNAPSHOTS / f"{name}.json").read_text())
    return data


# --------------------------------------------------------------------------- `mtpwrap up`


def wait_for(what: str, ok: Callable[[], bool], timeout: float, every: float = 0.1) -> float:
    """Seconds until `ok()` held; TimeoutError naming `what` when it never did. The one way
    tests wait for a condition (`until` is its twin for a test inside an event loop)."""
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(every)  # the helper's poll
    return time.monotonic() - t0


def audit_lines(directory: Path, ok: Callable[[list[dict[str, Any]]], bool],
                timeout: float = 30) -> list[dict[str, Any]]:
    """The audit trail's records under `directory` once `ok(records)` holds (a writer thread
    writes them after the answer ends); TimeoutError when they never do."""
    from mtpwrap.front.audit import read_records

    wait_for("the audit lines", lambda: ok(list(read_records(directory))), timeout)
    return list(read_records(directory))


async def until(what: str, ok: Callable[[], bool], timeout: float, every: float = 0.01) -> float:
    """`wait_for` inside an event loop: seconds until `ok()` held, yielding to the loop between
    polls; TimeoutError naming `what` when it never did."""
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(every)  # the helper's poll
    return time.monotonic() - t0


def is_ready(base: str, timeout: float = 10) -> bool:
    """Whether `base`/readyz answers 200 now."""
    try:
        return httpx.get(f"{base}/readyz", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(base: str, process: Any, output: Any, timeout: float = 120) -> None:
    """Poll `base`/readyz until it answers 200; fail with `output()` if `process` (a Popen)
    exits first or the time runs out."""
    def ready() -> bool:
        assert process.poll() is None, output()
        return is_ready(base, timeout=2)

    try:
        wait_for("mtpwrap ready", ready, timeout)
    except TimeoutError:
        pytest.fail("mtpwrap never became ready:\n" + output())


class Instance:
    """`mtpwrap up` in a process of its own, with a home of its own."""

    def __init__(self, home: Path, port: int, binary: Path, model: Path,
                 log: Path | None = None, profile: str = "cpu-demo", **more_env: str) -> None:
        # With `log`, the output goes to that file: a pipe nobody reads would stall a node
        # that serves many requests.
        self.home, self.port, self.log = home, port, log
        extra = {"MTPWRAP_HOME": str(home), "MTPWRAP_SUPERVISOR_BACKOFF_INITIAL_S": "0.5",
                 "MTPWRAP_DRAIN_S": "5"}
        extra.update(more_env)
        self.env = cli_env(**extra)
        self.process = proc.start(
            [sys.executable, "-m", "mtpwrap", "up", "--profile", profile, "--binary",
             str(binary), "--model", str(model), "--port", str(port)],
            env=self.env, cwd=REPO, stderr=proc.STDOUT, text=True,
            stdout=proc.PIPE if log is None else log.open("w"))
        self.proc = self.process.popen  # signals to mtpwrap alone, as systemd sends them
        self.base = f"http://127.0.0.1:{port}"

    def status(self) -> tuple[int, dict]:
        r = run_cli("status", "--json", env=self.env, timeout=30)
        return r.returncode, json.loads(r.stdout)

    def wait_ready(self, timeout: float = 120) -> None:
        wait_ready(self.base, self.proc, self.output, timeout)

    def ready(self) -> bool:
        """Whether `/readyz` answers 200 now."""
        return is_ready(self.base)

    def processing(self, key: str) -> float:
        """Requests llama-server is working on, from its own `/metrics` through the front."""
        r = httpx.get(self.base + "/metrics", headers={"authorization": f"Bearer {key}"},
                      timeout=120)
        r.raise_for_status()  # a refused or failed page says nothing of llama-server
        for line in r.text.splitlines():
            if line.startswith("mtpwrap_backend_requests_processing "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def output(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out = self.proc.communicate(timeout=10)[0] or ""
        return self.log.read_text() if self.log is not None else out

    def close(self) -> None:
        self.process.kill()

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to mtpwrap (as systemd stops it), a wait for it to drain and exit, then
        whatever is left killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        finally:
            self.close()


# --------------------------------------------------------------------------- a supervisor

# Short timings so that a fault shows within a second or two.
FAST: dict[str, Any] = dict(
    load_stall_s=5.0, probe_timeout_s=5.0, poll_interval_s=0.02, monitor_interval_s=0.1,
    backoff_initial_s=0.1, backoff_max_s=0.4, max_failures=4, failure_window_s=60.0,
    stop_grace_s=3.0, wedge_s=0.0,
)


def fake_factory(faults: dict[str, Any] | None = None, steps: list[int] | None = None,
                 gpu_layers: int | None = None) -> Any:
    """A supervisor's child factory that starts tests/fakes/fake_llama_server.py with FAULTS
    (with GPU_LAYERS, the child's spec carries a launch that offloads that many layers)."""
    from mtpwrap.decide.endpoint import Endpoint
    from mtpwrap.decide.launch import LaunchConfig
    from mtpwrap.supervision.child import ChildCommand

    launch = None if gpu_layers is None else LaunchConfig(
        profile="fake", model="fake.gguf", context=4096, cache_k="f16", cache_v="f16",
        gpu_layers=gpu_layers)

    fault_env = ",".join(f"{k}={v}" for k, v in (faults or {}).items())

    def factory(endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        if steps is not None:
            steps.append(step)
        if step > 2:
            return None
        return ChildCommand(
            argv=[sys.executable, str(FAKE_LLAMA_SERVER), "--host", "127.0.0.1", "--port",
                  str(endpoint.port)],
            env={"LLAMA_API_KEY": api_key, "FAKE_LLAMA_FAULTS": fault_env},
            note=f"step {step}" if step else "",
            launch=launch,
        )

    return factory


def make(faults: dict[str, Any] | None = None, tmp_path: Path | None = None,
         **overrides: Any) -> tuple[Any, list[tuple[float, Any, Any, str | None]]]:
    """A Supervisor over the fake llama-server, and the list its state changes are logged to."""
    from mtpwrap.config.objects import SupervisorConfig
    from mtpwrap.supervision.supervisor import Supervisor

    steps = overrides.pop("steps", None)
    gpu_layers = overrides.pop("gpu_layers", None)
    cfg: dict[str, Any] = dict(FAST)
    if tmp_path is not None:
        cfg["log_file"] = tmp_path / "llama-server.log"
    cfg.update(overrides)
    sup = Supervisor(fake_factory(faults, steps, gpu_layers), SupervisorConfig(**cfg))
    events: list[tuple[float, Any, Any, str | None]] = []
    sup.add_listener(lambda old, new, why: events.append((time.monotonic(), old, new, why)))
    return sup, events


# --------------------------------------------------------------------------- a carried build


def packable_manifest(tmp_path: Path, identity: str | None = None,
                      sha: str | None = None) -> Any:
    """An installed cuda-sm89 build of the offline pin with real (small) binaries."""
    from mtpwrap import hashing
    from mtpwrap.build import planning, source
    from mtpwrap.build.manifest import Manifest

    bin_dir = tmp_path / "made-here" / "bin"
    bin_dir.mkdir(parents=True)
    binaries = {}
    for name in planning.TARGETS:
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\necho {name}\n")
        exe.chmod(0o755)
        binaries[name] = {"path": str(exe), "cache_path": str(exe),
                          "sha256": sha or hashing.sha256_file(exe)}
    return Manifest(
        variant="cuda-sm89", source={"kind": "offline", "commit": "0c1e570",
                                     "identity": identity or source.offline_identity()},
        cmake_options={"GGML_CUDA": "ON"}, compiler="g++", cuda_version="13.0",
        architectures=["89"], binaries=binaries, version_output="", build_seconds=1.0,
        built_at="2026-11-30T00:00:00", cache_key="k", build_dir=str(bin_dir.parent), log="",
        smoke={"status": "skipped", "detail": "no GPU"})


# --------------------------------------------------------------------------- a model hub


def gguf_bytes(n: int, seed: int = 0) -> bytes:
    """A file that starts like a GGUF and then holds n pseudo-random bytes (no pattern a
    resumed transfer could repeat by chance)."""
    out, block = bytearray(b"GGUF\x03\x00\x00\x00"), hashlib.sha256(b"%d" % seed).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def pull_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    env = cli_env(MTPWRAP_HOME=str(home), HF_ENDPOINT=hub.hub_url, HF_HOME=str(home / "hf"))
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "MTPWRAP_MODELS_DIR", "HF_HUB_OFFLINE"):
        env.pop(name, None)
    env.update(extra)
    return env


def without(argv: list[str], *flags: str) -> list[str]:
    """ARGV without FLAGS and the value after each (e.g. where llama-server listens)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


#: `--host` as a llama-server from before UNIX socket support documents it
NO_SOCKET_HOST = ("--host HOST" + " " * 29 + "ip address to listen (default: 127.0.0.1)\n"
                  + " " * 40 + "(env: LLAMA_ARG_HOST)\n")


def without_socket_help(help_text: str) -> str:
    """A llama-server's --help with its `--host` entry replaced by one from before socket
    support (no `.sock` path named)."""
    lines = help_text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("--host HOST"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("(env:"))
    return "".join(lines[:start]) + NO_SOCKET_HOST + "".join(lines[end + 1:])


def ignoring_draft_depth(real: Path, folder: Path) -> Path:
    """An executable in `folder`: the llama-server `real` behind a relay that drops every
    `speculative.*` field from request bodies (tests/fakes/ignores_draft_depth.py), so it
    ignores a request's own draft depth as an unpatched or fork build does."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "llama-server"
    relay = Path(__file__).parent / "fakes" / "ignores_draft_depth.py"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{relay}" "{real}" "$@"\n')
    script.chmod(0o755)
    return script


def listening(pid: int) -> tuple[list[tuple[str, int]], list[str]]:
    """What process `pid` listens on now: its TCP (ip, port) listeners and its UNIX socket
    paths, each once (a connection it accepted on a UNIX socket carries the socket's path
    too)."""
    import psutil

    p = psutil.Process(pid)
    return ([(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN],
            sorted({c.laddr for c in p.net_connections(kind="unix") if c.laddr}))


# ---------------------------------------------------------------- no compile in a test

GUARD_EXIT = 97  #: the guard's exit status for a refused compile

_GUARD = r"""#!/bin/sh
# The tests' cmake: refuses to compile a llama.cpp tree (tests/conftest.py, compile_guard).
if [ "$1" = "--build" ] && [ -f "$2/CMakeCache.txt" ]; then
  src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$2/CMakeCache.txt")
  if [ -n "$src" ] && [ -d "$src/ggml/src" ]; then
    echo "a test tried to compile llama.cpp ($src in $2): tests never compile it; \
\`make build\` builds llama-server before pytest runs" >&2
    exit {code}
  fi
fi
exec "{real}" "$@"
"""


def compile_guard(real_cmake: str, folder: Path) -> Path:
    """A `cmake` in `folder` that runs `real_cmake`, except `cmake --build` of a build folder
    configured from a llama.cpp tree (one with ggml/src), which it refuses with GUARD_EXIT."""
    folder.mkdir(parents=True, exist_ok=True)
    guard = folder / "cmake"
    guard.write_text(_GUARD.format(code=GUARD_EXIT, real=real_cmake))
    guard.chmod(0o755)
    return guard


def replay(tmp_path: Path, free_gib: float | None = None, gpu: str = "rtx4090") -> Path:
    """A recorded GPU (the RTX 4090 unless told), with less memory free when asked."""
    record = json.loads((DATA / "snapshots" / f"{gpu}.json").read_text())
    if free_gib is not None:
        record["devices"][0]["memory"]["free"] = int(free_gib * 2**30)
    path = tmp_path / f"{gpu}.json"
    path.write_text(json.dumps(record))
    return path


def recorded_fork(tmp_path: Path, name: str) -> Path:
    """A stand-in llama-server answering --help as a recorded fork build does (fork-0bc0a27:
    the commit built here, mtp only; fork-1c6e4ea: its successor, mtp and draft-mtp). Never
    calibrated: there is no manifest, so the KV sizes are the built-in table's."""
    exe = tmp_path / name / "llama-server"
    exe.parent.mkdir()
    version = DATA / "help" / f"{name}.version.txt"
    # upstream's binary holds llama_context's "n_outputs_max_per_seq" log text (what
    # probe.outputs_capped looks for); the fork's at 0bc0a27 does not
    marker = "# n_outputs_max_per_seq\n" if name.startswith("upstream") else ""
    exe.write_text("#!/bin/sh\n" + marker
                   + f'case "$1" in --help) cat "{DATA}/help/{name}.txt";; --version) '
                   + (f'cat "{version}"' if version.is_file() else "true")
                   + ";; *) exit 1;; esac\n")
    exe.chmod(0o755)
    return exe


class Lines:
    """An audit sink that keeps the records (the trail's writer thread appends)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass
