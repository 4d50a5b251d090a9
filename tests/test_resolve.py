"""`up`'s resolving step on a recorded RTX 4090: profile, memory plan and argv before anything
starts. The fork cannot be built here, so its recorded --help stands in for the binary, and the
27B model is a shape-only GGUF (real header and tensor shapes, sparse file)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mtpwrap import settings
from mtpwrap.build import tiny_gguf
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError
from mtpwrap.run import service

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def fork_binary(tmp_path: Path) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n"
                   f'case "$1" in --help) cat "{DATA}/help/fork-1c6e4ea.txt";; '
                   f'--version) cat "{DATA}/help/fork-1c6e4ea.version.txt";; *) exit 1;; esac\n')
    exe.chmod(0o755)
    return exe


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.write_shape_only(tmp_path_factory.mktemp("m") / "qwen3.6-27b.gguf")


def resolve(monkeypatch: pytest.MonkeyPatch, profile: str, model: Path, binary: Path,
            free_gib: float | None = None) -> service.Launch:
    snap = hardware.load_snapshot(DATA / "snapshots" / "rtx4090.json")
    if free_gib is not None:
        gpu = dataclasses.replace(snap.gpus[0], memory_free=int(free_gib * 2**30))
        snap = dataclasses.replace(snap, gpus=(gpu,))
    monkeypatch.setattr(hardware, "snapshot", lambda *a, **k: snap)
    s = settings.load_settings({"profile": profile, "model": str(model), "binary": str(binary)},
                               env={})
    return service.resolve_launch(s)


def test_plan_on_a_4090_fits_and_argv_carries_the_profile(monkeypatch: pytest.MonkeyPatch,
                                                         fork_binary: Path,
                                                         model_27b: Path) -> None:
    launch = resolve(monkeypatch, "4090-128k-q8", model_27b, fork_binary)
    assert launch.deferred is None  # a GPU plan is made before anything starts
    assert "GiB on the GPU at context 131,072" in launch.info["memory_plan"]
    assert launch.info["kv"] == "q8_0 / q8_0" and launch.info["speculation"] == "mtp"
    spec = launch.factory(4321, "secret-key", 0)
    assert spec is not None
    assert spec.argv[spec.argv.index("--port") + 1] == "4321"
    assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    assert "secret-key" not in spec.argv and "secret-key" in spec.env.values()


def test_plan_that_does_not_fit_stops_before_the_start(monkeypatch: pytest.MonkeyPatch,
                                                      fork_binary: Path,
                                                      model_27b: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs .* GiB .* but the device has 8\.00 GiB"):
        resolve(monkeypatch, "4090-128k-q8", model_27b, fork_binary, free_gib=8)


def test_unknown_kv_size_plans_nothing_but_still_launches(monkeypatch: pytest.MonkeyPatch,
                                                        fork_binary: Path,
                                                        model_27b: Path) -> None:
    # tbq4_0 is sized by measuring the built fork; without that measurement nothing is refused.
    launch = resolve(monkeypatch, "4090-262k", model_27b, fork_binary)
    assert launch.info["memory_plan"].startswith("not planned (KV cache type 'tbq4_0'")
    spec = launch.factory(1, "k" * 20, 0)
    assert spec is not None and spec.argv[spec.argv.index("-ctk"):][:2] == ["-ctk", "tbq4_0"]


def test_cpu_profile_defers_the_plan(monkeypatch: pytest.MonkeyPatch, fork_binary: Path,
                                    tmp_path: Path) -> None:
    tiny = tiny_gguf.write_tiny_random(tmp_path / "tiny.gguf", arch="llama", mtp=False)
    launch = resolve(monkeypatch, "cpu-demo", tiny, fork_binary)
    assert launch.info["memory_plan"] is None and launch.deferred is not None
    launch.deferred()
    assert "GiB on the host at context 4,096" in launch.info["memory_plan"]
