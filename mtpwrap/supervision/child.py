"""One supervised llama-server: spawned through `mtpwrap.proc`, its output read (OOM and bind
errors noticed, lines forwarded at a bounded rate), its HTTP endpoints asked, ended by the one
stop policy.

Only the supervisor uses this module; it is the single owner of every `ChildProcess`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import logging.handlers
import re
import signal
import time
from pathlib import Path
from typing import Any

from mtpwrap import promtext, upstream
from mtpwrap.build.smoke import judge_completion
from mtpwrap.decide.launch import ChildCommand
from mtpwrap.pids import identify, signal_group
from mtpwrap.proc import child_env, start_async, stop_async

log = logging.getLogger("mtpwrap.supervisor")
child_log = logging.getLogger("mtpwrap.child")

_OOM_PATTERNS = re.compile(
    r"out of memory|cudaMalloc failed|CUDA error: out of memory|failed to allocate .*buffer"
    r"|ErrorOutOfDeviceMemory|unable to allocate .*buffer",
    re.IGNORECASE,
)
_ERROR_WORDS = re.compile(r"error|failed|abort|out of memory|couldn't", re.IGNORECASE)
#: llama.cpp's own log prefix: elapsed time, then the level letter ("0.00.036.626 W srv ...")
_LEVEL_PREFIX = re.compile(r"^\s*(?:\d+\.\d+\.\d+\.\d+\s+)?([DIWE])\s")
#: debug lines count as info: the journal keeps every line llama-server prints
_LEVELS = {"D": logging.INFO, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}


def line_level(line: str) -> int:
    """The logging level of one llama-server line: its own level letter when it has one;
    otherwise an error when it reads like one, a warning when it says so, else info (the
    load log, GGUF metadata, per-request timings)."""
    m = _LEVEL_PREFIX.match(line)
    if m:
        return _LEVELS[m.group(1)]
    if _ERROR_WORDS.search(line):
        return logging.ERROR
    if re.match(r"\s*warn(ing)?\b", line, re.IGNORECASE):
        return logging.WARNING
    return logging.INFO


class _RateLimiter:
    """Token bucket for forwarding child lines into mtpwrap's log."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst = per_s, burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.suppressed = 0

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False


class ChildProcess:
    """A started llama-server: pid, process group, output pump, HTTP probes, termination."""

    def __init__(self, proc: asyncio.subprocess.Process, *, base_url: str, api_key: str,
                 file_logger: logging.Logger | None, lines_per_s: float, log_file: Path | None,
                 socket: str | None = None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session: the child leads its own session and group
        # Its identity while the event loop has not reaped it (uvloop reaps in this thread):
        # every signal to its group is checked against it, and the instance file records it.
        self.leader = identify(proc.pid) if proc.returncode is None else None
        self.base_url = base_url
        self.socket = socket
        self.api_key = api_key
        self.started_at = time.time()
        self.health_ok_at: float | None = None  # first /health 200, wall time
        self.last_output = time.monotonic()
        self.saw_oom = False
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.file_logger = file_logger
        self._limiter = _RateLimiter(lines_per_s, burst=max(10, int(lines_per_s * 3)))
        self._log_file = log_file
        self._pump = asyncio.create_task(self._pump_output(), name=f"child-{self.pid}-output")
        # Imported here, after the fork: the import then overlaps the child's own start-up.
        import httpx

        self._httpx = httpx
        self._http = upstream.async_client(socket, base_url=base_url, api_key=api_key,
                                           timeout=httpx.Timeout(5.0))

    # --- spawning ------------------------------------------------------------------------
    @classmethod
    async def spawn(cls, spec: ChildCommand, *, base_url: str, api_key: str,
                    file_logger: logging.Logger | None, lines_per_s: float,
                    log_file: Path | None, socket: str | None = None) -> ChildProcess:
        if any(api_key in arg for arg in spec.argv):
            # Anything in argv is readable by every local user through /proc and `ps`.
            raise ValueError("the internal API key must be passed through the environment")
        # Its own process group (one killpg reaches grandchildren), dead with mtpwrap; what
        # llama-server writes (KV snapshots hold the clients' prompts) is for the service user
        # alone, from the moment it exists.
        proc = await start_async(spec.argv, env=child_env(spec.env), umask=0o077)
        return cls(proc, base_url=base_url, api_key=api_key, file_logger=file_logger,
                   lines_per_s=lines_per_s, log_file=log_file, socket=socket)

    # --- output --------------------------------------------------------------------------
    async def _pump_output(self) -> None:
        assert self.proc.stdout is not None
        partial = b""
        while True:
            try:
                chunk = await self.proc.stdout.read(65536)
            except (OSError, ValueError):
                break
            if not chunk:
                break
            # Any output counts as load progress: llama-server prints dots and lines while it
            # reads tensors, so a quiet child is a stuck one.
            self.last_output = time.monotonic()
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for raw in lines:
                self._line(raw.decode("utf-8", "replace").rstrip("\r"))
        if partial:
            self._line(partial.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        if self.api_key in line:
            line = line.replace(self.api_key, "<redacted>")
        if not line.strip():
            return
        self.tail.append(line)
        if _OOM_PATTERNS.search(line):
            self.saw_oom = True
        if self.file_logger is not None:
            self.file_logger.info(line)
        if self._limiter.allow():
            if self._limiter.suppressed:
                where = f"; see {self._log_file}" if self._log_file else ""
                child_log.info("llama-server[%d]: (%d lines not shown%s)", self.pid,
                               self._limiter.suppressed, where)
                self._limiter.suppressed = 0
            child_log.log(line_level(line), "llama-server[%d]: %s", self.pid, line)

    def last_error_line(self) -> str | None:
        for line in reversed(self.tail):
            if _ERROR_WORDS.search(line):
                return line.strip()[-200:]
        return self.tail[-1].strip()[-200:] if self.tail else None

    # --- state ---------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None when the child is still running after `timeout` seconds."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        except asyncio.TimeoutError:
            return None

    # --- HTTP probes ---------------------------------------------------------------------
    async def health(self, timeout: float = 2.0) -> int | None:
        """HTTP status of /health, or None when nothing answers."""
        try:
            r = await self._http.get("/health", timeout=timeout)
        except self._httpx.HTTPError:
            return None
        return r.status_code

    async def answer_once(self, serves: str | None, timeout: float) -> tuple[bool, str]:
        """The readiness question for what this llama-server serves: one token of a chat model,
        one embedding of an embedding companion (`serves` "embeddings"), one score of a
        reranker ("reranking"); (True, "") when the model really answers."""
        if serves is None:
            path, body, field_ = "/completion", {"prompt": "Hello", "n_predict": 1,
                                                 "cache_prompt": False, "temperature": 0.0}, ""
        elif serves == "embeddings":
            path, body, field_ = "/v1/embeddings", {"input": "Hello"}, "data"
        else:
            path, body, field_ = "/v1/rerank", {"query": "Hello", "documents": ["Hello"]}, "results"
        try:
            r = await self._http.post(path, json=body, timeout=timeout)
        except self._httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        if serves is None:
            ok, why, _ = judge_completion(r)
            return ok, why
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {r.text[:200]}"
        try:
            data = r.json()
        except ValueError:
            return False, "the answer was not JSON"
        if not isinstance(data, dict) or not isinstance(data.get(field_), list) \
                or not data[field_]:
            return False, f"the answer had no {field_}"
        return True, ""

    async def metrics(self, timeout: float = 2.0) -> dict[str, float] | None:
        """`llamacpp:*` samples from /metrics; None when the endpoint is off or silent."""
        try:
            r = await self._http.get("/metrics", timeout=timeout)
        except self._httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            page = promtext.samples(r.text)
        except ValueError:  # a page that is not Prometheus text: no readings
            return None
        return {s.name[len("llamacpp:"):]: s.value for s in page
                if s.name.startswith("llamacpp:") and not s.labels}

    def _processes(self) -> list[Any]:
        """psutil handles of the child and everything it started ([] once it is gone)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the child and everything it started have used so far."""
        import psutil

        total = 0.0
        for p in self._processes():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def memory_bytes(self) -> int:
        """RSS + swap of the child and everything it started."""
        import psutil

        total = 0
        for p in self._processes():
            try:
                info = p.memory_full_info()
                total += info.rss + getattr(info, "swap", 0)
            except psutil.AccessDenied:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    # --- ending --------------------------------------------------------------------------
    async def terminate(self, grace: float) -> int | None:
        """End it by the one stop policy (`proc.stop_async`: SIGTERM, `grace` seconds, SIGKILL,
        and the group swept even after a clean exit); the exit code, None when it is stuck."""
        rc = await stop_async(self.proc, grace, what="llama-server", leader=self.leader)
        await self.close()
        return rc

    def kill_group(self) -> None:
        signal_group(self.leader, signal.SIGKILL)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._pump, 2.0)
        await self._http.aclose()


def make_file_logger(path: Path | None, max_bytes: int, backups: int) -> logging.Logger | None:
    """A logger that writes the child's lines, unfiltered, to a rotating file."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"mtpwrap.childfile.{path}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes,
                                                       backupCount=backups, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    return logger


def close_file_logger(logger: logging.Logger | None) -> None:
    if logger is None:
        return
    for h in list(logger.handlers):
        h.close()
        logger.removeHandler(h)
