"""Configure and build llama-server (and llama-fit-params) with CMake, and record what was built.

Builds live in a cache keyed by source identity, CMake options, compiler and host CPU
(`~/.cache/mtpwrap/builds/<variant>-<key>/`), so a fresh checkout on the same machine reuses them;
the checkout's `build/<variant>/` gets the binaries and `manifest.json`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths, source, toolchain
from mtpwrap.errors import BuildError, ConfigError, MissingToolError

TARGETS = ("llama-server", "llama-fit-params")
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


def _cuda_arch_from_gpu() -> str | None:
    try:
        from mtpwrap import hardware
    except ImportError:
        return None
    try:
        snap = hardware.snapshot()
    except Exception:  # noqa: BLE001 - no driver is a normal answer here
        return None
    for gpu in getattr(snap, "gpus", ()):
        cc = getattr(gpu, "compute_capability", None)
        if cc:
            return f"{cc[0]}{cc[1]}"
    return None


def plan_build(cpu: bool = False, cuda_arch: str | None = None, cpu_isa: str = "native") -> Plan:
    ccache = toolchain.ccache()
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "LLAMA_CURL": "OFF",
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
    if cuda_arch is not None and not re.fullmatch(r"\d{2,3}[a-z]?", cuda_arch):
        raise ConfigError(
            f"--cuda-arch {cuda_arch}: expected a compute capability such as 89 (RTX 4090), "
            "86 (3090), 120 (5090) or 90 (H100/H200)."
        )
    if cpu:
        return Plan("cpu", None, "--cpu asked for a CPU build", options, cpu_isa)
    tk = toolchain.cuda_toolkit()
    arch = cuda_arch or _cuda_arch_from_gpu()
    if arch is None:
        return Plan("cpu", None, "no NVIDIA GPU found through NVML and no --cuda-arch", options,
                    cpu_isa)
    if not tk.usable:
        why = (
            "no nvcc on PATH" if tk.nvcc is None else f"the CUDA toolkit at {tk.root} lacks cuBLAS"
        )
        if cuda_arch:
            raise MissingToolError(
                f"--cuda-arch {cuda_arch}: cannot build for CUDA because {why}.",
                hint="Install the CUDA toolkit with cuBLAS (e.g. `apt-get install "
                "nvidia-cuda-toolkit` or NVIDIA's cuda-toolkit), or build with --cpu.",
            )
        return Plan("cpu", None, f"a GPU (sm_{arch}) is present but {why}", options, cpu_isa)
    options.update(
        {
            "GGML_CUDA": "ON",
            "GGML_CUDA_F16": "ON",
            "CMAKE_CUDA_ARCHITECTURES": arch,
        }
    )
    if ccache:
        options["CMAKE_CUDA_COMPILER_LAUNCHER"] = ccache
    reason = f"--cuda-arch {arch}" if cuda_arch else f"GPU compute capability {arch} (NVML)"
    return Plan(f"cuda-sm{arch}", arch, reason, options, cpu_isa)


def cache_key(identity: str, options: dict[str, str], compiler: str | None) -> str:
    # The ccache launcher path does not change the result, so it is left out of the key.
    opts = {k: v for k, v in sorted(options.items()) if not k.endswith("_COMPILER_LAUNCHER")}
    blob = json.dumps([identity, opts, compiler, _host_fingerprint(), _flag_env()],
                      sort_keys=True)
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
    try:
        from mtpwrap import capabilities
    except ImportError:
        return None
    try:
        return capabilities.probe(binary).to_dict()
    except Exception:  # noqa: BLE001 - a build stays valid if --help cannot be parsed
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


def _smoke_test(server: Path, variant: str, work_dir: Path) -> dict[str, Any]:
    from mtpwrap import smoke

    gpu = variant.startswith("cuda")
    if gpu and _cuda_arch_from_gpu() is None:
        return smoke.skipped("no NVIDIA GPU is visible on this machine, so the CUDA binary "
                             "cannot be tried here").to_dict()
    try:
        model = smoke.smoke_model(work_dir)
    except Exception as exc:  # noqa: BLE001 - no model to try with is a failed smoke test
        return smoke.SmokeResult("failed", f"no model to try the binary with: {exc}").to_dict()
    return smoke.run(server, model, gpu=gpu).to_dict()


def _compile(plan: Plan, src: source.Source, why: str, key: str, build_dir: Path,
             compiler: str | None, jobs: int | None, progress: ProgressFn | None,
             force: bool) -> Manifest:
    """Configure and compile one plan into build_dir; the manifest has no smoke result yet."""
    build_dir.mkdir(parents=True, exist_ok=True)
    if force:
        # A reused CMake cache keeps the options (and flags) it was first configured with.
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    log = build_dir / "build.log"
    log.write_text("")
    env = dict(os.environ)
    started = time.monotonic()
    tag = f" ({plan.cpu_isa})"

    cfg = ["cmake", "-S", str(src.path), "-B", str(build_dir)]
    cfg += [f"-D{k}={v}" for k, v in plan.options.items()]
    if progress:
        progress("configure" + tag, None, None)
    rc, tail = _run_logged(cfg, log, "configure" + tag, progress, env)
    if rc != 0:
        raise BuildError(
            f"CMake could not configure {src.path} (exit {rc}).",
            hint=f"Full log: {log}",
        ).with_tail(_error_excerpt(tail))

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
        architectures=[plan.arch] if plan.arch else [platform.machine()],
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
    )


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
) -> tuple[Manifest, bool, str]:
    """Build (or reuse) llama-server, tried on this machine. Returns (manifest, reused, why).

    Each CPU configuration (CPU_ISAS, or only `cpu_isa` when given) is its own cache entry. A
    new binary is started on a real model and asked for tokens; one that crashes is remembered
    as crashed (never installed, never reused) and the next configuration is built.
    """
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
    isas = [cpu_isa] if cpu_isa else list(CPU_ISAS)
    plans: list[Plan] = []
    for isa in isas:
        plan = plan_build(cpu=cpu, cuda_arch=cuda_arch, cpu_isa=isa)
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
        key = cache_key(identity, plan.options, compiler)
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
                manifest = _compile(plan, src, why, key, build_dir, compiler, jobs, progress,
                                    force)
            if manifest.smoke is None:
                # New, or cached by an mtpwrap that did not try its builds: try it now.
                if progress:
                    progress(f"smoke test ({plan.cpu_isa})", None, None)
                manifest.smoke = _smoke_test(Path(manifest.binaries["llama-server"]
                                                  ["cache_path"]), plan.variant, build_dir)
            manifest.cpu_isa = plan.cpu_isa
            _write_json(cached_manifest, manifest.to_dict())
        tried.append(_attempt_summary(manifest))
        if manifest.trusted:
            manifest.attempts = tried
            manifest.extra = {**manifest.extra, "isa_reason": _isa_reason(plan, tried, cpu_isa)}
            _write_json(cached_manifest, manifest.to_dict())
            if progress:
                progress("up to date" if reused else "built", 100.0, None)
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
        return f"the {plan.cpu_isa} configuration passed its smoke test"
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


def find_binary(name: str = "llama-server", explicit: str | Path | None = None) -> Path:
    """An explicit path, `MTPWRAP_LLAMA_SERVER`, or the installed build's binary."""
    candidate = explicit or (
        os.environ.get("MTPWRAP_LLAMA_SERVER") if name == "llama-server" else None
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
    return manifest.binary(name)
