"""What a build will do, decided before anything runs: variant, CMake options, cache key.

The CPU configurations (native, safe, baseline), the CUDA options for the GPUs present or asked
for, the options a source tree needs (its web UI), and the key a build is cached under: source
identity, options, compiler and host CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.build import source, toolchain
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError, MissingToolError

#: What `cmake --build` makes. llama-quantize writes the low-bit draft models of
#: benchmarks/adaptive_spec.py; llama-perplexity measures KV quality (KL divergence) with the
#: same source, options and patches as the server.
TARGETS = ("llama-server", "llama-fit-params", "llama-quantize", "llama-perplexity")
#: The targets a patched build's cache key names. Targets added since are built into the
#: same cache folder (an incremental compile), so existing entries stay valid.
KEYED_TARGETS = ("llama-server", "llama-fit-params", "llama-quantize")


@dataclass(frozen=True)
class BuildPlan:
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


def isa_order(pinned: bool = True, flags: set[str] | None = None
              ) -> tuple[tuple[str, ...], str | None]:
    """The CPU configurations a build tries, in order, and why native is left out when it is.

    For the pinned sources (`pinned`: the offline source or the submodule, not a PATH tree) on
    a CPU with AMX, native is not tried unless asked for (`--cpu-isa native`): llama.cpp's AMX
    kernels at those commits (upstream 0c1e570, the fork's 0bc0a27) crash in the first
    quantized matrix multiply on such Xeons (virtualised Sapphire Rapids here; llama.cpp
    #20824), so a native build there costs a whole compile only to be thrown away. A PATH tree
    may be newer: native first, as on every other CPU."""
    have = cpu_flags() if flags is None else flags
    if pinned and _is_x86() and "amx_tile" in have:
        return CPU_ISAS[1:], ("this CPU has AMX, whose llama.cpp kernels crash at the pinned "
                              "sources, so native (AMX on) is tried only with --cpu-isa native")
    return CPU_ISAS, None


def flag_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FLAG_ENV if os.environ.get(k)}


def host_fingerprint() -> str:
    # GGML_NATIVE compiles for this CPU, so a build is only reusable on the same instruction set.
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:12]


def present_gpus(snap: Any | None = None) -> list[tuple[str, str]]:
    """Each GPU NVML sees (or `snap` holds) as (name, compute capability "89"); [] when none."""
    if snap is None:
        try:
            snap = hardware.snapshot()
        except Exception:
            return []
    return [(str(getattr(gpu, "name", "GPU")), f"{cc[0]}{cc[1]}")
            for gpu in getattr(snap, "gpus", ()) or ()
            if (cc := getattr(gpu, "compute_capability", None))]


def present_gpu_archs(snap: Any | None = None) -> list[str]:
    """The compute capabilities of the GPUs NVML sees ("89", "90"), each once; [] when none."""
    return sorted({arch for _, arch in present_gpus(snap)}, key=arch_number)


def arch_number(arch: str) -> int:
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
    return sorted(archs, key=arch_number)


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
    "GGML_CUDA_FA_ALL_QUANTS": ("OFF", "tbq4_0 K with tbq4_0 V has its own MMA kernels, "
                                "compiled in either way (fattn.cu dispatches TBQ4_0 outside the "
                                "option; template-instances/fattn-mma-tbq4-*); the option adds "
                                "the vector kernels of every other K/V pair, which only the "
                                "planar/iso types need (--fa-all-quants), at several times the "
                                "compile"),
}
#: --fa-all-quants: the vector flash-attention kernels of every K/V type pair
FA_ALL_QUANTS_ASKED = ("ON", "asked for with --fa-all-quants (the fork's planar/iso KV types "
                             "need it)")

#: What GGML_CUDA_NO_VMM=ON (the build links without libcuda.so) costs when it runs.
NO_VMM_COST = (
    "ggml's temporary compute buffers come from its legacy pool (up to 256 cudaMalloc'd blocks "
    "reused best-fit, each 5 % larger than asked, kept until exit) instead of one virtual "
    "address range grown in place through the driver's VMM API: a little more VRAM held for "
    "scratch and a few cudaMalloc calls on the first requests; weights and KV cache are "
    "unaffected, and the driver is still loaded by the CUDA runtime when the server starts"
)


def _cuda_plan(tk: toolchain.CudaToolkit, archs: list[str], fork: bool,
               fa_all_quants: bool = False) -> tuple[dict[str, str], dict[str, Any]]:
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
    chosen = dict(FORK_CUDA_OPTIONS) if fork else {}
    if fa_all_quants:
        chosen["GGML_CUDA_FA_ALL_QUANTS"] = FA_ALL_QUANTS_ASKED
    opts.update({k: v for k, (v, _) in chosen.items()})
    if fork:
        info["fork_options"] = {k: {"value": v, "why": why} for k, (v, why) in chosen.items()}
    elif fa_all_quants:
        info["fa_all_quants"] = FA_ALL_QUANTS_ASKED[1]
    return opts, info


def plan_build(cpu: bool = False, cuda_arch: str | None = None, cpu_isa: str = "native",
               fork: bool = False, fa_all_quants: bool = False) -> BuildPlan:
    """`fork`: the source is the MTP + TurboQuant fork, whose CUDA options are then set;
    `fa_all_quants`: a CUDA build compiles flash attention for every K/V type pair."""
    ccache = toolchain.ccache()
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "BUILD_SHARED_LIBS": "OFF",
        **isa_options(cpu_isa),
    }
    if ccache:
        options["CMAKE_C_COMPILER_LAUNCHER"] = ccache
        options["CMAKE_CXX_COMPILER_LAUNCHER"] = ccache
    asked = parse_cuda_archs(cuda_arch) if cuda_arch is not None else None
    if cpu:
        return BuildPlan("cpu", None, "--cpu asked for a CPU build", options, cpu_isa)
    archs = asked or present_gpu_archs()
    if not archs:
        return BuildPlan("cpu", None, "no NVIDIA GPU found through NVML and no --cuda-arch",
                         options, cpu_isa)
    tk = toolchain.cuda_toolkit()
    shown = ",".join(archs)
    if not tk.usable:
        why = tk.why_unusable()
        if asked:
            raise MissingToolError(
                f"--cuda-arch {cuda_arch}: cannot build for CUDA because {why}.",
                hint=tk.how_to_fix(),
            )
        return BuildPlan("cpu", None, f"a GPU (sm_{shown}) is present but {why}", options, cpu_isa)
    cuda_opts, info = _cuda_plan(tk, archs, fork, fa_all_quants)
    options.update(cuda_opts)
    if ccache:
        options["CMAKE_CUDA_COMPILER_LAUNCHER"] = ccache
    reason = f"--cuda-arch {shown}" if asked else f"GPU compute capability {shown} (NVML)"
    return BuildPlan(cuda_variant(archs), shown, reason, options, cpu_isa, info)


def cache_key(identity: str, options: dict[str, str], compiler: str | None,
              patches: list[list[str]] | None = None) -> str:
    """`patches`: patchset.key_part of the applied patches. A patched build is keyed by the
    patches' content and KEYED_TARGETS too; an unpatched one keeps the key such builds have
    always had, so their cache entries stay valid. The web UI options (webui_options) follow
    from the source tree, which `identity` already names, so they are not part of the key."""
    # The ccache launcher path does not change the result, so it is left out of the key.
    opts = {k: v for k, v in sorted(options.items()) if not k.endswith("_COMPILER_LAUNCHER")}
    parts: list[Any] = [identity, opts, compiler, host_fingerprint(), flag_env()]
    if patches:
        parts.append({"patches": patches, "targets": list(KEYED_TARGETS)})
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_is_fork(source_spec: str | None) -> bool:
    """The build will use the submodule (the MTP + TurboQuant fork), known before resolving."""
    if source_spec == "submodule":
        return True
    return source_spec in (None, "", "auto") and source.submodule_source() is not None


_OPTION = re.compile(r"option\s*\(\s*(LLAMA_BUILD_WEBUI|LLAMA_BUILD_UI|LLAMA_USE_PREBUILT_UI)\s")


def _declared_options(tree: Path) -> set[str]:
    """The web UI options a llama.cpp tree declares."""
    found: set[str] = set()
    for rel in ("CMakeLists.txt", "tools/server/CMakeLists.txt"):
        with contextlib.suppress(OSError):
            found.update(_OPTION.findall((tree / rel).read_text(errors="replace")))
    return found


def webui_options(tree: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The CMake options a tree's web UI needs, and whether llama-server will serve the UI.

    Trees that declare `LLAMA_BUILD_WEBUI` (the fork, older upstream) compile the UI from
    `tools/server/public/` and fail without its `bundle.js`; it is turned off when the bundle
    is missing (snapshots leave out large files) and on otherwise. Newer upstream
    (`LLAMA_BUILD_UI`, default OFF) embeds a UI only from a prebuilt `tools/ui/dist/`, since
    the download is turned off."""
    declared = _declared_options(tree)
    if "LLAMA_BUILD_WEBUI" in declared:
        bundle = tree / "tools" / "server" / "public" / "bundle.js"
        if not bundle.is_file():
            return {"LLAMA_BUILD_WEBUI": "OFF"}, {
                "in_binary": False,
                "why": "tools/server/public/bundle.js is missing from the source tree, so it "
                       "was built with LLAMA_BUILD_WEBUI=OFF"}
        # said explicitly: a reused CMake cache would keep an earlier OFF
        return {"LLAMA_BUILD_WEBUI": "ON"}, {
            "in_binary": True, "why": "built from the tree's tools/server/public bundle "
                                      "(LLAMA_BUILD_WEBUI=ON)"}
    # Newer upstream downloads a prebuilt UI at configure time unless told not to; a tree that
    # does not declare the option (the fork) is not given it (CMake would call it unused).
    no_download = ({"LLAMA_USE_PREBUILT_UI": "OFF"} if "LLAMA_USE_PREBUILT_UI" in declared
                   else {})
    if "LLAMA_BUILD_UI" in declared:
        dist = tree / "tools" / "ui" / "dist" / "index.html"
        if dist.is_file():
            return no_download, {"in_binary": True,
                                 "why": "the tree has a built UI in tools/ui/dist"}
        return no_download, {"in_binary": False,
                    "why": "no built UI in tools/ui/dist, and LLAMA_BUILD_UI (npm) and "
                           "LLAMA_USE_PREBUILT_UI (download) are off"}
    return no_download, {"in_binary": None, "why": "the tree declares no web UI option"}
