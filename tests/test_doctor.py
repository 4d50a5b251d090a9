"""`mtpwrap doctor` on this machine (no GPU) and with tools taken away."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import cli_env, run_cli


def test_doctor_json_reports_every_check(tmp_path: Path) -> None:
    env = cli_env(MTPWRAP_BUILD_DIR=str(tmp_path / "no-build"))
    r = run_cli("doctor", "--json", env=env)
    # What this machine has (the unit tier also runs without build tools: `make hermetic`).
    has_cmake = shutil.which("cmake") is not None
    has_cxx = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    assert r.returncode == (0 if has_cmake and has_cxx else 69), r.stderr
    report = json.loads(r.stdout)
    names = [c["name"] for c in report["checks"]]
    for expected in (
        "CUDA toolkit (nvcc)",
        "cmake",
        "C++ compiler",
        "ccache",
        "free disk",
        "llama-server build",
        "model file",
    ):
        assert expected in names
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["cmake"]["status"] == ("ok" if has_cmake else "missing")
    assert by_name["C++ compiler"]["status"] == ("ok" if has_cxx else "missing")
    binary = by_name["llama-server build"]
    assert binary["status"] == "missing" and "mtpwrap build" in binary["fix"]


def test_doctor_without_compiler_exits_non_zero(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    r = run_cli("doctor", env=cli_env(PATH=str(empty)))
    assert r.returncode == 69
    assert "C++ compiler" in r.stdout and "build-essential" in r.stdout


@pytest.mark.integration
def test_doctor_sees_the_real_build(cpu_manifest: dict) -> None:
    r = run_cli("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["llama-server build"]["status"] == "ok"
    assert str(cpu_manifest["source"]["commit"]) in checks["llama-server build"]["detail"]


def test_doctor_reports_a_recorded_rtx_4090() -> None:
    from mtpwrap import doctor
    from mtpwrap.decide import hardware

    snap = hardware.load_snapshot(Path(__file__).parent / "data" / "snapshots" / "rtx4090.json")
    checks = doctor.check_gpus(snap)
    assert len(checks) == 1 and checks[0].status == doctor.OK
    assert "RTX 4090" in checks[0].detail and "sm_89" in checks[0].detail
    assert "23.6 GiB" in checks[0].detail or "24.0 GiB" in checks[0].detail


def test_doctor_without_driver_warns_and_says_why() -> None:
    from mtpwrap import doctor
    from mtpwrap.decide import hardware

    snap = hardware.load_snapshot(Path(__file__).parent / "data" / "snapshots" / "none.json")
    (check,) = doctor.check_gpus(snap)
    assert check.status == doctor.WARNING and "no GPU" in check.detail
