"""The supervisor against a fake llama-server that crashes, wedges, stalls and ignores SIGTERM.

Each test runs one real child process (tests/fakes/fake_llama_server.py) under a real
Supervisor and checks what an operator would see: states, reasons, timing, processes in /proc.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from mtpwrap.supervision.state import State
from mtpwrap.supervision.supervisor import Supervisor
from tests.helpers import fake_factory, make, until, wait_for


def alive(pid: int) -> bool:
    """True while /proc shows the process and it is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def left_ready(sup: Supervisor, timeout: float = 5.0) -> None:
    """Wait until the owner has noticed what the client already saw."""
    await until("the supervisor leaving READY", lambda: sup.status().state is not State.READY,
                timeout)


def logged(tmp_path: Path, text: str) -> Callable[[], bool]:
    """True once the child's log file (`make(..., tmp_path)`) holds `text`."""
    log = tmp_path / "llama-server.log"
    return lambda: log.exists() and text in log.read_text()


async def backoff(events: list[tuple[float, Any, Any, str | None]]) -> str:
    """Wait for the first BACKOFF among `events`; its reason."""
    await until("a BACKOFF", lambda: any(e[2] is State.BACKOFF for e in events), 30)
    return next(e[3] for e in events if e[2] is State.BACKOFF) or ""


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def chat(base_url: str, key: str, stream: bool = False, n: int = 4) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=10, trust_env=False) as c:
        return await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": n, "stream": stream})


def test_ready_means_an_answer_and_the_child_is_fenced(tmp_path: Path) -> None:
    loaded = tmp_path / "loaded"

    async def scenario() -> None:
        # the child loads until the test lets it: "still loading" cannot be left meanwhile
        sup, events = make({"load_s": 1.0, "hold_until": loaded}, tmp_path)
        await sup.start()
        await until("the child loading", logged(tmp_path, "loading model tensors"), 10)
        assert sup.status().state is State.STARTING  # /health is 503 while loading
        loaded.touch()
        up = await sup.wait_ready(10)
        assert up is not None and up.generation == 1
        assert up.base_url.startswith("http://127.0.0.1:")
        st = sup.status()
        assert st.state is State.READY and st.pid and st.ready_since
        pid = st.pid
        # The key travels in the environment, never in argv (which `ps` shows to everyone).
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert up.api_key.encode() not in cmdline
        assert f"LLAMA_API_KEY={up.api_key}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
        assert b"NOTIFY_SOCKET" not in Path(f"/proc/{pid}/environ").read_bytes()
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own process group
        assert (await chat(up.base_url, up.api_key)).status_code == 200
        assert (await chat(up.base_url, "wrong")).status_code == 401
        assert "api_key" not in json.dumps(st.to_dict())
        await sup.stop(3)
        assert sup.status().state is State.STOPPED
        assert not alive(pid)
        assert [e[2] for e in events] == [State.STARTING, State.READY, State.STOPPING,
                                          State.STOPPED]
        assert sup.status().last_exit == "exit 0"

    monkey_env = os.environ.copy()
    os.environ["NOTIFY_SOCKET"] = "@not-for-the-child"
    try:
        run(scenario())
    finally:
        os.environ.clear()
        os.environ.update(monkey_env)
    text = (tmp_path / "llama-server.log").read_text()
    assert "model loaded" in text and "loading model tensors" in text


def test_crash_mid_stream_restarts_with_backoff(tmp_path: Path) -> None:
    counter = tmp_path / "starts"

    async def scenario() -> None:
        sup, events = make({"crash_after_chunks": 3, "counter": counter, "fault_starts": 1},
                           tmp_path)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        first_pid = sup.status().pid
        with pytest.raises(httpx.HTTPError):  # the stream is cut, not finished
            async with httpx.AsyncClient(base_url=up.base_url, timeout=10) as c, c.stream(
                    "POST", "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {up.api_key}"},
                    json={"messages": [], "max_tokens": 20, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass
        await left_ready(sup)
        up2 = await sup.wait_ready(10)
        assert up2 is not None and up2.generation == 2 and up2.api_key != up.api_key
        st = sup.status()
        assert st.restarts == 1 and st.last_exit == "signal 9 (SIGKILL)"
        assert st.pid != first_pid
        assert (await chat(up2.base_url, up2.api_key)).status_code == 200
        states = [e[2] for e in events]
        assert states[:5] == [State.STARTING, State.READY, State.BACKOFF, State.STARTING,
                              State.READY]
        backoff_reason = events[2][3] or ""
        assert "signal 9" in backoff_reason and "restarting in 0.1s" in backoff_reason
        await sup.stop(3)

    run(scenario())


def test_crash_loop_backs_off_then_fails_with_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"exit": 3}, tmp_path, max_failures=4)
        t0 = time.monotonic()
        await sup.start()
        assert await sup.wait_ready(20) is None
        st = sup.status()
        assert st.state is State.FAILED
        assert "failed 4 times" in (st.reason or "") and "exit 3" in (st.reason or "")
        starts = [t for t, _o, n, _w in events if n is State.STARTING]
        assert len(starts) == 4  # no busy loop: exactly max_failures attempts
        backoffs = [(t, w or "") for t, _o, n, w in events if n is State.BACKOFF]
        # the delays chosen: 0.1 s, 0.2 s, 0.4 s, growing and capped by backoff_max_s=0.4 ...
        assert [w.rsplit("restarting in ", 1)[-1] for _t, w in backoffs] == \
            ["0.1s", "0.2s", "0.4s"]
        # ... and each kept: from the crash to the next start (a loaded machine only adds)
        waits = [start - t for (t, _w), start in zip(backoffs, starts[1:], strict=True)]
        assert all(w >= d for w, d in zip(waits, (0.1, 0.2, 0.4), strict=True)), waits
        assert waits[2] < 5.0
        # FAILED is terminal: nothing restarts it, and waiting answers at once.
        await asyncio.sleep(0.6)  # the thing under test: nothing happens in this time
        assert sup.status().state is State.FAILED
        t1 = time.monotonic()
        assert await sup.wait_ready(5) is None and time.monotonic() - t1 < 0.1
        await sup.stop(1)
        assert time.monotonic() - t0 < 15

    run(scenario())


def test_slow_load_with_progress_is_not_a_stall(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"load_s": 1.5, "progress_s": 0.1}, tmp_path, load_stall_s=0.5)
        await sup.start()
        assert await sup.wait_ready(10) is not None
        assert State.BACKOFF not in [e[2] for e in events]
        await sup.stop(3)

    run(scenario())


def test_silent_load_is_a_stall(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"load_s": 30, "silent_load": 1}, tmp_path, load_stall_s=0.6)
        await sup.start()
        assert "no loading progress" in await backoff(events)
        await sup.stop(3)

    run(scenario())


def test_wedged_child_is_restarted_by_token_watchdog(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"wedge_after_chunks": 2, "counter": tmp_path / "n",
                            "fault_starts": 1}, tmp_path, wedge_s=0.6)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        got: list[str] = []

        async def stream() -> None:
            async with httpx.AsyncClient(base_url=up.base_url, timeout=30) as c, c.stream(
                    "POST", "/completion", headers={"Authorization": f"Bearer {up.api_key}"},
                    json={"prompt": "x", "n_predict": 50, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line:
                        got.append(line)

        task = asyncio.create_task(stream())
        up2 = await sup.wait_ready(0.1)
        assert up2 is not None and up2.generation == 1  # still healthy as far as /health goes
        assert "no token progress" in await backoff(events)
        with pytest.raises(httpx.HTTPError):
            await task
        assert len(got) == 2
        up3 = await sup.wait_ready(10)
        assert up3 is not None and up3.generation == 2
        await sup.stop(3)

    run(scenario())


@pytest.mark.parametrize(("gpu_layers", "restarted"), [(0, False), (99, True)])
def test_a_long_prompt_batch_on_the_cpu_is_not_taken_for_a_wedge(
        tmp_path: Path, gpu_layers: int, restarted: bool) -> None:
    """No decode for 3 s while the child computes: on a CPU launch that is work, not a wedge;
    a GPU launch keeps the counters alone (a hung GPU can keep a thread spinning)."""
    async def scenario() -> None:
        sup, events = make({"busy_s": 3}, tmp_path, wedge_s=0.6, gpu_layers=gpu_layers)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        if restarted:
            with pytest.raises(httpx.HTTPError):
                await chat(up.base_url, up.api_key)
            assert "no token progress" in await backoff(events)
        else:
            r = await chat(up.base_url, up.api_key)
            assert r.status_code == 200
            assert [e[2] for e in events] == [State.STARTING, State.READY]
        await sup.stop(3)

    run(scenario())


def test_front_stall_report_restarts_only_a_wedged_child(tmp_path: Path, caplog: Any) -> None:
    async def scenario() -> None:
        sup, events = make({"wedge_after_chunks": 1, "counter": tmp_path / "n",
                            "fault_starts": 1}, tmp_path, wedge_s=0.0)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        sup.report_stall(up.generation, "no token for 30s")  # but nothing is processing
        await until("the stall report looked at", lambda: "stall report ignored" in caplog.text,
                    10)
        assert sup.status().state is State.READY and sup.status().upstream == up

        async def stream() -> None:
            async with httpx.AsyncClient(base_url=up.base_url, timeout=30) as c, c.stream(
                    "POST", "/completion", headers={"Authorization": f"Bearer {up.api_key}"},
                    json={"prompt": "x", "n_predict": 50, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass

        task = asyncio.create_task(stream())
        await until("the stream wedged", logged(tmp_path, "fault: wedged"), 10)
        sup.report_stall(up.generation + 7, "from a child long gone")
        await asyncio.sleep(0.5)  # the thing under test: nothing happens in this time
        assert sup.status().state is State.READY  # wrong generation: ignored
        sup.report_stall(up.generation, "no token for 30s")
        await left_ready(sup)
        up2 = await sup.wait_ready(10)
        assert up2 is not None and up2.generation == 2
        assert any("stopped producing tokens" in (e[3] or "") for e in events)
        with pytest.raises(httpx.HTTPError):
            await task
        await sup.stop(3)

    with caplog.at_level(logging.INFO, logger="mtpwrap.supervisor"):
        run(scenario())


def test_sigterm_ignored_kills_the_group_and_frees_the_port(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, _ = make({"ignore_sigterm": 1, "grandchild": 1}, tmp_path)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        pid = sup.status().pid
        assert pid is not None
        await until("the grandchild's pid logged", logged(tmp_path, "grandchild pid "), 10)
        text = (tmp_path / "llama-server.log").read_text()
        grandchild = int(text.split("grandchild pid ")[1].split()[0])
        assert alive(grandchild) and os.getpgid(grandchild) == pid
        t0 = time.monotonic()
        await sup.stop(0.8)
        took = time.monotonic() - t0
        assert 0.8 <= took < 3
        assert sup.status().last_exit == "signal 9 (SIGKILL)"
        await until("the grandchild gone", lambda: not alive(grandchild), 5)
        assert not alive(pid) and not alive(grandchild)
        port = int(up.base_url.rsplit(":", 1)[1])
        with socket.socket() as s:
            # No listener is left (TIME_WAIT of closed client connections is fine for a
            # server socket with SO_REUSEADDR, which llama-server sets).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()

    run(scenario())


def test_child_dies_when_mtpwrap_is_sigkilled(tmp_path: Path) -> None:
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from tests.helpers import make
async def main():
    sup, _ = make({{}})
    await sup.start()
    await sup.wait_ready(10)
    print(sup.status().pid, flush=True)
    await asyncio.sleep(60)  # mtpwrap stays alive until the test kills it
asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert alive(child)
        proc.kill()
        proc.wait()
        wait_for("the child gone", lambda: not alive(child), 5, every=0.05)
        assert not alive(child)
    finally:
        proc.kill()


def test_drain_keeps_the_child_serving_until_stop(tmp_path: Path) -> None:
    go = tmp_path / "go"

    async def scenario() -> None:
        # the stream stops after its first token until the test lets it go: it is in flight
        # when the drain begins, however slowly the test gets there
        sup, events = make({"token_delay_s": 0.05, "stream_hold": go}, tmp_path)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        inflight = asyncio.create_task(chat(up.base_url, up.api_key, stream=True, n=15))
        await until("the stream started", logged(tmp_path, "POST /v1/chat/completions"), 10)
        sup.begin_drain()
        assert sup.status().state is State.DRAINING
        assert await sup.wait_ready(5) is None  # at once: no new work for this instance
        assert not inflight.done()
        go.touch()
        r = await inflight
        assert r.status_code == 200 and "[DONE]" in r.text  # the stream finished whole
        await sup.stop(3)
        assert [e[2] for e in events][-3:] == [State.DRAINING, State.STOPPING, State.STOPPED]
        assert sup.status().last_exit == "exit 0"

    run(scenario())


def test_gpu_memory_still_held_is_retried_not_failed(tmp_path: Path) -> None:
    async def scenario() -> None:
        # Two starts fail with a CUDA out-of-memory message; max_failures=1 would make any
        # ordinary crash terminal, so this proves OOM starts are counted separately.
        sup, events = make({"oom": 1, "counter": tmp_path / "n", "fault_starts": 2},
                           tmp_path, max_failures=1)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None and up.generation == 3
        assert State.FAILED not in [e[2] for e in events]
        assert sum(1 for e in events if e[2] is State.BACKOFF) == 2
        await sup.stop(3)

    run(scenario())


def test_oom_steps_down_then_fails_when_nothing_fits(tmp_path: Path, caplog: Any) -> None:
    steps: list[int] = []

    async def scenario() -> None:
        sup, events = make({"oom": 1}, tmp_path, oom_step_down=True, oom_step_after=1,
                           oom_max_retries=5, steps=steps)
        await sup.start()
        assert await sup.wait_ready(20) is None
        st = sup.status()
        assert st.state is State.FAILED and "out of GPU memory at load 5 times" in (st.reason or "")
        # the rung it stopped at is reported (status, /healthz, metric, state file)
        assert (st.step, st.step_note) == (2, "step 2")
        assert st.to_dict()["step_down"] == 2
        await sup.stop(1)

    with caplog.at_level(logging.WARNING, logger="mtpwrap.supervisor"):
        run(scenario())
    assert steps[0] == 0 and max(steps) == 3 and 2 in steps  # 0 → 1 → 2, no step 3 exists
    assert "stepping down (step 1): step 1" in caplog.text
    assert "no cheaper configuration left" in caplog.text


def test_memory_growth_recycles_without_failing_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"grow_mb_per_s": 60, "token_delay_s": 0.05,
                            "counter": tmp_path / "n", "fault_starts": 1},
                           tmp_path, rss_limit_mb=90, memory_interval_s=0.1)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        results = []
        while sup.status().state is State.READY:
            results.append(await chat(up.base_url, up.api_key, stream=True, n=6))
        assert any("recycling llama-server: memory" in (e[3] or "") for e in events)
        up2 = await sup.wait_ready(15)
        assert up2 is not None and up2.generation == 2
        assert all(r.status_code == 200 and "[DONE]" in r.text for r in results)
        assert State.BACKOFF not in [e[2] for e in events]
        await sup.stop(3)

    run(scenario())


def test_child_output_goes_to_a_file_and_rate_limited_to_the_log(tmp_path: Path,
                                                                  caplog: Any) -> None:
    async def scenario() -> None:
        sup, _ = make({"load_s": 0.6, "progress_s": 0.002}, tmp_path, log_lines_per_s=5)
        await sup.start()
        assert await sup.wait_ready(10) is not None
        await sup.stop(3)

    with caplog.at_level(logging.INFO, logger="mtpwrap.child"):
        run(scenario())
    in_file = (tmp_path / "llama-server.log").read_text().count("loading model tensors")
    in_log = caplog.text.count("loading model tensors")
    assert in_file > 100 and in_log < 40
    assert "lines not shown; see" in caplog.text
    assert "llama-server[" in caplog.text


def test_out_of_memory_while_serving_is_a_crash_not_a_load_failure(tmp_path: Path) -> None:
    """An out-of-memory line from a child that was READY (a long request) does not step the
    launch down: only a start that runs out of memory while loading does."""
    steps: list[int] = []

    async def scenario() -> None:
        sup, events = make({"oom_after_s": 0.3}, tmp_path, oom_step_down=True,
                           oom_step_after=1, max_failures=2, steps=steps)
        await sup.start()
        assert await sup.wait_ready(10) is not None
        await until("FAILED", lambda: sup.status().state is State.FAILED, 20, every=0.1)
        st = sup.status()
        assert st.state is State.FAILED and "failed 2 times" in (st.reason or ""), st.reason
        assert st.step == 0
        await sup.stop(1)

    run(scenario())
    assert steps and set(steps) == {0}


def test_restart_swaps_the_child_after_in_flight_requests_finish(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make({"token_delay_s": 0.05}, tmp_path)
        await sup.start()
        up = await sup.wait_ready(10)
        assert up is not None
        old_pid = sup.status().pid
        streaming = asyncio.create_task(chat(up.base_url, up.api_key, stream=True, n=20))
        await until("the stream started", logged(tmp_path, "POST /v1/chat/completions"), 10)
        ok, message = await sup.reload(None, drain_s=10)
        assert ok and message == "llama-server restarted"
        done = await streaming  # it was let finish on the old child
        assert done.status_code == 200 and "[DONE]" in done.text
        st = sup.status()
        assert st.state is State.READY and st.pid != old_pid and not alive(old_pid or 0)
        assert st.upstream is not None and st.upstream.generation == 2
        assert State.BACKOFF not in [e[2] for e in events]
        await sup.stop(3)

    run(scenario())


def test_a_reload_whose_child_does_not_start_goes_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, events = make(None, tmp_path)
        await sup.start()
        assert await sup.wait_ready(10) is not None
        ok, message = await sup.reload(fake_factory({"exit": 3}), drain_s=5)
        assert not ok and "did not start" in message and "previous configuration" in message
        up = await sup.wait_ready(10)
        assert up is not None and up.generation == 3  # old, broken new, old again
        # The previous command is back for good: a later restart uses it too.
        ok, _ = await sup.reload(None, drain_s=5)
        assert ok and sup.status().state is State.READY
        assert State.FAILED not in [e[2] for e in events]
        await sup.stop(3)

    run(scenario())


def test_a_reload_pending_at_stop_is_answered(tmp_path: Path) -> None:
    loaded = tmp_path / "loaded"

    async def scenario() -> None:
        # the child loads until the test lets it: "not ready yet" is pinned
        sup, _ = make({"hold_until": loaded}, tmp_path)
        await sup.start()
        ok, message = await sup.reload(fake_factory(None), drain_s=5)
        assert ok and "applies to its next start" in message  # not ready yet: nothing to swap
        loaded.touch()
        assert await sup.wait_ready(10) is not None
        pending = asyncio.create_task(sup.reload(None, drain_s=5))
        await asyncio.sleep(0)  # one yield: the task files its reload (no await comes before)
        await sup.stop(3)
        assert await asyncio.wait_for(pending, 5) == (False, "mtpwrap is shutting down")
        assert sup.status().state is State.STOPPED

    run(scenario())
