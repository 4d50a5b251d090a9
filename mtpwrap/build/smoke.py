"""Try a freshly built llama-server before trusting it: start it on a real model, ask for tokens.

A build that compiles can still crash on the machine that runs it (llama.cpp's AMX kernels, for
one, compiled by `GGML_NATIVE=ON` on a CPU that has AMX). `mtpwrap build` calls `run()` on every
new binary and keeps the result in the manifest; a binary that fails is never installed.

The process is started and stopped by `mtpwrap.proc` (its own process group, the one stop
policy) and listens where every temporary server does (`mtpwrap.build.trial`: its own UNIX
socket when the binary binds one, else loopback TCP), reached through the one upstream client;
its output goes to a log file whose last lines are the result's `log_tail`.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap import proc, upstream
from mtpwrap.build import probe, tiny_gguf, trial
from mtpwrap.decide import launch
from mtpwrap.errors import MtpwrapError
from mtpwrap.models import known as models

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.endpoint import Endpoint

#: Signals that mean the binary itself is broken on this CPU, not that the machine was busy.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE)

PROMPT = (
    "The parties agree that this contract is governed by the laws of the Republic of Korea. "
    "Article 17, paragraph 2: the tenant shall"
)
N_PREDICT = 8


@dataclass
class SmokeResult:
    """What happened when the new binary was tried. `status`: passed, crashed, failed, skipped."""

    status: str
    detail: str
    model: str | None = None
    seconds: float = 0.0
    signal: str | None = None
    tokens: int = 0
    log_tail: list[str] = field(default_factory=list)

    @property
    def crashed(self) -> bool:
        return self.status == "crashed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def smoke_model(work_dir: Path) -> Path:
    """The demo model when it is cached, else a tiny runnable model written into work_dir."""
    demo = models.cached_demo_model()
    if demo is not None:
        return demo

    # q8_0 matrices: the quantized kernels (where llama.cpp's AMX code runs) get exercised too
    tiny = work_dir / "smoke-tiny-llama-q8_0.gguf"
    if not tiny.is_file():
        tiny_gguf.write_tiny_random(tiny, arch="llama", mtp=False, ftype="q8_0")
    return tiny


def argv(binary: Path, model: Path, where: Endpoint, gpu: bool,
         caps: Capabilities | None = None) -> list[str]:
    """The smallest launch that loads the model and computes: one slot, a short context,
    listening at `where` (`trial.endpoint`)."""
    cfg = launch.plain(model, context=512, gpu_layers=99 if gpu else 0, why="smoke test")
    return launch.render(cfg, caps or probe.probe(binary), binary=binary, endpoint=where).argv


def _generate(client: Any, timeout: float) -> tuple[bool, str, int]:
    """Ask for N_PREDICT tokens: (answered, why not, tokens predicted)."""
    import httpx

    body = {"prompt": PROMPT, "n_predict": N_PREDICT, "cache_prompt": False,
            "temperature": 0.0}
    try:
        r = client.post("/completion", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}", 0
    return judge_completion(r)


def judge_completion(r: Any) -> tuple[bool, str, int]:
    """Whether an httpx response to POST /completion is a real answer: (answered, why not,
    tokens predicted)."""
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:200]}", 0
    try:
        data = r.json()
    except ValueError:
        return False, "the answer was not JSON", 0
    if not isinstance(data, dict) or "content" not in data:
        return False, "the answer had no content", 0
    predicted = data.get("tokens_predicted")
    return True, "", predicted if isinstance(predicted, int) else 0


def _try(server: proc.Process, where: Endpoint, key: str, timeout: float) -> SmokeResult | None:
    """Wait for health, ask for tokens; None when the process ended (a crash or an exit)."""
    deadline = time.monotonic() + timeout
    with upstream.client(where.socket, base_url=where.base_url, api_key=key,
                         keepalive=False) as client:
        while time.monotonic() < deadline:
            if server.wait(0.25) is not None:
                return None
            if proc.healthy(client):
                ok, why, tokens = _generate(client, max(5.0, deadline - time.monotonic()))
                if ok:
                    return SmokeResult("passed", f"generated {tokens} tokens", tokens=tokens)
                if server.wait(1.0) is not None:  # a crash mid-request: a dropped connection
                    return None
                return SmokeResult("failed", f"the generation failed: {why}")
    return SmokeResult("failed", f"no answer within {timeout:.0f} s")


def _ended(rc: int) -> SmokeResult:
    desc = proc.describe_returncode(rc)
    crash = rc < 0 and -rc in {int(s) for s in CRASH_SIGNALS}
    sig = desc.split("(")[-1].rstrip(")") if rc < 0 else None
    return SmokeResult("crashed" if crash else "failed", f"llama-server ended with {desc}",
                       signal=sig)


def run(binary: Path, model: Path, *, gpu: bool = False, timeout: float = 180.0) -> SmokeResult:
    """Start `binary` on `model`, ask for a few tokens, stop it; never raises for the binary's
    own failures (they are the result). It listens where every temporary server does
    (`trial.endpoint`: its own UNIX socket when the binary binds one)."""
    binary, model = Path(binary), Path(model)
    key = secrets.token_hex(16)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mtpwrap-smoke-") as tmp, \
            contextlib.ExitStack() as stack:
        log = Path(tmp) / "server.log"
        try:
            caps = probe.probe(binary)
            where = stack.enter_context(trial.endpoint(caps))
            with log.open("wb") as out:
                server = proc.start(argv(binary, model, where, gpu, caps),
                                    env=proc.child_env({"LLAMA_API_KEY": key}), stdout=out,
                                    stderr=proc.STDOUT, what="llama-server (smoke test)")
        except (OSError, MtpwrapError) as exc:
            return SmokeResult("failed", f"could not start {binary}: {exc}", model=str(model))
        try:
            result = _try(server, where, key, timeout)
        finally:
            server.stop(grace=5.0)
        if result is None:
            result = _ended(server.returncode if server.returncode is not None else 0)
        lines = log.read_text(errors="replace").splitlines()
    result.seconds = round(time.monotonic() - started, 2)
    result.model = str(model)
    result.log_tail = [ln.replace(key, "<redacted>") for ln in lines if ln.strip()][-12:]
    return result


def skipped(why: str) -> SmokeResult:
    return SmokeResult("skipped", why)
