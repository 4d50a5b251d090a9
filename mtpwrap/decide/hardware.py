"""What this machine has: GPUs through NVML, CPU cores and RAM through psutil.

NVML is passed in as a module-like object (the real `pynvml` by default), so the same code runs
against a recording: `record()` captures NVML's raw answers as JSON and `RecordedNvml` replays
them. A recording taken on a server can be replayed on a laptop (`mtpwrap hw --replay FILE`) to
see which profile and command line that server would get.

Unknown is `None`, never a guess: a field NVML does not support, or a call that fails, stays
`None`; no driver or no GPU gives a snapshot with `gpus == ()` and `error` saying why.
This is the only module that imports pynvml, and it does so inside functions.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.decide.nvml_replay import NVML_TEMPERATURE_GPU, RECORD_FORMAT, RecordedNvml
from mtpwrap.errors import ConfigError
from mtpwrap.units import GiB, MiB

#: NVML "clocks event" (throttle) reason bits, names as `nvidia-smi -q` prints them.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_CLOCK_MEM = 2


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str | None = None
    uuid: str | None = None
    memory_total: int | None = None  # bytes
    memory_free: int | None = None  # bytes
    compute_capability: tuple[int, int] | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.8": the highest CUDA the driver supports
    power_limit_w: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    temperature_c: int | None = None
    utilization_gpu: int | None = None  # percent
    utilization_memory: int | None = None  # percent
    memory_bus_width: int | None = None  # bits
    memory_clock_max_mhz: int | None = None

    @property
    def memory_bandwidth(self) -> float | None:
        """Peak memory bandwidth in bytes/s from what NVML reports: bus width × the maximum
        memory clock × 2 (double data rate)."""
        if not self.memory_bus_width or not self.memory_clock_max_mhz:
            return None
        return self.memory_bus_width / 8 * self.memory_clock_max_mhz * 1e6 * 2

    @property
    def memory_total_gib(self) -> float | None:
        return None if self.memory_total is None else self.memory_total / GiB

    @property
    def cuda_arch(self) -> str | None:
        """The CMAKE_CUDA_ARCHITECTURES value for this card ("89" for an RTX 4090)."""
        if self.compute_capability is None:
            return None
        return f"{self.compute_capability[0]}{self.compute_capability[1]}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = (
            list(self.compute_capability) if self.compute_capability is not None else None
        )
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuInfo:
        kwargs = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        cc = kwargs.get("compute_capability")
        kwargs["compute_capability"] = tuple(cc) if cc is not None else None
        return cls(**kwargs)


@dataclass(frozen=True)
class HardwareSnapshot:
    gpus: tuple[GpuInfo, ...] = ()
    cpu_physical: int | None = None
    cpu_logical: int | None = None
    ram_total: int | None = None  # bytes
    ram_available: int | None = None  # bytes
    ram_read_at: int | None = None  #: when the RAM figures were read (Unix time; None: not said)
    #: why there is no GPU information (no driver, no GPU, NVML error); None when NVML answered.
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    source: str = field(default="nvml", compare=False)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__},
                "gpus": [g.to_dict() for g in self.gpus]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareSnapshot:
        plain = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "gpus"}
        return cls(**{"source": "dict", **plain},
                   gpus=tuple(GpuInfo.from_dict(g) for g in data.get("gpus") or ()))


# --------------------------------------------------------------------------- helpers


def _text(value: Any) -> str | None:
    return (None if value is None else value.decode("utf-8", "replace")
            if isinstance(value, bytes) else str(value))


def _cuda_version_text(value: int | None) -> str | None:
    return None if value is None or value <= 0 else f"{value // 1000}.{(value % 1000) // 10}"


def _load_nvml() -> tuple[Any | None, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, "the nvidia-ml-py package (pynvml) is not installed"
    return pynvml, None


def _error_class(nvml: Any) -> type[BaseException]:
    cls = getattr(nvml, "NVMLError", None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else Exception


def _init_error_text(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    if code == NVML_ERROR_LIBRARY_NOT_FOUND:
        return "no NVIDIA driver: the NVML library (libnvidia-ml.so) was not found"
    if code == NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA driver is not loaded"
    return f"NVML failed to start: {exc}"


def _query(nvml: Any, err: type[BaseException], name: str, *args: Any) -> Any:
    """Call `nvml.<name>(*args)`; None when NVML lacks or refuses it (unknown, not a guess)."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except err:
        return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's `model name` as /proc/cpuinfo gives it (else what Python knows), for the
    benchmarks' reports."""
    import platform

    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_info(*, use_psutil: bool = True) -> dict[str, int | None]:
    """CPU cores and RAM (and when it was read). Without psutil, logical cores and RAM come
    from the OS; physical cores stay unknown."""
    ps: Any = None
    if use_psutil:
        with contextlib.suppress(ImportError):
            import psutil

            ps = psutil
    now = int(time.time())
    if ps is not None:
        vm = ps.virtual_memory()
        return {"cpu_physical": ps.cpu_count(logical=False),
                "cpu_logical": ps.cpu_count(logical=True), "ram_total": int(vm.total),
                "ram_available": int(vm.available), "ram_read_at": now}
    info: dict[str, int | None] = {"cpu_physical": None, "cpu_logical": os.cpu_count(),
                                   "ram_total": None, "ram_available": None, "ram_read_at": now}
    meminfo = {"MemTotal": "ram_total", "MemAvailable": "ram_available"}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in meminfo:
                info[meminfo[key]] = int(rest.split()[0]) * 1024
    return info


# --------------------------------------------------------------------------- snapshot


def snapshot(nvml: Any | None = None) -> HardwareSnapshot:
    """Take a hardware snapshot. Never raises for a missing driver or GPU: `error` says why."""
    source = "nvml"
    if nvml is None:
        nvml, load_error = _load_nvml()
    else:
        load_error = None
        source = getattr(nvml, "SOURCE", "nvml")
    # a recording carries the host it was made on; never mix in this machine's figures
    recorded = getattr(nvml, "recorded_host", None)
    host = recorded if recorded is not None else host_info()
    base = {k: host.get(k) for k in ("cpu_physical", "cpu_logical", "ram_total", "ram_available",
                                     "ram_read_at")}
    if nvml is None:
        return HardwareSnapshot(error=load_error, source="none", **base)  # type: ignore[arg-type]

    err = _error_class(nvml)
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError, or OSError from a broken library install
        return HardwareSnapshot(error=_init_error_text(exc), source=source, **base)  # type: ignore[arg-type]
    try:
        driver = _text(_query(nvml, err, "nvmlSystemGetDriverVersion"))
        cuda = _cuda_version_text(_query(nvml, err, "nvmlSystemGetCudaDriverVersion"))
        count = _query(nvml, err, "nvmlDeviceGetCount")
        if count is None:
            return HardwareSnapshot(error="NVML could not count the GPUs", driver_version=driver,
                                    cuda_driver_version=cuda, source=source, **base)  # type: ignore[arg-type]
        gpus = tuple(_gpu_info(nvml, err, i, driver, cuda) for i in range(int(count)))
        error = None if gpus else "the NVIDIA driver is loaded but reports no GPU"
        return HardwareSnapshot(gpus=gpus, error=error, driver_version=driver,
                                cuda_driver_version=cuda, source=source, **base)
    finally:
        _query(nvml, err, "nvmlShutdown")


def _gpu_info(nvml: Any, err: type[BaseException], index: int,
              driver: str | None, cuda: str | None) -> GpuInfo:
    handle = _query(nvml, err, "nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return GpuInfo(index=index, driver_version=driver, cuda_driver_version=cuda)

    def q(name: str, *args: Any) -> Any:
        return _query(nvml, err, name, handle, *args)

    mem = q("nvmlDeviceGetMemoryInfo")
    cc = q("nvmlDeviceGetCudaComputeCapability")
    limit_mw = q("nvmlDeviceGetPowerManagementLimit")
    util = q("nvmlDeviceGetUtilizationRates")
    return GpuInfo(
        index=index,
        name=_text(q("nvmlDeviceGetName")),
        uuid=_text(q("nvmlDeviceGetUUID")),
        memory_total=int(mem.total) if mem is not None else None,
        memory_free=int(mem.free) if mem is not None else None,
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
        driver_version=driver,
        cuda_driver_version=cuda,
        power_limit_w=round(limit_mw / 1000.0, 1) if limit_mw is not None else None,
        pcie_gen=q("nvmlDeviceGetCurrPcieLinkGeneration"),
        pcie_width=q("nvmlDeviceGetCurrPcieLinkWidth"),
        temperature_c=q("nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU),
        utilization_gpu=int(util.gpu) if util is not None else None,
        utilization_memory=int(util.memory) if util is not None else None,
        memory_bus_width=q("nvmlDeviceGetMemoryBusWidth"),
        memory_clock_max_mhz=q("nvmlDeviceGetMaxClockInfo", NVML_CLOCK_MEM),
    )


@dataclass(frozen=True)
class GpuReading:
    """One GPU's live gauges, as NVML gives them now (unknown: None)."""

    index: int
    name: str | None = None
    uuid: str | None = None
    memory_used: int | None = None  # bytes
    memory_total: int | None = None  # bytes
    utilization_gpu: int | None = None  # percent
    utilization_memory: int | None = None  # percent
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    throttle_reasons_mask: int | None = None
    throttle_reasons: tuple[str, ...] = ()


class NvmlUnavailable(Exception):
    """NVML cannot be read here: no pynvml, no driver, or its init failed (the text says which)."""


class NvmlSession:
    """NVML initialised once for a process that reads the GPUs again and again (the front's
    /metrics, /healthz and /status.json): `readings()` opens NVML on its first call and then
    only queries; a failed init is tried again on the next call; `close()` shuts NVML down.

    Its calls block (NVML init is slow without persistence mode and can hang on some drivers):
    the front calls it from a worker thread (`mtpwrap.front.gpu`), one call at a time.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self._open = False

    def readings(self) -> list[GpuReading]:
        nvml = self._nvml
        if nvml is None:
            nvml, why = _load_nvml()
            if nvml is None:
                raise NvmlUnavailable(why or "NVML is not available")
            self._nvml = nvml
        if not self._open:
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError, or OSError from a broken library install
                raise NvmlUnavailable(_init_error_text(exc)) from exc
            self._open = True
        return _read_gpus(nvml)

    def close(self) -> None:
        if self._open and self._nvml is not None:
            self._open = False
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def _read_gpus(nvml: Any) -> list[GpuReading]:
    """The gauges of every GPU of an initialised NVML; what was read before a failure."""
    err = _error_class(nvml)
    out: list[GpuReading] = []
    try:
        for i in range(int(_query(nvml, err, "nvmlDeviceGetCount") or 0)):
            h = _query(nvml, err, "nvmlDeviceGetHandleByIndex", i)
            if h is None:
                continue
            mem = _query(nvml, err, "nvmlDeviceGetMemoryInfo", h)
            util = _query(nvml, err, "nvmlDeviceGetUtilizationRates", h)
            power_mw = _query(nvml, err, "nvmlDeviceGetPowerUsage", h)
            limit_mw = _query(nvml, err, "nvmlDeviceGetPowerManagementLimit", h)
            reasons = _query(nvml, err, "nvmlDeviceGetCurrentClocksEventReasons", h)
            if reasons is None:
                reasons = _query(nvml, err, "nvmlDeviceGetCurrentClocksThrottleReasons", h)
            out.append(GpuReading(
                index=i,
                name=_text(_query(nvml, err, "nvmlDeviceGetName", h)),
                uuid=_text(_query(nvml, err, "nvmlDeviceGetUUID", h)),
                memory_used=int(mem.used) if mem is not None else None,
                memory_total=int(mem.total) if mem is not None else None,
                utilization_gpu=int(util.gpu) if util is not None else None,
                utilization_memory=int(util.memory) if util is not None else None,
                temperature_c=_query(nvml, err, "nvmlDeviceGetTemperature", h,
                                     NVML_TEMPERATURE_GPU),
                power_w=round(power_mw / 1000.0, 1) if power_mw is not None else None,
                power_limit_w=round(limit_mw / 1000.0, 1) if limit_mw is not None else None,
                throttle_reasons_mask=reasons,
                throttle_reasons=tuple(throttle_reason_names(reasons)),
            ))
    except Exception:
        # NVML can fail half-way (GPU fell off the bus); report what was read so far.
        return out
    return out


def throttle_reason_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(f"other_0x{unknown:x}")
    return names


# --------------------------------------------------------------------------- record / replay

def record(nvml: Any | None = None, *, note: str = "") -> dict[str, Any]:
    """NVML's raw answers as JSON-able data, for `RecordedNvml` to replay. Never raises."""
    data: dict[str, Any] = {"format": RECORD_FORMAT, "note": note, "host": host_info()}
    if nvml is None:
        nvml, load_error = _load_nvml()
        if nvml is None:
            data["init_error"] = {"code": NVML_ERROR_LIBRARY_NOT_FOUND, "message": load_error}
            return data
    err = _error_class(nvml)
    try:
        nvml.nvmlInit()
    except Exception as exc:
        data["init_error"] = {"code": getattr(exc, "value", None), "message": str(exc)}
        return data
    try:
        data["driver_version"] = _text(_query(nvml, err, "nvmlSystemGetDriverVersion"))
        data["cuda_driver_version"] = _query(nvml, err, "nvmlSystemGetCudaDriverVersion")
        devices: list[dict[str, Any]] = []
        for i in range(int(_query(nvml, err, "nvmlDeviceGetCount") or 0)):
            h = _query(nvml, err, "nvmlDeviceGetHandleByIndex", i)
            if h is None:
                devices.append({})
                continue

            def q(name: str, *args: Any, _h: Any = h) -> Any:
                return _query(nvml, err, name, _h, *args)

            mem = q("nvmlDeviceGetMemoryInfo")
            util = q("nvmlDeviceGetUtilizationRates")
            cc = q("nvmlDeviceGetCudaComputeCapability")
            devices.append({
                "name": _text(q("nvmlDeviceGetName")),
                "uuid": _text(q("nvmlDeviceGetUUID")),
                "memory": None if mem is None else
                {"total": int(mem.total), "free": int(mem.free), "used": int(mem.used)},
                "cuda_compute_capability": None if cc is None else [int(cc[0]), int(cc[1])],
                "power_management_limit_mw": q("nvmlDeviceGetPowerManagementLimit"),
                "power_usage_mw": q("nvmlDeviceGetPowerUsage"),
                "pcie_link_gen": q("nvmlDeviceGetCurrPcieLinkGeneration"),
                "pcie_link_width": q("nvmlDeviceGetCurrPcieLinkWidth"),
                "temperature_gpu_c": q("nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU),
                "utilization": None if util is None else
                {"gpu": int(util.gpu), "memory": int(util.memory)},
                "clocks_event_reasons": q("nvmlDeviceGetCurrentClocksEventReasons"),
            })
        data["devices"] = devices
    finally:
        _query(nvml, err, "nvmlShutdown")
    return data


def load_snapshot(path: str | Path) -> HardwareSnapshot:
    """A snapshot from a file: an NVML recording (replayed) or a saved `to_dict()`."""
    import json

    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read a hardware snapshot: {exc}") from exc
    if isinstance(data, dict) and data.get("format") == RECORD_FORMAT:
        return snapshot(RecordedNvml(data, source=f"recording:{p.name}"))
    if isinstance(data, dict) and "gpus" in data:
        return HardwareSnapshot.from_dict(data)
    raise ConfigError(f"{p}: not an NVML recording or a saved snapshot; "
                      "make one with `mtpwrap hw --record`.")


#: memory a process can use on each card, MiB (the driver and display keep the rest).
KNOWN_GPUS: dict[str, tuple[str, int]] = {
    "rtx4090": ("NVIDIA GeForce RTX 4090 (24 GB)", 24_080),
    "rtx3090": ("NVIDIA GeForce RTX 3090 (24 GB)", 24_080),
    "rtx5090": ("NVIDIA GeForce RTX 5090 (32 GB)", 32_100),
    "h100": ("NVIDIA H100 80GB", 81_000),
    "h200": ("NVIDIA H200 (141 GB)", 143_200),
}
_ALIASES = {"4090": "rtx4090", "3090": "rtx3090", "5090": "rtx5090", "h100-80gb": "h100",
            "h200-141gb": "h200"}


def gpu_snapshot(name: str) -> HardwareSnapshot:
    """A hardware snapshot holding one known GPU with all of its usable memory free."""
    key = name.lower().replace(" ", "").replace("_", "").replace("geforce", "")
    key = _ALIASES.get(key, key)
    if key not in KNOWN_GPUS:
        raise ConfigError(f"--gpu {name}: unknown GPU; use one of {', '.join(KNOWN_GPUS)}, "
                          "auto or cpu.")
    desc, mib = KNOWN_GPUS[key]
    gpu = GpuInfo(index=0, name=desc, memory_total=mib * MiB, memory_free=mib * MiB)
    return HardwareSnapshot(gpus=(gpu,), source=f"--gpu {name}")
