"""Facts about the build toolchain: cmake, a C++ compiler, ccache, nvcc and cuBLAS.

Shared by `build` (what to configure) and `doctor` (what to tell a person).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mtpwrap import proc


def _first_line(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        done = proc.run(cmd, timeout=timeout)
    except proc.ProcError:
        return None
    text = (done.stdout or done.stderr).strip()
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
class CublasWheel:
    """cuBLAS from an installed `nvidia-cublas` wheel: headers, versioned libraries."""

    name: str
    version: str  # "13.10.0.20"
    include: Path  # holds cublas_v2.h
    lib: Path  # holds libcublas.so.13 and libcublasLt.so.13

    @property
    def major(self) -> str:
        return self.version.split(".")[0]


@dataclass(frozen=True)
class CudaToolkit:
    nvcc: str | None
    version: str | None  # "13.0"
    root: Path | None
    cublas: bool  # cuBLAS found: in the toolkit, or in a wheel whose major matches nvcc's
    #: where cuBLAS comes from when the toolkit has none; None when the toolkit has it
    cublas_wheel: CublasWheel | None = None
    #: a cuBLAS wheel is installed but for another CUDA major version than nvcc's
    wheel_mismatch: CublasWheel | None = None
    #: the libcuda.so CMake would link (the toolkit's stub or the driver's); None: neither
    driver_lib: Path | None = None

    @property
    def usable(self) -> bool:
        return self.nvcc is not None and self.cublas

    @property
    def major(self) -> str | None:
        return self.version.split(".")[0] if self.version else None

    @property
    def compiler(self) -> str | None:
        """The nvcc binary itself: a wrapper script on PATH is not a compiler CMake can probe."""
        if self.root is not None and os.access(self.root / "bin" / "nvcc", os.X_OK):
            return str(self.root / "bin" / "nvcc")
        return self.nvcc

    def why_unusable(self) -> str:
        if self.nvcc is None:
            return "no nvcc on PATH"
        if self.wheel_mismatch is not None:
            w = self.wheel_mismatch
            return (f"the installed {w.name} {w.version} is for CUDA {w.major}, but nvcc is "
                    f"{self.version}")
        return f"the CUDA toolkit at {self.root} lacks cuBLAS"

    def how_to_fix(self) -> str:
        if self.nvcc is None:
            return "Install the CUDA toolkit (nvcc) or build with --cpu."
        if self.wheel_mismatch is not None:
            return (f"Install the cuBLAS wheel for CUDA {self.major} (`pip install "
                    f"'nvidia-cublas=={self.major}.*'`), or an nvcc of CUDA "
                    f"{self.wheel_mismatch.major}.")
        return ("Install cuBLAS with `pip install -e '.[cuda]'` (the nvidia-cublas wheel) or "
                "the toolkit's own (NVIDIA's libcublas-dev package), or build with --cpu.")


def cublas_wheels() -> list[CublasWheel]:
    """Every installed pip distribution that carries cuBLAS headers and libraries."""
    from importlib import metadata

    found: list[CublasWheel] = []
    seen: set[str] = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not name.startswith("nvidia-cublas") or name in seen:
            continue
        seen.add(name)
        include = lib = None
        for f in dist.files or ():
            fn = str(f)
            if fn.endswith("/include/cublas_v2.h"):
                include = Path(str(dist.locate_file(f))).parent
            elif re.search(r"/lib/libcublas\.so\.\d+$", fn):
                lib = Path(str(dist.locate_file(f))).parent
        if include is not None and lib is not None:
            found.append(CublasWheel(name, dist.version, include, lib))
    return found


def _driver_lib(roots: list[Path]) -> Path | None:
    """libcuda.so as FindCUDAToolkit looks for it: the toolkit's stubs, then the system."""
    cands = [r / sub / "libcuda.so" for r in roots
             for sub in ("lib64/stubs", "lib/stubs", "lib64", "lib")]
    for r in roots:
        cands += [Path(p) for p in sorted(glob.glob(str(r / "targets/*/lib/stubs/libcuda.so")))]
    cands += [Path(d) / "libcuda.so" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-"
                                                "linux-gnu", "/usr/lib64", "/usr/lib")]
    return next((c for c in cands if c.exists()), None)


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
        out = proc.run([nvcc, "--version"], timeout=20).stdout
        m = re.search(r"release (\d+\.\d+)", out)
        version = m.group(1) if m else None
    except proc.ProcError:
        pass
    real = Path(os.path.realpath(nvcc))
    roots = [Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    roots += [real.parent.parent, Path("/usr/local/cuda")]
    root = next((r for r in roots if (r / "include" / "cuda_runtime.h").is_file()), roots[0])
    patterns = [
        str(r / sub / "libcublas.so*") for r in roots for sub in ("lib64", "lib", "targets/*/lib")
    ]
    driver = _driver_lib(list(dict.fromkeys([root, *roots])))
    if any(glob.glob(p) for p in patterns):
        return CudaToolkit(nvcc, version, root, True, driver_lib=driver)
    major = version.split(".")[0] if version else None
    wheels = cublas_wheels()
    match = next((w for w in wheels if w.major == major), None)
    if match is not None:
        return CudaToolkit(nvcc, version, root, True, cublas_wheel=match, driver_lib=driver)
    return CudaToolkit(nvcc, version, root, False, wheel_mismatch=wheels[0] if wheels else None,
                       driver_lib=driver)


def cublas_link_dir(wheel: CublasWheel, under: Path) -> Path:
    """A folder of unversioned links (libcublas.so -> the wheel's libcublas.so.13), which is
    what CMake's FindCUDAToolkit searches for; the wheel ships only the versioned names."""
    digest = hashlib.sha256(str(wheel.lib).encode()).hexdigest()[:10]
    links = under / f"cublas-links-{wheel.major}-{digest}"
    links.mkdir(parents=True, exist_ok=True)
    for lib in sorted(wheel.lib.glob("libcublas*.so.*")):
        target = links / (lib.name.split(".so.")[0] + ".so")
        if not (target.is_symlink() and Path(os.readlink(target)) == lib):
            tmp = links / f".{target.name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(lib)
            os.replace(tmp, target)
    return links


def cuda_library_dirs(tk: CudaToolkit | None = None) -> list[str]:
    """Where a CUDA llama-server finds cudart and cuBLAS on this machine (for LD_LIBRARY_PATH
    when the binary was built elsewhere and its RPATH points at that machine's folders)."""
    tk = tk or cuda_toolkit()
    dirs: list[str] = []
    if tk.root is not None:
        for cand in [tk.root / "lib64", tk.root / "lib",
                     *sorted(tk.root.glob("targets/*/lib"))]:
            if any(cand.glob("libcudart.so*")):
                dirs.append(str(cand))
    if tk.cublas_wheel is not None:
        dirs.append(str(tk.cublas_wheel.lib))
    else:
        dirs += [str(w.lib) for w in cublas_wheels()]
    return list(dict.fromkeys(dirs))
