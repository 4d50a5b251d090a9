"""The running instance's own check of a reload: a configuration that does not fit the GPU is
refused there, with the running child untouched. The child is the fake llama-server (the
recorded RTX 4090 and the fork's recorded --help stand in for what this machine lacks)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from mtpwrap.config import settings
from mtpwrap.decide import hardware
from mtpwrap.front.info import ServeInfo
from mtpwrap.service import reload as reloading
from mtpwrap.service import startup
from mtpwrap.supervision.state import State
from tests.helpers import DATA, make


def test_a_reload_that_does_not_fit_is_refused_by_the_running_instance(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fork_binary: Path,
        model_27b: Path) -> None:
    snap = hardware.load_snapshot(DATA / "snapshots" / "rtx4090.json")
    small = dataclasses.replace(snap.gpus[0], memory_free=8 * 2**30)
    monkeypatch.setattr(hardware, "snapshot",
                        lambda *a, **k: dataclasses.replace(snap, gpus=(small,)))
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text(f"profile: 4090-128k-q8\nmodel: {model_27b}\nbinary: {fork_binary}\n")
    running = settings.load_settings({}, env={}, config=cfg)
    inputs = {"cli": {}, "env": {}, "config": str(cfg)}

    async def scenario() -> None:
        sup, events = make(None, tmp_path)
        await sup.start()
        assert await sup.wait_ready(10) is not None
        pid = sup.status().pid
        runtime = startup.Runtime(settings=running, info=ServeInfo(),
                                  supervisor=startup.supervisor_config(running),
                                  front=startup.proxy_config(running, {}, 1))
        res = await reloading.apply_reload(reloading.ReloadKind.RELOAD, sup, None, inputs,
                                           runtime, None)
        assert res.outcome == "refused" and res.exit_code == 78 and res.runtime is None
        assert "llama-server left as it was" in res.message
        assert "but the device has 8.00 GiB" in res.message
        st = sup.status()
        assert st.state is State.READY and st.pid == pid and st.restarts == 0
        assert [e[2] for e in events].count(State.STARTING) == 1  # nothing was restarted
        await sup.stop(3)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_reload_restarts_only_what_would_run_another_command() -> None:
    from mtpwrap.decide.endpoint import Endpoint
    from mtpwrap.supervision.child import ChildCommand
    from mtpwrap.supervision.supervisor import LaunchFactory

    def factory(*argv: str, **env: str) -> LaunchFactory:
        def make(endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
            rung = [f"--rung={step}"] if step else []
            return ChildCommand([*argv, "--port", str(endpoint.port), *rung],
                                {"LLAMA_API_KEY": api_key, **env})
        return make

    running = factory("llama-server", "-c", "4096")
    assert reloading.same_command(running, 0, factory("llama-server", "-c", "4096"))
    assert not reloading.same_command(running, 0, factory("llama-server", "-c", "8192"))
    assert not reloading.same_command(running, 0, factory("llama-server", "-c", "4096",
                                                          CUDA_VISIBLE_DEVICES="1"))
    # a running launch stepped down after out-of-memory starts runs another command
    assert not reloading.same_command(running, 1, factory("llama-server", "-c", "4096"))


def test_a_companion_whose_command_is_unchanged_is_left_running() -> None:
    from mtpwrap.supervision.state import SupervisorStatus

    class Companion:
        """A ready companion's supervisor as reload sees it."""

        def __init__(self) -> None:
            self.asked = 0

        def status(self) -> SupervisorStatus:
            return SupervisorStatus(State.READY, None, 0, None, None, None, None, None, None)

        async def reload(self, factory: object, drain_s: float) -> tuple[bool, str]:
            self.asked += 1
            return True, "restarted"

    kids = {"same": Companion(), "new": Companion()}
    failed, notes = asyncio.run(reloading._swap_companions(
        kids, None, 5.0, frozenset({"same"})))  # type: ignore[arg-type]
    assert (kids["same"].asked, kids["new"].asked) == (0, 1)
    assert failed == [] and notes == ["companion same unchanged: not restarted"]


def test_a_new_runtime_reaches_each_companions_supervisor(tmp_path: Path) -> None:
    """The companions' supervisors run on the runtime the service holds: after a swap, on the
    new one's settings (with each its own log file), not on the ones they started with."""
    import socket

    from mtpwrap.decide.endpoint import Endpoint
    from mtpwrap.service import server

    s = settings.load_settings({}, env={})
    embed = startup.CompanionRun("embed", "embedding", "e.gguf", 1, None,  # type: ignore[arg-type]
                                 Endpoint(), "")
    old = startup.Runtime(settings=s, info=ServeInfo(), supervisor=startup.supervisor_config(s),
                          front=startup.proxy_config(s, {}, 1), companions=(embed,))
    sock = socket.socket()
    try:
        svc = server.Service(old, sock)
        assert svc.companions["embed"].config.backoff_initial_s == 1.0
        new = dataclasses.replace(old, supervisor=dataclasses.replace(
            old.supervisor, backoff_initial_s=3.0, max_failures=2))
        svc._use(new)
        (c,) = svc.companions.values()
        assert (c.config.backoff_initial_s, c.config.max_failures) == (3.0, 2)
        assert c.config.log_file == embed.log_file() != svc.sup.config.log_file
        assert svc.sup.config.backoff_initial_s == 3.0 and svc.runtime.supervisor is new.supervisor
    finally:
        sock.close()
