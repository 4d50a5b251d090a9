"""The README's main job: `mtpwrap up --profile cpu-demo` serves the demo model for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cli_env, wait_ready

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_up_cpu_demo_serves_chat_and_stream_then_stops_cleanly(
    llama_server_bin: Path, demo_model: Path, free_port: int
) -> None:
    from openai import OpenAI

    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpwrap", "up", "--profile", "cpu-demo", "--port", str(free_port)],
        env=cli_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{free_port}"
    try:
        wait_ready(base, proc, lambda: proc.stdout.read() if proc.stdout else "", 120)

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0

        chunks = list(
            client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "Count to five."}],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) > 2 and text

        children = _descendants(proc.pid)
        assert children, "llama-server should run as a child"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    finally:
        leftovers = _descendants(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
