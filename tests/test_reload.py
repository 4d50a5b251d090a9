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
from mtpwrap.service import reload as reloading
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
        res = await reloading.apply_reload(reloading.ReloadKind.RELOAD, sup, None, inputs,
                                           running, None)
        assert res.outcome == "refused" and res.exit_code == 78 and res.launch is None
        assert "llama-server left as it was" in res.message
        assert "but the device has 8.00 GiB" in res.message
        st = sup.status()
        assert st.state is State.READY and st.pid == pid and st.restarts == 0
        assert [e[2] for e in events].count(State.STARTING) == 1  # nothing was restarted
        await sup.stop(3)

    asyncio.run(asyncio.wait_for(scenario(), 60))
