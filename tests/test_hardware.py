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

from mtpwrap import hardware
from mtpwrap.hardware import GpuInfo, HardwareSnapshot, RecordedNvml

SNAPSHOTS = Path(__file__).parent / "data" / "snapshots"
MiB = 1024 * 1024


def load(name: str) -> dict[str, Any]:
    return json.loads((SNAPSHOTS / f"{name}.json").read_text())


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
    assert snap.total_gpu_memory == 2 * 24576 * MiB


def test_no_driver_snapshot_says_why() -> None:
    snap = hardware.snapshot(RecordedNvml(load("none")))
    assert snap.gpus == ()
    assert not snap.has_gpu
    assert "NVML library" in (snap.error or "")
    assert snap.cpu_logical == 2  # the host part is still there


def test_driver_not_loaded_and_zero_gpus() -> None:
    rec = {"format": hardware.RECORD_FORMAT, "host": {},
           "init_error": {"code": hardware.NVML_ERROR_DRIVER_NOT_LOADED, "message": "x"}}
    assert hardware.snapshot(RecordedNvml(rec)).error == "the NVIDIA driver is not loaded"
    empty = {"format": hardware.RECORD_FORMAT, "host": {}, "driver_version": "570.1",
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
    assert hardware.gpu_metrics() == []


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


def test_gpu_metrics_live_fields() -> None:
    m = hardware.gpu_metrics(RecordedNvml(load("h200")))
    assert len(m) == 1
    assert m[0]["memory_used"] == 644939776
    assert m[0]["power_w"] == 78.7 and m[0]["power_limit_w"] == 700.0
    assert m[0]["throttle_reasons"] == ["gpu_idle"]
    two = hardware.gpu_metrics(RecordedNvml(load("two-rtx3090")))
    assert two[1]["power_w"] is None and two[1]["throttle_reasons"] == []


def test_gpu_metrics_never_raises() -> None:
    assert hardware.gpu_metrics(RecordedNvml(load("none"))) == []

    class Broken(RecordedNvml):
        def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
            raise RuntimeError("GPU fell off the bus")

    out = hardware.gpu_metrics(Broken(load("rtx4090")))
    assert out == []


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
