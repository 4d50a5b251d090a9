"""What the recipe asks a person to check by hand, checked: driver, GPUs, toolchain, disk,
the built binary and the model. Each check says ok / warning / missing and the command that
fixes it.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.build import binary, source, toolchain
from mtpwrap.build import manifest as build_manifest
from mtpwrap.config.objects import default_snapshot_dir
from mtpwrap.config.table import env_name
from mtpwrap.decide import hardware
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.endpoint import listen_on
from mtpwrap.errors import ConfigError
from mtpwrap.models import known as models
from mtpwrap.supervision import instance, sockets
from mtpwrap.units import GiB

OK, WARNING, MISSING = "ok", "warning", "missing"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None
    hard: bool = False  # a missing hard requirement makes `doctor` exit non-zero

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_gpus(snap: Any | None = None) -> list[Check]:
    if snap is None:
        snap = hardware.snapshot()
    gpus = list(getattr(snap, "gpus", ()) or ())
    if not gpus:
        why = getattr(snap, "error", None) or "NVML found no NVIDIA GPU"
        return [Check("NVIDIA driver / GPUs", WARNING,
                      f"no GPU: {why}; only CPU builds and the cpu-demo profile will run",
                      "install the NVIDIA driver (nvidia-smi must work) on a GPU machine")]
    checks = []
    driver = getattr(snap, "driver_version", None) or getattr(gpus[0], "driver_version", None)
    for i, g in enumerate(gpus):
        total = getattr(g, "memory_total", None)
        cc = getattr(g, "compute_capability", None)
        mem = f"{total / GiB:.1f} GiB" if total else "memory unknown"
        ccs = f"sm_{cc[0]}{cc[1]}" if cc else "compute capability unknown"
        checks.append(Check(f"GPU {i}", OK, f"{getattr(g, 'name', '?')}, {mem}, {ccs}, "
                                            f"driver {driver or 'unknown'}"))
    return checks


def check_cuda() -> Check:
    tk = toolchain.cuda_toolkit()
    if tk.nvcc is None:
        return Check("CUDA toolkit (nvcc)", WARNING, "nvcc not found; only CPU builds are possible",
                     "install the CUDA toolkit (NVIDIA cuda-toolkit package) and put nvcc on PATH")
    if not tk.cublas:
        return Check("CUDA toolkit (nvcc)", WARNING,
                     f"nvcc {tk.version} at {tk.nvcc}, but {tk.why_unusable()}, so CUDA builds "
                     "cannot link", tk.how_to_fix())
    where = (f"cuBLAS from the {tk.cublas_wheel.name} {tk.cublas_wheel.version} wheel"
             if tk.cublas_wheel else f"cuBLAS at {tk.root}")
    driver = (f"links libcuda.so at {tk.driver_lib}" if tk.driver_lib else
              "no libcuda.so to link: builds use GGML_CUDA_NO_VMM=ON")
    return Check("CUDA toolkit (nvcc)", OK, f"nvcc {tk.version} with {where}; {driver}")


def check_cmake() -> Check:
    v = toolchain.cmake_version()
    if v is None:
        return Check("cmake", MISSING, "cmake not found", "apt-get install cmake", hard=True)
    return Check("cmake", OK, f"cmake {v}")


def check_compiler() -> Check:
    v = toolchain.cxx_version()
    if v is None:
        return Check("C++ compiler", MISSING, "no c++, g++ or clang++ on PATH",
                     "apt-get install build-essential", hard=True)
    return Check("C++ compiler", OK, v)


def check_ccache() -> Check:
    if toolchain.ccache() is None:
        return Check("ccache", WARNING, "not installed; rebuilds of a changed source start over",
                     "apt-get install ccache")
    return Check("ccache", OK, toolchain.ccache() or "")


def check_disk(min_free_gib: float = 20.0) -> Check:
    where = paths.home()
    probe = where if where.exists() else Path.home()
    free = shutil.disk_usage(probe).free / GiB
    if free < 2:
        return Check("free disk", MISSING, f"{free:.1f} GiB free at {probe}",
                     "free space: a build needs ~2 GiB, a 27B model ~17 GiB", hard=True)
    if free < min_free_gib:
        return Check("free disk", WARNING, f"{free:.1f} GiB free at {probe} (a 27B model and a "
                     "CUDA build need about 20 GiB)", "free some space")
    return Check("free disk", OK, f"{free:.0f} GiB free at {probe}")


def check_binary(snap: Any | None = None) -> Check:
    """The installed build: tried here, and compiled for every GPU present (`snap`: NVML)."""
    m = build_manifest.load_manifest()
    if m is None:
        return Check("llama-server build", MISSING, f"no built binary under {paths.build_root()}",
                     "mtpwrap build   (or `mtpwrap build --cpu`)")
    smoke = m.smoke or {}
    detail = (f"{m.variant}, {m.source.get('kind')} source, commit {m.commit}, "
              f"{m.binary('llama-server')}")
    if m.smoke is None:
        return Check("llama-server build", WARNING, detail + "; never tried on this machine",
                     "mtpwrap build   (tries the binary and keeps what runs)")
    if not m.trusted:
        return Check("llama-server build", MISSING,
                     detail + f"; its smoke test {smoke.get('status')}: {smoke.get('detail')}",
                     "mtpwrap build --force")
    gaps = binary.uncovered_gpus(m, snap)
    if gaps:
        return Check("llama-server build", MISSING, binary.coverage_problem(m, snap) or detail,
                     binary.rebuild_command(m, gaps), hard=True)
    return Check("llama-server build", OK, detail + f"; smoke test {smoke.get('status')}")


def check_patches() -> list[Check]:
    """What the installed build lacks for want of a patch not written for its source, one
    line each (nothing when every patch of the set was applied or opted out)."""
    m = build_manifest.load_manifest()
    return [Check("patch set", OK, sentence) for sentence in (m.lacks() if m else ())]


def check_upstream_link() -> Check:
    """How `up` reaches llama-server: its UNIX socket when the build binds one (no other local
    user can open it), else loopback TCP behind the internal key; and where the socket goes."""
    name = "link to llama-server"
    m = build_manifest.load_manifest()
    if m is None or not m.capabilities:
        return Check(name, WARNING, "unknown until a build records what its --help offers",
                     "mtpwrap build")
    place = sockets.socket_place()
    ep = listen_on(Capabilities.from_dict(m.capabilities), str(place.path),
                   socket_why=place.why)
    if ep.socket is None:
        return Check(name, WARNING, ep.why,
                     "use a llama-server whose --help offers .sock paths for --host")
    return Check(name, OK, f"{ep.describe()}: {ep.why}")


def check_cpu_isa() -> Check:
    """How the installed build's CPU backend was compiled, and why that one was kept."""
    m = build_manifest.load_manifest()
    if m is None:
        return Check("CPU configuration", WARNING, "no build yet", "mtpwrap build")
    tried = ", ".join(f"{a.get('cpu_isa')}: {a.get('smoke')}" for a in m.attempts)
    reason = m.extra.get("isa_reason") or "built before configurations were tried"
    return Check("CPU configuration", OK,
                 f"{m.cpu_isa or 'native'} — {reason}" + (f" (tried {tried})" if tried else ""))


def check_pin() -> Check:
    """The fork pin (the superproject's gitlink) against what vendor/ holds."""
    pinned, held = source.pin_status()
    if held.startswith("empty"):
        carried = source.carried_source()
        if carried is not None:
            return Check("fork pin", OK, f"the fork at the pin {pinned[:12]}, carried by a "
                         f"bundle ({carried.path}): builds use it")
        return Check("fork pin", OK, f"{source.SUBMODULE_PATH} pinned at {pinned[:12]}, "
                     "not initialised: builds use the pinned offline source")
    if held == pinned:
        return Check("fork pin", OK, f"{source.SUBMODULE_PATH} at the pin {pinned[:12]}")
    return Check("fork pin", WARNING,
                 f"{source.SUBMODULE_PATH} holds {held}, the pin is {pinned}",
                 "git submodule update   (or build with --allow-unpinned)")


def check_model(model: str | None) -> Check:
    if model:
        try:
            p = models.resolve_model(model)
        except ConfigError as exc:
            return Check("model file", MISSING, str(exc.message),
                         "check the path, or download the GGUF into " + str(paths.models_dir()))
        return Check("model file", OK, f"{p} ({p.stat().st_size / 1e9:.1f} GB)")
    demo = models.DEMO.path()
    if demo.is_file():
        return Check("model file", OK, f"demo model {demo}; pass --model for yours")
    return Check("model file", WARNING, "no model given and the demo model is not fetched",
                 "mtpwrap models demo")


def check_snapshots(directory: Path | None = None) -> Check:
    """The document store holds the clients' prompts in another form: 0700, files 0600,
    owned by the service user. Default: the running instance's, else persist.dir's default."""
    import os

    from mtpwrap.front.store import directory_problems

    if directory is None:
        data = instance.read_instance() or {}
        recorded = data.get("persist_dir")
        configured = os.environ.get(env_name("persist.dir"))
        directory = Path(recorded or configured or default_snapshot_dir())
    if not directory.exists():
        return Check("document store", OK, f"{directory} does not exist yet (created 0700 by "
                     "`mtpwrap up`)")
    problems = directory_problems(directory)
    if problems:
        return Check("document store", WARNING, "; ".join(problems[:3]),
                     f"chmod 700 {directory} && chmod 600 {directory}/* (as the service user), "
                     "or remove it: `mtpwrap up` recreates it")
    n = len(list(directory.iterdir()))
    return Check("document store", OK, f"{directory}: mode 0700, {n} file(s), all 0600")


def run_checks(model: str | None = None, snap: Any | None = None) -> list[Check]:
    if snap is None:
        snap = hardware.snapshot()
    return [*check_gpus(snap), check_cuda(), check_cmake(), check_compiler(), check_ccache(),
            check_disk(), check_pin(), check_binary(snap), *check_patches(),
            check_upstream_link(), check_cpu_isa(), check_model(model), check_snapshots()]
