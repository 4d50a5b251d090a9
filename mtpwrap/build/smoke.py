"""Try a freshly built llama-server before trusting it: start it on a real model, ask for tokens.

A build that compiles can still crash on the machine that runs it (llama.cpp's AMX kernels, for
one, compiled by `GGML_NATIVE=ON` on a CPU that has AMX). `mtpwrap build` calls `run()` on every
new binary and keeps the result in the manifest; a binary that fails is never installed.

The process is started, read and stopped by `child.ChildProcess`, the one owner of llama-server
processes.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def crashed(self) -> bool:
        return self.status == "crashed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def smoke_model(work_dir: Path) -> Path:
    """The demo model when it is cached, else a tiny runnable model written into work_dir."""
    from mtpwrap.build import tiny_gguf
    from mtpwrap.models import known as models

    demo = models.cached_demo_model()
    if demo is not None:
        return demo

    # q8_0 matrices: the quantized kernels (where llama.cpp's AMX code runs) get exercised too
    tiny = work_dir / "smoke-tiny-llama-q8_0.gguf"
    if not tiny.is_file():
        tiny_gguf.write_tiny_random(tiny, arch="llama", mtp=False, ftype="q8_0")
    return tiny


def argv(binary: Path, model: Path, port: int, gpu: bool) -> list[str]:
    """The smallest launch that loads the model and computes: one slot, a short context."""
    from mtpwrap.decide import capabilities, launch

    cfg = launch.plain(model, context=512, gpu_layers=99 if gpu else 0, why="smoke test")
    return launch.render(cfg, capabilities.probe(binary), binary=binary, port=port).argv


async def _run(binary: Path, model: Path, gpu: bool, timeout: float) -> SmokeResult:
    from mtpwrap.proc import describe_returncode, free_loopback_port
    from mtpwrap.run import child

    key = secrets.token_hex(16)
    port = free_loopback_port()
    spec = child.ChildSpec(argv=argv(binary, model, port, gpu), env={"LLAMA_API_KEY": key},
                           note="smoke test")
    started = time.monotonic()
    proc = await child.ChildProcess.spawn(
        spec, base_url=f"http://127.0.0.1:{port}", api_key=key, file_logger=None,
        lines_per_s=0.0, log_file=None)
    result: SmokeResult | None = None
    try:
        deadline = started + timeout
        while result is None and time.monotonic() < deadline:
            rc = await proc.wait(0.25)
            if rc is not None:
                break
            if await proc.health(timeout=2.0) == 200:
                ok, why, tokens = await proc.generate(PROMPT, N_PREDICT,
                                                      timeout=max(5.0, deadline - time.monotonic()))
                if ok:
                    result = SmokeResult("passed", f"generated {tokens} tokens", tokens=tokens)
                elif proc.returncode is None:
                    await proc.wait(1.0)  # a crash mid-request shows as a dropped connection
                    if proc.returncode is None:
                        result = SmokeResult("failed", f"the generation failed: {why}")
                break
        if result is None and proc.returncode is None:
            result = SmokeResult("failed", f"no answer within {timeout:.0f} s")
    finally:
        await proc.terminate(grace=5.0)
    if result is None:
        rc = proc.returncode if proc.returncode is not None else 0
        desc = describe_returncode(rc)
        crash = rc < 0 and -rc in {int(s) for s in CRASH_SIGNALS}
        sig = desc.split("(")[-1].rstrip(")") if rc < 0 else None
        result = SmokeResult("crashed" if crash else "failed", f"llama-server ended with {desc}",
                             signal=sig)
    result.seconds = round(time.monotonic() - started, 2)
    result.model = str(model)
    result.log_tail = list(proc.tail)[-12:]
    return result


def run(binary: Path, model: Path, *, gpu: bool = False, timeout: float = 180.0) -> SmokeResult:
    """Start `binary` on `model`, ask for a few tokens, stop it; never raises for the binary's
    own failures (they are the result)."""
    from mtpwrap.errors import MtpwrapError

    try:
        return asyncio.run(_run(Path(binary), Path(model), gpu, timeout))
    except (OSError, MtpwrapError) as exc:
        return SmokeResult("failed", f"could not start {binary}: {exc}", model=str(model))


def skipped(why: str) -> SmokeResult:
    return SmokeResult("skipped", why)
