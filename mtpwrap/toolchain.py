"""Facts about the build toolchain: cmake, a C++ compiler, ccache, nvcc and cuBLAS.

Shared by `build` (what to configure) and `doctor` (what to tell a person).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _first_line(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if text else None


def cmake() -> str | None:
    return shutil.which("cmake")


def cmake_version() -> str | None:
    exe = cmake()
    if not exe:
        return None
    line = _first_line([exe, "--version"])
    m = re.search(r"(\d+\.\d+(\.\d+)?)", line or "")
    return m.group(1) if m else line


def cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def cxx_version() -> str | None:
    exe = cxx_compiler()
    return _first_line([exe, "--version"]) if exe else None


def ccache() -> str | None:
    return shutil.which("ccache")


@dataclass(frozen=True)
class CudaToolkit:
    nvcc: str | None
    version: str | None  # "13.0"
    root: Path | None
    cublas: bool

    @property
    def usable(self) -> bool:
        return self.nvcc is not None and self.cublas


def cuda_toolkit() -> CudaToolkit:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.access(cand, os.X_OK):
                nvcc = cand
    if nvcc is None:
        return CudaToolkit(None, None, None, False)
    version = None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"release (\d+\.\d+)", out)
        version = m.group(1) if m else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    real = Path(os.path.realpath(nvcc))
    roots = [Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    roots += [real.parent.parent, Path("/usr/local/cuda")]
    root = next((r for r in roots if (r / "include" / "cuda_runtime.h").is_file()), roots[0])
    patterns = [
        str(r / sub / "libcublas.so*") for r in roots for sub in ("lib64", "lib", "targets/*/lib")
    ]
    cublas = any(glob.glob(p) for p in patterns)
    return CudaToolkit(nvcc, version, root, cublas)
