"""A stand-in for pynvml (nvidia-ml-py) that hangs on demand: a driver whose NVML stops
answering, a fault the real library cannot show when a test wants it.

Put this directory first on PYTHONPATH. It reports one GPU. While the file named by
FAKE_NVML_STALL exists, every call blocks until the file is gone (as a hung driver call
blocks its thread); each successful nvmlInit appends a line to FAKE_NVML_INITS.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _stall() -> None:
    flag = os.environ.get("FAKE_NVML_STALL")
    while flag and os.path.exists(flag):
        time.sleep(0.02)  # the driver "hangs" for as long as the flag is there


def nvmlInit() -> None:
    _stall()
    inits = os.environ.get("FAKE_NVML_INITS")
    if inits:
        with open(inits, "a") as f:
            f.write("init\n")


def nvmlShutdown() -> None:
    _stall()


def nvmlSystemGetDriverVersion() -> str:
    _stall()
    return "999.99"


def nvmlSystemGetCudaDriverVersion() -> int:
    _stall()
    return 12080


def nvmlDeviceGetCount() -> int:
    _stall()
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _stall()
    if index != 0:
        raise NVMLError(2)
    return index


def nvmlDeviceGetName(handle: int) -> str:
    _stall()
    return "Stand-in GPU"


def nvmlDeviceGetUUID(handle: int) -> str:
    _stall()
    return "GPU-00000000-0000-0000-0000-000000000000"


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    _stall()
    return SimpleNamespace(total=24 << 30, free=20 << 30, used=4 << 30)


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    _stall()
    return 51


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    _stall()
    return SimpleNamespace(gpu=37, memory=12)
