"""Configure and build llama-server (and llama-fit-params) with CMake, and record what was built.

Builds live in a cache keyed by source identity, CMake options, compiler and host CPU
(`~/.cache/mtpwrap/builds/<variant>-<key>/`), so a fresh checkout on the same machine reuses them;
the checkout's `build/<variant>/` gets the binaries and `manifest.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths
from mtpwrap.build import patchset, source, toolchain
from mtpwrap.errors import BuildError, ConfigError, MissingToolError

#: llama-quantize writes the low-bit draft models of benchmarks/adaptive_spec.py.
TARGETS = ("llama-server", "llama-fit-params", "llama-quantize")
MANIFEST = "manifest.json"
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")

ProgressFn = Callable[[str, float | None, str | None], None]  # phase, percent, line


@dataclass
class Manifest:
    variant: str
    source: dict[str, Any]
    cmake_options: dict[str, str]
    compiler: str | None
    cuda_version: str | None
    architectures: list[str]
    binaries: dict[str, dict[str, str]]
    version_output: str
    build_seconds: float
    built_at: str
    cache_key: str
    build_dir: str
    log: str
    capabilities: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_isa: str | None = None  # native | safe | baseline: how the CPU backend was compiled
    smoke: dict[str, Any] | None = None  # smoke.SmokeResult of this binary on this machine
    attempts: list[dict[str, Any]] = field(default_factory=list)  # every configuration tried
    #: CUDA builds: architectures, where cuBLAS came from, how the driver library was handled
    cuda: dict[str, Any] | None = None
    #: the CMake configure step: argv, the options CMake accepted, any it did not
    configure: dict[str, Any] | None = None
    #: the llama.cpp patches (patchset.Patch.record): name, sha256, applied | opted-out
    patches: list[dict[str, Any]] | None = None
    #: whether the binary honours a request's own `speculative.n_max` (spec_probe.probe)
    spec_depth: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def binary(self, name: str = "llama-server") -> Path:
        try:
            return Path(self.binaries[name]["path"])
        except KeyError:
            raise MissingToolError(
                f"the {self.variant} build has no {name}.", hint="Run `mtpwrap build` again."
            ) from None

    @property
    def commit(self) -> str | None:
        return self.source.get("commit")

    @property
    def smoke_status(self) -> str | None:
        return (self.smoke or {}).get("status")

    @property
    def trusted(self) -> bool:
        """Tried on this machine and answered (or could not be tried here: no GPU)."""
        return self.smoke_status in ("passed", "skipped")


@dataclass(frozen=True)
class Plan:
    """What a build will do, decided before anything runs."""

    variant: str
    arch: str | None
    reason: str
    options: dict[str, str]
    cpu_isa: str = "native"
    cuda: dict[str, Any] | None = None  # see Manifest.cuda


#: How the CPU backend is compiled, tried in this order until one passes its smoke test:
#: native (GGML_NATIVE: everything this CPU has, AMX included), safe (the instruction sets this
#: CPU reports, named one by one, AMX off), baseline (AVX2, the common x86-64 floor).
CPU_ISAS = ("native", "safe", "baseline")

#: /proc/cpuinfo flag -> ggml CMake option, for the "safe" configuration.
_X86_ISA_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
_BASELINE = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
_AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
#: Environment that changes what the compiler emits, so it is part of the cache key.
FLAG_ENV = ("CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CUDAFLAGS", "NVCC_APPEND_FLAGS")


def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.partition(":")[2].split())
    return set()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def isa_options(isa: str, flags: set[str] | None = None) -> dict[str, str]:
    """The ggml CMake options for one CPU configuration (see CPU_ISAS)."""
    if isa not in CPU_ISAS:
        raise ConfigError(
            f"--cpu-isa {isa}: expected one of {', '.join(CPU_ISAS)}.",
            hint="native compiles for this CPU, safe names its instruction sets without AMX, "
            "baseline is AVX2.",
        )
    if isa == "native":
        return {"GGML_NATIVE": "ON"}
    opts = {"GGML_NATIVE": "OFF"}
    if not _is_x86():
        return opts  # ggml picks a portable -march for Arm when GGML_NATIVE is off
    have = cpu_flags() if flags is None else flags
    wanted = {f for f in _X86_ISA_OPTIONS if f in have} if isa == "safe" else set(_BASELINE)
    for flag, option in _X86_ISA_OPTIONS.items():
        opts[option] = "ON" if flag in wanted else "OFF"
    for option in _AMX_OPTIONS:
        opts[option] = "OFF"
    return opts


def _flag_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FLAG_ENV if os.environ.get(k)}


def _host_fingerprint() -> str:
    # GGML_NATIVE compiles for this CPU, so a build is only reusable on the same instruction set.
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:12]


def present_gpu_archs(snap: Any | None = None) -> list[str]:
    """The compute capabilities of the GPUs NVML sees ("89", "90"), each once; [] when none."""
    if snap is None:
        try:
            from mtpwrap.decide import hardware

            snap = hardware.snapshot()
        except Exception:
            return []
    archs: list[str] = []
    for gpu in getattr(snap, "gpus", ()) or ():
        cc = getattr(gpu, "compute_capability", None)
        if cc and f"{cc[0]}{cc[1]}" not in archs:
            archs.append(f"{cc[0]}{cc[1]}")
    return sorted(archs, key=_arch_number)


def _arch_number(arch: str) -> int:
    return int(re.match(r"\d+", arch).group(0))  # type: ignore[union-attr]


def parse_cuda_archs(spec: str) -> list[str]:
    """`--cuda-arch 89,90` -> ["89", "90"]: compute capabilities, each once, in order."""
    archs: list[str] = []
    for part in spec.replace(";", ",").split(","):
        arch = part.strip().lower()
        if not re.fullmatch(r"\d{2,3}[a-z]?", arch):
            raise ConfigError(
                f"--cuda-arch {spec}: expected compute capabilities such as 89 (RTX 4090), "
                "86 (3090), 120 (5090) or 90 (H100/H200), comma-separated for several (89,90)."
            )
        if arch not in archs:
            archs.append(arch)
    return sorted(archs, key=_arch_number)


def cuda_variant(archs: list[str]) -> str:
    return "cuda-" + "-".join(f"sm{a}" for a in archs)


#: CUDA-only options of the MTP + TurboQuant fork, set only when the source is the fork.
#: Source: the fork's documented capabilities at the pinned commit (docs/facts.md §1:
#: "fused TBQ4 flash attention on CUDA", "quantized V needs --flash-attn on", -ctkd/-ctvd set
#: the draft's KV types). The names are ggml's; tests/test_build_cuda.py checks each against the
#: fork's own CMake files whenever vendor/llama.cpp-mtp is initialised.
FORK_CUDA_OPTIONS: dict[str, tuple[str, str]] = {
    "GGML_CUDA_FA": ("ON", "the fused TBQ4 flash-attention kernels are part of the CUDA "
                     "flash-attention build, and quantized V (tbq4_0) runs only with it"),
    "GGML_CUDA_FA_ALL_QUANTS": ("ON", "tbq4_0 K with tbq4_0 V, and the draft's own -ctkd/-ctvd "
                                "types, need flash-attention kernels for every K/V type pair, "
                                "not only the default f16, q4_0 and q8_0 pairs"),
}

#: What GGML_CUDA_NO_VMM=ON (the build links without libcuda.so) costs when it runs.
NO_VMM_COST = (
    "ggml's temporary compute buffers come from its legacy pool (up to 256 cudaMalloc'd blocks "
    "reused best-fit, each 5 % larger than asked, kept until exit) instead of one virtual "
    "address range grown in place through the driver's VMM API: a little more VRAM held for "
    "scratch and a few cudaMalloc calls on the first requests; weights and KV cache are "
    "unaffected, and the driver is still loaded by the CUDA runtime when the server starts"
)


def _cuda_plan(tk: toolchain.CudaToolkit, archs: list[str], fork: bool
               ) -> tuple[dict[str, str], dict[str, Any]]:
    """The CMake options of a CUDA build for `archs`, and what the manifest records about it."""
    opts = {
        "GGML_CUDA": "ON",
        "CMAKE_CUDA_ARCHITECTURES": ";".join(archs),
        "CMAKE_CUDA_COMPILER": tk.compiler or "nvcc",
    }
    info: dict[str, Any] = {"architectures": archs, "nvcc": tk.compiler, "nvcc_version": tk.version}
    wheel = tk.cublas_wheel
    if wheel is not None:
        links = toolchain.cublas_link_dir(wheel, paths.build_cache_dir())
        opts.update({
            "CMAKE_LIBRARY_PATH": str(links),
            "CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES": str(wheel.include),
            "CMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES": str(wheel.include),
            # the binary finds libcublas.so.13 in the wheel without LD_LIBRARY_PATH
            "CMAKE_BUILD_RPATH": str(wheel.lib),
        })
        info["cublas"] = {"from": "wheel", "package": f"{wheel.name}=={wheel.version}",
                          "lib": str(wheel.lib), "include": str(wheel.include)}
    else:
        info["cublas"] = {"from": "toolkit", "root": str(tk.root)}
    if tk.driver_lib is None:
        opts["GGML_CUDA_NO_VMM"] = "ON"
        info["driver_link"] = {"how": "GGML_CUDA_NO_VMM=ON", "library": None,
                               "why": f"no libcuda.so (driver or toolkit stub) under {tk.root} "
                               "or the system library folders",
                               "runtime_cost": NO_VMM_COST}
    else:
        stub = "stubs" in tk.driver_lib.parts
        info["driver_link"] = {"how": "toolkit stub" if stub else "driver library",
                               "library": str(tk.driver_lib),
                               "why": "linked against libcuda.so for the VMM memory pool",
                               "runtime_cost": "none: the driver's libcuda.so.1 is loaded at "
                               "run time" + (" (the stub is only for linking)" if stub else "")}
    if fork:
        opts.update({k: v for k, (v, _) in FORK_CUDA_OPTIONS.items()})
        info["fork_options"] = {k: {"value": v, "why": why}
                                for k, (v, why) in FORK_CUDA_OPTIONS.items()}
    return opts, info


def plan_build(cpu: bool = False, cuda_arch: str | None = None, cpu_isa: str = "native",
               fork: bool = False) -> Plan:
    """`fork`: the source is the MTP + TurboQuant fork, whose CUDA options are then set."""
    ccache = toolchain.ccache()
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "BUILD_SHARED_LIBS": "OFF",
        **isa_options(cpu_isa),
    }
    if ccache:
        options["CMAKE_C_COMPILER_LAUNCHER"] = ccache
        options["CMAKE_CXX_COMPILER_LAUNCHER"] = ccache
    asked = parse_cuda_archs(cuda_arch) if cuda_arch is not None else None
    if cpu:
        return Plan("cpu", None, "--cpu asked for a CPU build", options, cpu_isa)
    archs = asked or present_gpu_archs()
    if not archs:
        return Plan("cpu", None, "no NVIDIA GPU found through NVML and no --cuda-arch", options,
                    cpu_isa)
    tk = toolchain.cuda_toolkit()
    shown = ",".join(archs)
    if not tk.usable:
        why = tk.why_unusable()
        if asked:
            raise MissingToolError(
                f"--cuda-arch {cuda_arch}: cannot build for CUDA because {why}.",
                hint=tk.how_to_fix(),
            )
        return Plan("cpu", None, f"a GPU (sm_{shown}) is present but {why}", options, cpu_isa)
    cuda_opts, info = _cuda_plan(tk, archs, fork)
    options.update(cuda_opts)
    if ccache:
        options["CMAKE_CUDA_COMPILER_LAUNCHER"] = ccache
    reason = f"--cuda-arch {shown}" if asked else f"GPU compute capability {shown} (NVML)"
    return Plan(cuda_variant(archs), shown, reason, options, cpu_isa, info)


def cache_key(identity: str, options: dict[str, str], compiler: str | None,
              patches: list[list[str]] | None = None) -> str:
    """`patches`: patchset.key_part of the applied patches. A patched build is keyed by the
    patches' content and the targets too; an unpatched one keeps the key such builds have
    always had, so their cache entries stay valid."""
    # The ccache launcher path does not change the result, so it is left out of the key.
    opts = {k: v for k, v in sorted(options.items()) if not k.endswith("_COMPILER_LAUNCHER")}
    parts: list[Any] = [identity, opts, compiler, _host_fingerprint(), _flag_env()]
    if patches:
        parts.append({"patches": patches, "targets": list(TARGETS)})
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Two builds of the same key (a test run and a person, say) must not share a build dir.
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _binaries_ok(manifest: Manifest) -> bool:
    for info in manifest.binaries.values():
        p = Path(info.get("cache_path", info["path"]))
        if not p.is_file():
            return False
    return True


def _run_logged(
    cmd: list[str], log: Path, phase: str, progress: ProgressFn | None, env: dict[str, str]
) -> tuple[int, list[str]]:
    tail: list[str] = []
    with log.open("a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            lf.flush()  # a person tailing the log sees the build as it goes
            tail.append(line.rstrip("\n"))
            if len(tail) > 400:
                del tail[:200]
            if progress:
                m = _PERCENT.match(line)
                progress(phase, float(m.group(1)) if m else None, line.rstrip("\n"))
        return proc.wait(), tail


def _error_excerpt(tail: list[str], n: int = 25) -> list[str]:
    errors = [i for i, line in enumerate(tail) if re.search(r"\berror\b", line, re.I)]
    if errors:
        start = max(0, errors[0] - 2)
        return tail[start : start + n]
    return tail[-n:]


def _version_output(binary: Path) -> str:
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(--version failed: {exc})"
    return (proc.stdout + proc.stderr).strip()


def _capabilities(binary: Path) -> dict[str, Any] | None:
    from mtpwrap.decide import capabilities

    try:
        return capabilities.probe(binary).to_dict()
    except Exception:
        return None


def _install(manifest: Manifest, variant_dir: Path) -> Manifest:
    """Copy the cached binaries into build/<variant>/bin and write manifest.json there."""
    bin_dir = variant_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binaries: dict[str, dict[str, str]] = {}
    for name, info in manifest.binaries.items():
        src = Path(info.get("cache_path", info["path"]))
        dst = bin_dir / name
        if not (dst.is_file() and hashing.sha256_file(dst) == info["sha256"]):
            tmp = dst.with_suffix(".tmp")
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
        binaries[name] = {"path": str(dst), "cache_path": str(src), "sha256": info["sha256"]}
    installed = Manifest.from_dict({**manifest.to_dict(), "binaries": binaries})
    _write_json(variant_dir / MANIFEST, installed.to_dict())
    return installed


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


NoteFn = Callable[[str], None]


def _attempt_summary(m: Manifest) -> dict[str, Any]:
    smoke = m.smoke or {}
    return {"cpu_isa": m.cpu_isa, "cache_key": m.cache_key, "build_dir": m.build_dir,
            "smoke": smoke.get("status"), "detail": smoke.get("detail"),
            "signal": smoke.get("signal"), "log_tail": smoke.get("log_tail", [])[-5:]}


def _smoke_test(server: Path, variant: str, work_dir: Path,
                archs: list[str] | None = None) -> dict[str, Any]:
    from mtpwrap.build import smoke

    gpu = variant.startswith("cuda")
    present = present_gpu_archs() if gpu else []
    if gpu and not present:
        return smoke.skipped("no NVIDIA GPU is visible on this machine, so the CUDA binary "
                             "cannot be tried here").to_dict()
    if gpu and archs and not set(present) & {str(_arch_number(a)) for a in archs}:
        return smoke.skipped(f"the GPUs here (sm_{', sm_'.join(present)}) are not among the "
                             f"build's architectures (sm_{', sm_'.join(archs)})").to_dict()
    try:
        model = smoke.smoke_model(work_dir)
    except Exception as exc:
        return smoke.SmokeResult("failed", f"no model to try the binary with: {exc}").to_dict()
    return smoke.run(server, model, gpu=gpu).to_dict()


def _spec_depth_probe(server: Path, variant: str, work_dir: Path) -> dict[str, Any]:
    from mtpwrap.build import smoke, spec_probe

    if variant.startswith("cuda") and not present_gpu_archs():
        return {"status": "unknown", "detail": "no GPU here to try the CUDA binary on"}
    try:
        model = smoke.smoke_model(work_dir)
    except Exception as exc:
        return {"status": "unknown", "detail": f"no model to probe with: {exc}"}
    return spec_probe.probe(server, model, gpu=variant.startswith("cuda"))


def _patched_source(src: source.Source, applied: list[patchset.Patch], key_dir: Path
                    ) -> source.Source:
    """`src` with the applied patches, in an overlay beside the build folder."""
    if not applied:
        return src
    tree = patchset.overlay(src.path, key_dir.with_name(key_dir.name + ".src"), applied)
    return dataclasses.replace(src, path=tree)


def _compile(plan: Plan, src: source.Source, why: str, key: str, build_dir: Path,
             compiler: str | None, jobs: int | None, progress: ProgressFn | None,
             force: bool) -> Manifest:
    """Configure and compile one plan into build_dir; the manifest has no smoke result yet."""
    build_dir.mkdir(parents=True, exist_ok=True)
    log = build_dir / "build.log"
    log.write_text("")
    env = dict(os.environ)
    started = time.monotonic()
    tag = f" ({plan.cpu_isa})"
    configured = _configure(plan, src, build_dir, log, progress, force)

    n = jobs or os.cpu_count() or 2
    cmd = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(n), "--target"]
    cmd += list(TARGETS)
    rc, tail = _run_logged(cmd, log, "compile" + tag, progress, env)
    if rc != 0:
        raise BuildError(
            f"compiling {', '.join(TARGETS)} failed (exit {rc}).",
            hint=f"Full log: {log}",
        ).with_tail(_error_excerpt(tail))

    binaries: dict[str, dict[str, str]] = {}
    for name in TARGETS:
        exe = build_dir / "bin" / name
        if not exe.is_file():
            raise BuildError(
                f"the build finished but {exe} is missing.", hint=f"Full log: {log}"
            )
        binaries[name] = {
            "path": str(exe),
            "cache_path": str(exe),
            "sha256": hashing.sha256_file(exe),
        }
    server = build_dir / "bin" / "llama-server"
    tk = toolchain.cuda_toolkit() if plan.variant.startswith("cuda") else None
    return Manifest(
        variant=plan.variant,
        source={**src.to_dict(), "why": why},
        cmake_options=plan.options,
        compiler=compiler,
        cuda_version=tk.version if tk else None,
        architectures=(plan.cuda or {}).get("architectures") or [platform.machine()],
        binaries=binaries,
        version_output=_version_output(server),
        build_seconds=round(time.monotonic() - started, 1),
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        cache_key=key,
        build_dir=str(build_dir),
        log=str(log),
        capabilities=_capabilities(server),
        extra={"plan_reason": plan.reason, "cmake_version": toolchain.cmake_version(),
               "flag_env": _flag_env()},
        cpu_isa=plan.cpu_isa,
        cuda=plan.cuda,
        configure=configured,
    )


_UNUSED_HEADER = "Manually-specified variables were not used by the project:"


def unused_variables(log_text: str) -> list[str]:
    """The names CMake listed as "Manually-specified variables were not used by the project"."""
    names: list[str] = []
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if _UNUSED_HEADER in line:
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    if names:
                        break
                    continue
                if not nxt.startswith("    "):
                    break
                names.append(nxt.strip())
    return names


def read_cmake_cache(build_dir: Path) -> dict[str, tuple[str, str]]:
    """CMakeCache.txt as {name: (type, value)}."""
    entries: dict[str, tuple[str, str]] = {}
    with contextlib.suppress(OSError):
        for line in (build_dir / "CMakeCache.txt").read_text(errors="replace").splitlines():
            m = re.match(r"^([A-Za-z0-9_.+-]+):([A-Z]+)=(.*)$", line)
            if m:
                entries[m.group(1)] = (m.group(2), m.group(3))
    return entries


def judge_options(options: dict[str, str], cache: dict[str, tuple[str, str]],
                  unused: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Which of our -D options CMake took: (accepted name -> value, rejected name -> why).

    CMake's own "not used" list misses misspelt GGML_* names (ggml reads every GGML_ variable
    for its package file), so an option is also rejected when the project never declared it:
    it stays UNINITIALIZED in the cache unless CMake itself reads it (CMAKE_*)."""
    accepted: dict[str, str] = {}
    rejected: dict[str, str] = {}
    for name, value in options.items():
        kind, held = cache.get(name, ("", ""))
        if name in unused:
            rejected[name] = "CMake reported it as not used by the project"
        elif not kind:
            rejected[name] = "it is not in CMakeCache.txt"
        elif kind == "UNINITIALIZED" and not name.startswith("CMAKE_"):
            rejected[name] = "the project declares no such option"
        elif held != value and not (kind == "BOOL" and held.upper() == value.upper()):
            rejected[name] = f"CMake kept {held!r}"
        else:
            accepted[name] = held
    return accepted, rejected


def _configure(plan: Plan, src: source.Source, build_dir: Path, log: Path,
               progress: ProgressFn | None, force: bool) -> dict[str, Any]:
    """Run CMake's configure step for `plan`; the record of what CMake took (Manifest.configure).
    Raises BuildError when CMake fails."""
    if force:
        # A reused CMake cache keeps the options (and flags) it was first configured with.
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    tag = f" ({plan.cpu_isa})"
    cfg = ["cmake", "-S", str(src.path), "-B", str(build_dir)]
    cfg += [f"-D{k}={v}" for k, v in plan.options.items()]
    if progress:
        progress("configure" + tag, None, None)
    started = time.monotonic()
    rc, tail = _run_logged(cfg, log, "configure" + tag, progress, dict(os.environ))
    if rc != 0:
        raise BuildError(
            f"CMake could not configure {src.path} (exit {rc}).",
            hint=f"Full log: {log}",
        ).with_tail(_error_excerpt(tail))
    accepted, rejected = judge_options(plan.options, read_cmake_cache(build_dir),
                                       unused_variables("\n".join(tail)))
    return {"argv": cfg, "accepted": accepted, "rejected": rejected,
            "seconds": round(time.monotonic() - started, 1)}


def _preflight() -> str:
    """The C++ compiler's version line; refuses when cmake or a compiler is missing."""
    if toolchain.cmake() is None:
        raise MissingToolError(
            "cmake is not installed, so llama.cpp cannot be built.",
            hint="Install it (`apt-get install cmake` or `pip install cmake`) and run again.",
        )
    compiler = toolchain.cxx_version()
    if compiler is None:
        raise MissingToolError(
            "no C++ compiler (c++, g++ or clang++) on PATH, so llama.cpp cannot be built.",
            hint="Install one (`apt-get install build-essential`) and run again.",
        )
    return compiler


def _source_is_fork(source_spec: str | None) -> bool:
    """The build will use the submodule (the MTP + TurboQuant fork), known before resolving."""
    if source_spec == "submodule":
        return True
    return source_spec in (None, "", "auto") and source.submodule_source() is not None


def configure_only(
    source_spec: str | None = None,
    *,
    cpu: bool = False,
    cuda_arch: str | None = None,
    cpu_isa: str | None = None,
    allow_unpinned: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """CMake's configure step alone, in the build's own cache folder: seconds, no compile.

    Returns (and writes to configure.json there) the plan, the argv and which options CMake
    took; a build with the same options later reuses the configured folder."""
    compiler = _preflight()
    plan = plan_build(cpu=cpu, cuda_arch=cuda_arch, cpu_isa=cpu_isa or CPU_ISAS[0],
                      fork=_source_is_fork(source_spec))
    src = source.resolve(source_spec, allow_unpinned=allow_unpinned)
    # the patch set is for the pinned sources; a --source PATH tree is configured as it is
    applied = patchset.select()[0] if src.kind in ("offline", "submodule") else []
    key = cache_key(src.identity, plan.options, compiler, patchset.key_part(applied))
    build_dir = paths.build_cache_dir() / f"{plan.variant}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _locked(paths.build_cache_dir() / f"{plan.variant}-{key}.lock"):
        src = _patched_source(src, applied, build_dir)
        log = build_dir / "configure.log"
        log.write_text("")
        record = _configure(plan, src, build_dir, log, progress, force=True)
    result = {"variant": plan.variant, "reason": plan.reason, "cpu_isa": plan.cpu_isa,
              "source": {**src.to_dict(), "why": src.reason}, "cmake_options": plan.options,
              "cuda": plan.cuda, "cache_key": key, "build_dir": str(build_dir), "log": str(log),
              **record}
    _write_json(build_dir / "configure.json", result)
    return result


def build(
    source_spec: str | None = None,
    *,
    cpu: bool = False,
    cuda_arch: str | None = None,
    jobs: int | None = None,
    progress: ProgressFn | None = None,
    force: bool = False,
    cpu_isa: str | None = None,
    allow_unpinned: bool = False,
    note: NoteFn | None = None,
    no_patches: bool = False,
    skip_patches: tuple[str, ...] = (),
    install: bool = True,
) -> tuple[Manifest, bool, str]:
    """Build (or reuse) llama-server, tried on this machine. Returns (manifest, reused, why).

    Each CPU configuration (CPU_ISAS, or only `cpu_isa` when given) is its own cache entry. A
    new binary is started on a real model and asked for tokens; one that crashes is remembered
    as crashed (never installed, never reused) and the next configuration is built.

    The patch set (patchset) is applied unless `no_patches`; `skip_patches` opts out of some.
    `install=False` leaves build/<variant>/ as it is and returns the cache entry's manifest.
    """
    compiler = _preflight()
    # The patch set is for the pinned sources; a --source PATH tree is built as it is.
    own_tree = source_spec not in (None, "", "auto", "offline", "submodule")
    applied, opted_out = patchset.select(no_patches or own_tree, skip_patches)
    why_out = ("a --source PATH tree is built as it is" if own_tree
               else "--no-patches" if no_patches else "--skip-patch")
    patch_records = ([p.record("applied") for p in applied]
                     + [p.record("opted-out", why_out) for p in opted_out])
    isas = [cpu_isa] if cpu_isa else list(CPU_ISAS)
    fork = _source_is_fork(source_spec)
    plans: list[Plan] = []
    for isa in isas:
        plan = plan_build(cpu=cpu, cuda_arch=cuda_arch, cpu_isa=isa, fork=fork)
        if all(p.options != plan.options for p in plans):  # on Arm, safe == baseline
            plans.append(plan)

    # The offline source's identity is known before downloading, so a cached build is reused
    # without touching the network or the 76 MB archive.
    src: source.Source | None = None
    if source_spec in (None, "", "auto") and source.submodule_source() is None:
        identity, why = source.offline_identity(), "the submodule is not initialised"
    elif source_spec == "offline":
        identity, why = source.offline_identity(), "asked for with --source offline"
    else:
        src = source.resolve(source_spec, allow_unpinned=allow_unpinned)
        identity, why = src.identity, src.reason

    say = note or (lambda _msg: None)
    tried: list[dict[str, Any]] = []
    for i, plan in enumerate(plans):
        key = cache_key(identity, plan.options, compiler, patchset.key_part(applied))
        build_dir = paths.build_cache_dir() / f"{plan.variant}-{key}"
        cached_manifest = build_dir / MANIFEST
        manifest: Manifest | None = None
        reused = False
        with _locked(paths.build_cache_dir() / f"{plan.variant}-{key}.lock"):
            if not force and cached_manifest.is_file() and (src is None or src.kind != "path"):
                found = Manifest.from_dict(json.loads(cached_manifest.read_text()))
                if _binaries_ok(found):
                    manifest, reused = found, True
                    if manifest.capabilities is None:
                        # Recorded by an older mtpwrap: parse --help once and keep it.
                        server = Path(manifest.binaries["llama-server"]["cache_path"])
                        manifest.capabilities = _capabilities(server)
            if manifest is None:
                if src is None:
                    src = source.resolve(source_spec, allow_unpinned=allow_unpinned)
                    why = src.reason
                manifest = _compile(plan, _patched_source(src, applied, build_dir), why, key,
                                    build_dir, compiler, jobs, progress, force)
                manifest.patches = patch_records
                rejected = (manifest.configure or {}).get("rejected") or {}
                if rejected:
                    taken = "; ".join(f"{k}: {w}" for k, w in rejected.items())
                    say(f"CMake did not take {taken} (log: {manifest.log})")
            if manifest.smoke is None:
                # New, or cached by an mtpwrap that did not try its builds: try it now.
                if progress:
                    progress(f"smoke test ({plan.cpu_isa})", None, None)
                manifest.smoke = _smoke_test(Path(manifest.binaries["llama-server"]
                                                  ["cache_path"]), plan.variant, build_dir,
                                             manifest.architectures)
            if manifest.spec_depth is None and manifest.smoke_status == "passed":
                manifest.spec_depth = _spec_depth_probe(
                    Path(manifest.binaries["llama-server"]["cache_path"]), plan.variant,
                    build_dir)
            manifest.cpu_isa = plan.cpu_isa
            _write_json(cached_manifest, manifest.to_dict())
        tried.append(_attempt_summary(manifest))
        if manifest.trusted:
            manifest.attempts = tried
            manifest.extra = {**manifest.extra, "isa_reason": _isa_reason(plan, tried, cpu_isa)}
            _write_json(cached_manifest, manifest.to_dict())
            if progress:
                progress("up to date" if reused else "built", 100.0, None)
            if not install:
                return manifest, reused, why
            return _install(manifest, paths.build_root() / plan.variant), reused, why
        smoke = manifest.smoke or {}
        what = f"the {plan.cpu_isa} build " + ("crashed" if smoke.get("status") == "crashed"
                                                else "failed") + f": {smoke.get('detail')}"
        if reused:
            what += " (remembered from an earlier try; --force tries it again)"
        if smoke.get("status") != "crashed":
            # Only a crash says the instruction sets are wrong; anything else is not fixed by
            # building again with fewer of them.
            raise BuildError(
                f"{what}. The binary was not installed.",
                hint=f"Build log: {manifest.log}. Run `mtpwrap build --force` to try again.",
            ).with_tail(smoke.get("log_tail", []))
        if i + 1 < len(plans):
            say(f"{what}; trying the {plans[i + 1].cpu_isa} configuration.")
    last = tried[-1]
    _uninstall_if(paths.build_root() / plans[-1].variant, {t["cache_key"] for t in tried})
    raise BuildError(
        "every CPU configuration tried crashed in its smoke test ("
        + "; ".join(f"{t['cpu_isa']}: {t['detail']}" for t in tried)
        + "). Nothing was installed.",
        hint=f"Build log: {Path(last['build_dir']) / 'build.log'}. Force one with --cpu-isa, "
        "or report the log lines above.",
    ).with_tail(last.get("log_tail", []))


def _uninstall_if(variant_dir: Path, keys: set[str]) -> None:
    """Take an installed build out of build/<variant>/ when it is one that just failed here."""
    mf = variant_dir / MANIFEST
    with contextlib.suppress(OSError, ValueError):
        if json.loads(mf.read_text()).get("cache_key") in keys:
            mf.unlink()


def _isa_reason(plan: Plan, tried: list[dict[str, Any]], forced: str | None) -> str:
    if forced:
        return f"--cpu-isa {forced} asked for it"
    if len(tried) == 1:
        return f"the {plan.cpu_isa} configuration's smoke test {tried[0]['smoke']}"
    failed = ", ".join(f"{t['cpu_isa']} ({t['detail']})" for t in tried[:-1])
    return f"kept {plan.cpu_isa}: {failed} failed on this CPU"


def ensure_built(variant: str = "cpu") -> Manifest:
    """The manifest of a build of this variant, building it (quietly) when there is none."""
    if variant != "cpu":
        found = load_manifest(variant)
        if found is None:
            raise MissingToolError(f"no {variant} build.", hint="Run `mtpwrap build`.")
        return found
    manifest, _, _ = build(cpu=True)
    return manifest


def installed_variants() -> list[Manifest]:
    root = paths.build_root()
    found: list[Manifest] = []
    if root.is_dir():
        for mf in sorted(root.glob(f"*/{MANIFEST}")):
            try:
                found.append(Manifest.from_dict(json.loads(mf.read_text())))
            except (OSError, ValueError, TypeError):
                continue
    return found


def load_manifest(variant: str | None = None) -> Manifest | None:
    """The installed build of `variant`; by default a CUDA build if there is one, else CPU."""
    builds = installed_variants()
    if variant:
        builds = [m for m in builds if m.variant == variant]
    else:
        builds.sort(key=lambda m: (m.variant.startswith("cuda"), m.built_at), reverse=True)
    for m in builds:
        if _binaries_ok(m) and all(Path(b["path"]).is_file() for b in m.binaries.values()):
            return m
    return None


def update_manifest(manifest: Manifest, **extra: Any) -> Manifest:
    """Store extra facts (e.g. measured KV type sizes) in both copies of a manifest."""
    merged = Manifest.from_dict({**manifest.to_dict(), "extra": {**manifest.extra, **extra}})
    _write_json(Path(manifest.build_dir) / MANIFEST, merged.to_dict())
    variant_file = paths.build_root() / manifest.variant / MANIFEST
    if variant_file.is_file():
        _write_json(variant_file, merged.to_dict())
    return merged


def pin_identity(kind: str | None) -> str | None:
    """The cache identity of the pinned source of this kind (None for a PATH source)."""
    if kind == "offline":
        return source.offline_identity()
    if kind == "submodule":
        return f"submodule:{source.SUBMODULE_COMMIT}"
    return None


#: xz dictionary for --pack: more than one statically linked CUDA binary (81 MB for sm_89).
PACK_DICT_BYTES = 128 << 20


def pack_prebuilt(manifest: Manifest, dest: Path) -> Path:
    """An installed build's binaries and manifest.json as one xz archive, to carry to a machine
    that should not spend its time compiling (see `install_prebuilt`)."""
    import lzma

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    # llama-server and llama-fit-params each hold the whole CUDA backend: a dictionary larger
    # than one binary lets xz store that code once (sm_89: 82 MB with the default, 44 with this).
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": PACK_DICT_BYTES}]
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz, \
            tarfile.open(fileobj=xz, mode="w") as tar:
        for name, info in manifest.binaries.items():
            tar.add(info["path"], arcname=f"bin/{name}")
        data = json.dumps(manifest.to_dict(), indent=2).encode()
        member = tarfile.TarInfo(MANIFEST)
        member.size = len(data)
        member.mtime = int(time.time())
        tar.addfile(member, io.BytesIO(data))
    os.replace(tmp, dest)
    return dest


def install_prebuilt(archive: str | Path, snap: Any | None = None) -> Manifest:
    """Install a carried build (`pack_prebuilt`) into build/<variant>/ after checking that it was
    built from the pinned source and has code for the GPUs present; raises ConfigError if not."""
    path = Path(archive)
    try:
        tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by the `with tar` below
    except (OSError, tarfile.TarError) as exc:
        raise ConfigError(f"prebuilt {path}: not a readable archive ({exc}).",
                          hint="Make one with `mtpwrap build --pack FILE`.") from None
    with tar:
        try:
            fh = tar.extractfile(MANIFEST)
            manifest = Manifest.from_dict(json.loads(fh.read() if fh else b""))
        except (KeyError, ValueError, TypeError):
            raise ConfigError(f"prebuilt {path}: no readable {MANIFEST} inside.",
                              hint="Make one with `mtpwrap build --pack FILE`.") from None
        kind, identity = manifest.source.get("kind"), manifest.source.get("identity")
        pinned = pin_identity(kind)
        if pinned is None or identity != pinned:
            raise ConfigError(
                f"prebuilt {path}: built from {kind} source {identity}, but the pin is "
                f"{pinned or 'the submodule or the offline source'}.",
                hint="Make it again from this checkout with `mtpwrap build --pack FILE`.")
        problem = coverage_problem(manifest, snap)
        if problem is not None:
            raise ConfigError(f"prebuilt {path}: {problem}")
        bin_dir = paths.build_root() / manifest.variant / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        binaries: dict[str, dict[str, str]] = {}
        for name, info in manifest.binaries.items():
            src_fh = tar.extractfile(f"bin/{name}")
            if src_fh is None:
                raise ConfigError(f"prebuilt {path}: bin/{name} is missing.")
            dst = bin_dir / name
            tmp = dst.with_suffix(".tmp")
            with tmp.open("wb") as out:
                shutil.copyfileobj(src_fh, out)
            tmp.chmod(0o755)
            if hashing.sha256_file(tmp) != info["sha256"]:
                tmp.unlink()
                raise ConfigError(f"prebuilt {path}: bin/{name} does not match the sha256 its "
                                  "manifest records.", hint="Copy the archive again.")
            os.replace(tmp, dst)
            binaries[name] = {"path": str(dst), "cache_path": str(dst), "sha256": info["sha256"]}
    installed = Manifest.from_dict({
        **manifest.to_dict(), "binaries": binaries, "build_dir": str(bin_dir.parent),
        "extra": {**manifest.extra, "prebuilt": {"archive": str(path.resolve()),
                                                 "built_dir": manifest.build_dir}}})
    _write_json(bin_dir.parent / MANIFEST, installed.to_dict())
    return installed


def uncovered_gpus(manifest: Manifest, snap: Any | None = None) -> list[tuple[str, str]]:
    """The present GPUs, as (name, arch), that a CUDA build has no code for; [] for CPU builds.

    A build covers a GPU when it was compiled for that compute capability (89 covers an RTX
    4090's 8.9; "90a" covers 9.0)."""
    if not manifest.variant.startswith("cuda"):
        return []
    if snap is None:
        try:
            from mtpwrap.decide import hardware

            snap = hardware.snapshot()
        except Exception:
            return []
    built = {str(_arch_number(a)) for a in manifest.architectures if re.match(r"\d", a)}
    gaps: list[tuple[str, str]] = []
    for gpu in getattr(snap, "gpus", ()) or ():
        cc = getattr(gpu, "compute_capability", None)
        if cc and f"{cc[0]}{cc[1]}" not in built:
            gaps.append((str(getattr(gpu, "name", "GPU")), f"{cc[0]}{cc[1]}"))
    return gaps


def rebuild_command(manifest: Manifest, gaps: list[tuple[str, str]]) -> str:
    """The `mtpwrap build` that covers both what this build has and the GPUs it lacks."""
    archs = list(dict.fromkeys([*manifest.architectures, *(a for _, a in gaps)]))
    return f"mtpwrap build --cuda-arch {','.join(sorted(archs, key=_arch_number))}"


def coverage_problem(manifest: Manifest, snap: Any | None = None) -> str | None:
    """One sentence when a CUDA build cannot run on a present GPU, naming the build that can."""
    gaps = uncovered_gpus(manifest, snap)
    if not gaps:
        return None
    gpus = ", ".join(f"{name} (sm_{arch})" for name, arch in gaps)
    built = ", ".join(f"sm_{a}" for a in manifest.architectures)
    return (f"the installed {manifest.variant} build has no code for {gpus}: it was compiled "
            f"for {built} only. Run `{rebuild_command(manifest, gaps)}`.")


def find_binary(name: str = "llama-server", explicit: str | Path | None = None,
                snap: Any | None = None) -> Path:
    """An explicit path, `MTPWRAP_BINARY`, or the installed build's binary.

    An installed CUDA build must have code for every GPU NVML sees; otherwise another installed
    CUDA build that has is used, or the command that builds one is named."""
    candidate = explicit or (
        os.environ.get("MTPWRAP_BINARY") if name == "llama-server" else None
    )
    if candidate:
        p = Path(candidate).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ConfigError(f"--binary {candidate}: not an executable file.")
        return p
    manifest = load_manifest()
    if manifest is None:
        raise MissingToolError(
            "no built llama-server found under build/.",
            hint="Run `mtpwrap build` (or `mtpwrap build --cpu`) first.",
        )
    problem = coverage_problem(manifest, snap)
    if problem is not None:
        others = [m for m in installed_variants()
                  if m.variant.startswith("cuda") and m.variant != manifest.variant
                  and _binaries_ok(m) and not uncovered_gpus(m, snap)]
        if not others:
            raise MissingToolError(problem)
        manifest = others[0]
    return manifest.binary(name)
