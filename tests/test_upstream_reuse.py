"""The front keeps its connections to llama-server and reuses them, over the UNIX socket, without
a failed request: sequential and concurrent requests, with idle gaps on both sides of
cpp-httplib's 5 s keep-alive timeout (where reused connections used to fail with "Server
disconnected without sending a response")."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mtpwrap import upstream
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.proc import free_loopback_port
from tests.fakes.front_harness import LlamaChild, serve_front

pytestmark = pytest.mark.integration

KEY, INTERNAL = "front-key", "internal-key-reuse"
#: idle gaps (s) between requests: under, at and over cpp-httplib's 5 s keep-alive timeout,
#: and around the client's own 2 s expiry
GAPS = (1.9, 2.1, 4.8, 5.0, 5.2)


@pytest.fixture(scope="module", params=["unix", "tcp"])
def child(request: pytest.FixtureRequest, llama_server_bin: Path, demo_model: Path
          ) -> Iterator[LlamaChild]:
    """llama-server on its UNIX socket, and (for a binary without one) on loopback TCP."""
    run = upstream.private_socket_dir("llama.sock")
    unix = request.param == "unix"
    c = LlamaChild(llama_server_bin, demo_model, 0 if unix else free_loopback_port(), INTERNAL,
                   socket=run / "llama.sock" if unix else None, log_path=run / "llama.log")
    c.start(timeout=300)
    yield c
    c.kill()
    shutil.rmtree(run, ignore_errors=True)


def _connections(pid: int, listening: int) -> set[int]:
    """The inodes of the UNIX sockets llama-server has accepted (its listening one aside)."""
    out: set[int] = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inode = int(link[8:-1])
            if inode != listening:
                out.add(inode)
    return out


def _listening_inode(child: LlamaChild) -> int:
    """The inode of llama-server's listening socket (/proc/net/unix or /proc/net/tcp)."""
    if child.socket is not None:
        with open("/proc/net/unix") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[-1] == child.socket:
                    return int(parts[6])
    else:
        with open("/proc/net/tcp") as f:
            for line in f:
                parts = line.split()
                if parts[1].endswith(f":{child.port:04X}") and parts[3] == "0A":  # LISTEN
                    return int(parts[9])
    raise AssertionError(f"no listening socket for {child.endpoint.describe()}")


def _ask(client: httpx.Client, url: str, i: int) -> tuple[bool, str]:
    # the same prompt every time: llama-server finds all of it but its last token in the slot's
    # cache, and one token comes back, so a request takes ~0.05 s of the model (the connection,
    # not the model, is under test)
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1, "temperature": 0, "stream": i % 5 == 0}
    try:
        r = client.post(url + "/v1/chat/completions", json=body,
                        headers={"authorization": f"Bearer {KEY}"})
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    text = r.text
    if r.status_code != 200 or '"error"' in text[:200] or (i % 5 == 0 and "[DONE]" not in text):
        return False, f"HTTP {r.status_code}: {text[:200]}"
    return True, ""


def test_reused_upstream_connections_fail_no_request(child: LlamaChild) -> None:
    assert child.proc is not None
    cfg = ProxyConfig(api_keys=(KEY,), max_concurrency=2, queue_size=256,
                      queue_timeout_s=120, stream_stall_s=120, prefill_stall_s=300)
    pid = child.proc.pid
    listening = _listening_inode(child)
    failures: list[str] = []
    reused, before = 0, set[int]()
    sent = 0
    with serve_front(child.base_url, child.api_key, cfg, pid=pid, socket=child.socket) as (
            srv, _sup), httpx.Client(timeout=120, trust_env=False) as client:
        # sequential, with the idle gaps
        for i in range(100):
            if i % 20 == 19:
                time.sleep(GAPS[(i // 20) % len(GAPS)])  # the idle gap under test
            ok, why = _ask(client, srv.url, i)
            sent += 1
            if not ok:
                failures.append(f"sequential #{i}: {why}")
            # kept alive: the connection the last request used is still open and served this one
            now = _connections(pid, listening)
            reused += bool(now & before)
            before = now
        # concurrent: 8 clients, more than the 2 slots, so requests queue in the front
        with ThreadPoolExecutor(8) as pool:
            for round_ in range(2):
                if round_:
                    time.sleep(5.0)  # the server's keep-alive timeout, then the next round
                results = list(pool.map(lambda i: _ask(client, srv.url, i), range(50)))
                sent += len(results)
                failures += [f"concurrent round {round_}: {why}" for ok, why in results if not ok]
    assert sent >= 200
    assert failures == [], failures
    # reuse: the same connection request after request (a new one only after an idle gap
    # longer than the client's expiry)
    assert reused >= 50, reused
