"""`up`'s resolving step on a recorded RTX 4090: profile, memory plan and argv before anything
starts. The fork cannot be built here, so its recorded --help stands in for the binary, and the
27B model is a shape-only GGUF (real header and tensor shapes, sparse file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpwrap import settings
from mtpwrap.build import tiny_gguf
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


def replay(tmp_path: Path, free_gib: float | None = None) -> Path:
    """The recorded RTX 4090, with less memory free when asked."""
    record = json.loads((DATA / "snapshots" / "rtx4090.json").read_text())
    if free_gib is not None:
        record["devices"][0]["memory"]["free"] = int(free_gib * 2**30)
    path = tmp_path / "rtx4090.json"
    path.write_text(json.dumps(record))
    return path


def resolve(tmp_path: Path, profile: str, model: Path, binary: Path,
            free_gib: float | None = None) -> service.Launch:
    s = settings.load_settings({"profile": profile, "model": str(model), "binary": str(binary),
                                "hw_replay": str(replay(tmp_path, free_gib))}, env={})
    return service.resolve_launch(s)


def test_plan_on_a_4090_fits_and_argv_carries_the_profile(tmp_path: Path,
                                                         fork_binary: Path,
                                                         model_27b: Path) -> None:
    launch = resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary)
    assert launch.deferred is None  # a GPU plan is made before anything starts
    assert "GiB on the GPU at context 131,072" in launch.info["memory_plan"]
    assert launch.info["kv"] == "q8_0 / q8_0" and launch.info["speculation"] == "mtp"
    spec = launch.factory(4321, "secret-key", 0)
    assert spec is not None
    assert spec.argv[spec.argv.index("--port") + 1] == "4321"
    assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    assert "secret-key" not in spec.argv and "secret-key" in spec.env.values()


def test_plan_that_does_not_fit_stops_before_the_start(tmp_path: Path,
                                                      fork_binary: Path,
                                                      model_27b: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs .* GiB .* but the device has 8\.00 GiB"):
        resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary, free_gib=8)


def test_unknown_kv_size_plans_nothing_but_still_launches(tmp_path: Path,
                                                        fork_binary: Path,
                                                        model_27b: Path) -> None:
    # tbq4_0 is sized by measuring the built fork; without that measurement nothing is refused.
    launch = resolve(tmp_path, "4090-262k", model_27b, fork_binary)
    assert launch.info["memory_plan"].startswith("not planned (KV cache type 'tbq4_0'")
    spec = launch.factory(1, "k" * 20, 0)
    assert spec is not None and spec.argv[spec.argv.index("-ctk"):][:2] == ["-ctk", "tbq4_0"]


def test_cpu_profile_defers_the_plan(tmp_path: Path, fork_binary: Path) -> None:
    tiny = tiny_gguf.write_tiny_random(tmp_path / "tiny.gguf", arch="llama", mtp=False)
    launch = resolve(tmp_path, "cpu-demo", tiny, fork_binary)
    assert launch.info["memory_plan"] is None and launch.deferred is not None
    launch.deferred()
    assert "GiB on the host at context 4,096" in launch.info["memory_plan"]
