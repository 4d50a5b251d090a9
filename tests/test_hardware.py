"""Hardware snapshots replayed from NVML recordings (tests/data/snapshots/).

h200.json was recorded live on an H200 machine and its values cross-checked against that
machine's `nvidia-smi --query-gpu` output (h200-nvidia-smi.csv); the other boards are composed
from published values (see tests/data/snapshots/README.md).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.decide import hardware
from mtpwrap.decide.hardware import GpuInfo, HardwareSnapshot
from mtpwrap.decide.nvml_replay import RECORD_FORMAT, RecordedNvml
from tests.helpers import SNAPSHOTS
from tests.helpers import load_snapshot as load

MiB = 1024 * 1024


# name, count, first GPU name, compute capability, cuda arch, total MiB
EXPECTED = [
    ("rtx4090", 1, "NVIDIA GeForce RTX 4090", (8, 9), "89", 24564),
    ("rtx3090", 1, "NVIDIA GeForce RTX 3090", (8, 6), "86", 24576),
    ("rtx5090", 1, "NVIDIA GeForce RTX 5090", (12, 0), "120", 32607),
    ("h100", 1, "NVIDIA H100 80GB HBM3", (9, 0), "90", 81559),
    ("h200", 1, "NVIDIA H200", (9, 0), "90", 143771),
    ("two-rtx3090", 2, "NVIDIA GeForce RTX 3090", (8, 6), "86", 24576),
]


@pytest.mark.parametrize("name,count,gpu_name,cc,arch,total_mib", EXPECTED)
def test_snapshot_from_recording(name: str, count: int, gpu_name: str, cc: tuple[int, int],
                                 arch: str, total_mib: int) -> None:
    rec = load(name)
    nvml = RecordedNvml(rec)
    snap = hardware.snapshot(nvml)
    assert snap.error is None
    assert len(snap.gpus) == count
    g = snap.gpus[0]
    assert g.name == gpu_name
    assert g.compute_capability == cc
    assert g.cuda_arch == arch
    assert g.memory_total == total_mib * MiB
    assert g.memory_free == rec["devices"][0]["memory"]["free"]
    assert g.uuid == rec["devices"][0]["uuid"]
    assert g.power_limit_w == rec["devices"][0]["power_management_limit_mw"] / 1000
    assert snap.cpu_logical == rec["host"]["cpu_logical"]
    assert snap.ram_total == rec["host"]["ram_total"]
    # every nvmlInit was matched by a shutdown
    assert nvml.initialized == 0


def test_h200_recording_agrees_with_nvidia_smi() -> None:
    """The one live recording: what NVML answered equals what nvidia-smi printed there."""
    snap = hardware.snapshot(RecordedNvml(load("h200")))
    with (SNAPSHOTS / "h200-nvidia-smi.csv").open() as f:
        row = {k.strip(): v.strip() for k, v in next(csv.DictReader(f)).items()}
    g = snap.gpus[0]
    assert g.name == row["name"]
    assert g.uuid == row["uuid"]
    assert g.memory_total == int(row["memory.total [MiB]"].split()[0]) * MiB
    assert f"{g.compute_capability[0]}.{g.compute_capability[1]}" == row["compute_cap"]
    assert g.driver_version == row["driver_version"]
    assert g.power_limit_w == float(row["power.limit [W]"].split()[0])
    assert g.pcie_gen == int(row["pcie.link.gen.current"])
    assert g.pcie_width == int(row["pcie.link.width.current"])
    assert snap.cuda_driver_version == "13.0"


def test_unsupported_fields_are_none_not_guesses() -> None:
    snap = hardware.snapshot(RecordedNvml(load("two-rtx3090")))
    first, second = snap.gpus
    assert first.utilization_gpu == 3
    assert second.utilization_gpu is None and second.utilization_memory is None
    # the rest of the second board is still read
    assert second.memory_total == 24576 * MiB and second.pcie_width == 8
    assert [g.memory_total for g in snap.gpus] == [24576 * MiB] * 2


def test_no_driver_snapshot_says_why() -> None:
    snap = hardware.snapshot(RecordedNvml(load("none")))
    assert snap.gpus == ()
    assert not snap.has_gpu
    assert "NVML library" in (snap.error or "")
    assert snap.cpu_logical == 2  # the host part is still there


def test_driver_not_loaded_and_zero_gpus() -> None:
    rec = {"format": RECORD_FORMAT, "host": {},
           "init_error": {"code": hardware.NVML_ERROR_DRIVER_NOT_LOADED, "message": "x"}}
    assert hardware.snapshot(RecordedNvml(rec)).error == "the NVIDIA driver is not loaded"
    empty = {"format": RECORD_FORMAT, "host": {}, "driver_version": "570.1",
             "cuda_driver_version": 12080, "devices": []}
    snap = hardware.snapshot(RecordedNvml(empty))
    assert snap.gpus == () and "no GPU" in (snap.error or "")
    assert snap.driver_version == "570.1" and snap.cuda_driver_version == "12.8"


def test_missing_pynvml_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pynvml":
            raise ImportError("no pynvml")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    snap = hardware.snapshot()
    assert snap.gpus == () and "pynvml" in (snap.error or "")
    with pytest.raises(hardware.NvmlUnavailable, match="pynvml"):
        hardware.NvmlSession().readings()


@pytest.mark.parametrize("name", ["rtx4090", "h200", "two-rtx3090", "none"])
def test_to_dict_round_trip(name: str) -> None:
    snap = hardware.snapshot(RecordedNvml(load(name)))
    data = json.loads(json.dumps(snap.to_dict()))
    again = HardwareSnapshot.from_dict(data)
    assert again == snap
    assert all(isinstance(g, GpuInfo) for g in again.gpus)


def test_record_then_replay_reproduces_the_snapshot() -> None:
    """record() through a replayed NVML writes a recording that replays to the same snapshot."""
    original = RecordedNvml(load("two-rtx3090"))
    again = hardware.record(original)
    again["host"] = load("two-rtx3090")["host"]
    assert hardware.snapshot(RecordedNvml(again)) == hardware.snapshot(original)


def test_gpu_readings_live_fields() -> None:
    m = hardware.NvmlSession(RecordedNvml(load("h200"))).readings()
    assert len(m) == 1
    assert m[0].memory_used == 644939776
    assert m[0].power_w == 78.7 and m[0].power_limit_w == 700.0
    assert m[0].throttle_reasons == ("gpu_idle",)
    two = hardware.NvmlSession(RecordedNvml(load("two-rtx3090"))).readings()
    assert two[1].power_w is None and two[1].throttle_reasons == ()


def test_an_nvml_session_opens_nvml_once_and_raises_only_when_it_cannot() -> None:
    nvml = RecordedNvml(load("h200"))
    session = hardware.NvmlSession(nvml)
    assert [len(session.readings()) for _ in range(3)] == [1, 1, 1]
    assert nvml.initialized == 1  # one nvmlInit for every read
    session.close()
    assert nvml.initialized == 0

    class Broken(RecordedNvml):
        def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
            raise RuntimeError("GPU fell off the bus")

    assert hardware.NvmlSession(Broken(load("rtx4090"))).readings() == []
    with pytest.raises(hardware.NvmlUnavailable):
        hardware.NvmlSession(RecordedNvml(load("none"))).readings()


def test_throttle_reason_names() -> None:
    assert hardware.throttle_reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert hardware.throttle_reason_names(0x1000) == ["other_0x1000"]
    assert hardware.throttle_reason_names(None) == []


def test_load_snapshot_accepts_recordings_and_saved_snapshots(tmp_path: Path) -> None:
    snap = hardware.load_snapshot(SNAPSHOTS / "rtx4090.json")
    assert snap.gpus[0].name == "NVIDIA GeForce RTX 4090"
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(snap.to_dict()))
    assert hardware.load_snapshot(saved) == snap
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    from mtpwrap.errors import ConfigError

    with pytest.raises(ConfigError, match="not an NVML recording"):
        hardware.load_snapshot(bad)


def test_host_info_without_psutil_reads_proc() -> None:
    import os

    import psutil

    info = hardware.host_info(use_psutil=False)
    assert info["cpu_physical"] is None  # unknown without psutil, not guessed
    assert info["cpu_logical"] == os.cpu_count()
    # /proc/meminfo and psutil agree on the total (both read the kernel's MemTotal)
    assert info["ram_total"] == psutil.virtual_memory().total


# ---------------------------------------------------------------- live NVML (GPU machines only)


def _nvidia_smi_rows() -> list[dict[str, str]]:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    fields = ["name", "uuid", "memory.total", "compute_cap", "driver_version", "power.limit",
              "pcie.link.width.current"]
    proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                           "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return []
    return [dict(zip(fields, (v.strip() for v in line.split(",")), strict=True))
            for line in proc.stdout.strip().splitlines()]


def test_live_snapshot_agrees_with_nvidia_smi() -> None:
    """On a machine with an NVIDIA GPU: the real pynvml path against nvidia-smi's answers."""
    rows = _nvidia_smi_rows()
    if not rows:
        pytest.skip("no NVIDIA GPU (nvidia-smi missing or failing)")
    snap = hardware.snapshot()
    assert snap.error is None
    assert len(snap.gpus) == len(rows)
    for g, row in zip(snap.gpus, rows, strict=True):
        assert g.name == row["name"] and g.uuid == row["uuid"]
        assert g.memory_total == int(row["memory.total"]) * MiB
        assert f"{g.compute_capability[0]}.{g.compute_capability[1]}" == row["compute_cap"]
        assert g.driver_version == row["driver_version"]
        assert g.power_limit_w == pytest.approx(float(row["power.limit"]), abs=0.1)
        assert g.pcie_width == int(row["pcie.link.width.current"])
    readings = hardware.NvmlSession().readings()
    assert [r.uuid for r in readings] == [g.uuid for g in snap.gpus]
    for r in readings:
        assert r.memory_used is not None and r.memory_total is not None
        assert 0 < r.memory_used <= r.memory_total
        assert r.power_w is not None and r.power_limit_w is not None
        assert 0 < r.power_w <= r.power_limit_w * 1.5
    # a recording made here replays to the same static facts
    replay = hardware.snapshot(RecordedNvml(hardware.record()))
    assert [(g.name, g.uuid, g.memory_total) for g in replay.gpus] == \
        [(g.name, g.uuid, g.memory_total) for g in snap.gpus]


# ---------------------------------------------------------------- CLI


def test_cli_hw_json_replay() -> None:
    from tests.helpers import run_cli

    r = run_cli("hw", "--json", "--replay", str(SNAPSHOTS / "h200.json"))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["gpus"][0]["name"] == "NVIDIA H200"
    assert data["gpus"][0]["compute_capability"] == [9, 0]
    assert data["cuda_driver_version"] == "13.0"


def test_cli_hw_record_then_replay(tmp_path: Path) -> None:
    from tests.helpers import run_cli

    rec = tmp_path / "here.json"
    r = run_cli("hw", "--record", str(rec), "--json")
    assert r.returncode == 0, r.stderr
    live = json.loads(r.stdout)
    r2 = run_cli("hw", "--json", "--replay", str(rec))
    assert r2.returncode == 0, r2.stderr
    replayed = json.loads(r2.stdout)
    for key in ("error", "cpu_logical", "cpu_physical", "ram_total", "driver_version"):
        assert replayed[key] == live[key], key
    assert [g["uuid"] for g in replayed["gpus"]] == [g["uuid"] for g in live["gpus"]]


def test_cli_hw_text_without_gpu() -> None:
    from tests.helpers import run_cli

    r = run_cli("hw", "--replay", str(SNAPSHOTS / "none.json"))
    assert r.returncode == 0, r.stderr
    assert "GPU: none (no NVIDIA driver" in r.stdout and "2 physical / 2 logical" in r.stdout
