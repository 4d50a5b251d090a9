"""A recorded NVML (`mtpwrap hw --record`) replayed as if it were pynvml: the same calls,
answering from the recording, so a snapshot of another machine reads like this one's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

#: the format tag of a recording (hardware.record writes it)
RECORD_FORMAT = "mtpwrap-nvml-record/1"
#: NVML's own constants the replay answers with (nvml.h)
NVML_ERROR_NOT_SUPPORTED = 3
NVML_TEMPERATURE_GPU = 0


class RecordedNvmlError(Exception):
    """Stands in for pynvml.NVMLError: carries the NVML return code in `.value`."""

    def __init__(self, value: int, message: str | None = None) -> None:
        super().__init__(message or f"NVML error {value}")
        self.value = value


class RecordedNvml:
    """A pynvml look-alike that answers from a `record()`: the calls mtpwrap makes, nothing more.

    A value that is missing or null in the recording raises NOT_SUPPORTED, as NVML does for a
    field a board does not report.
    """

    NVMLError = RecordedNvmlError

    def __init__(self, data: Mapping[str, Any], source: str = "recording") -> None:
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"not an NVML recording (format {data.get('format')!r})")
        self._data = data
        self._devices: list[Mapping[str, Any]] = list(data.get("devices") or [])
        self.SOURCE = source
        self.recorded_host = data.get("host")
        self.initialized = 0

    @classmethod
    def from_file(cls, path: str | Path) -> RecordedNvml:
        import json

        p = Path(path)
        return cls(json.loads(p.read_text()), source=f"recording:{p.name}")

    # -- system
    def nvmlInit(self) -> None:
        init_error = self._data.get("init_error")
        if init_error:
            raise RecordedNvmlError(init_error.get("code") or 999, init_error.get("message"))
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.initialized -= 1

    def _value(self, value: Any) -> Any:
        if value is None:
            raise RecordedNvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
        return value

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._value(self._data.get("driver_version"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._value(self._data.get("cuda_driver_version"))

    def nvmlDeviceGetCount(self) -> int:
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self._devices):
            raise RecordedNvmlError(2, "Invalid Argument")
        return index

    # -- per device
    def _dev(self, handle: int, key: str) -> Any:
        return self._value(self._devices[handle].get(key))

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._dev(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._dev(h, "uuid")

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(**self._dev(h, "memory"))

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        cc = self._dev(h, "cuda_compute_capability")
        return int(cc[0]), int(cc[1])

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self._dev(h, "power_management_limit_mw")

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._dev(h, "power_usage_mw")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self._dev(h, "pcie_link_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self._dev(h, "pcie_link_width")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        if sensor != NVML_TEMPERATURE_GPU:
            raise RecordedNvmlError(2, "Invalid Argument")
        return self._dev(h, "temperature_gpu_c")

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(**self._dev(h, "utilization"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._dev(h, "clocks_event_reasons")
