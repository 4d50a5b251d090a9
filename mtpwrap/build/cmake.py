"""CMake: the configure step, which options it took, the compile, and the manifest of the result."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpwrap import hashing, proc
from mtpwrap.build import probe, source, toolchain
from mtpwrap.build.manifest import Manifest
from mtpwrap.build.planning import TARGETS, BuildPlan, flag_env, webui_options
from mtpwrap.errors import BuildError, MissingToolError

_PERCENT = re.compile(r"^\[\s*(\d+)%\]")

ProgressFn = Callable[[str, float | None, str | None], None]  # phase, percent, line


def preflight() -> str:
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


def _run_logged(
    cmd: list[str], log: Path, phase: str, progress: ProgressFn | None, env: dict[str, str]
) -> tuple[int, list[str]]:
    tail: list[str] = []
    with log.open("a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        child = proc.start(cmd, env=env, stdout=proc.PIPE, stderr=proc.STDOUT, text=True,
                           what=Path(cmd[0]).name)
        try:
            assert child.popen.stdout is not None
            for line in child.popen.stdout:
                lf.write(line)
                lf.flush()  # a person tailing the log sees the build as it goes
                tail.append(line.rstrip("\n"))
                if len(tail) > 400:
                    del tail[:200]
                if progress:
                    m = _PERCENT.match(line)
                    progress(phase, float(m.group(1)) if m else None, line.rstrip("\n"))
        except BaseException:  # Ctrl-C: no compiler outlives the build
            child.stop(grace=5.0)
            raise
        rc = child.wait()
        return rc if rc is not None else -1, tail


def _error_excerpt(tail: list[str], n: int = 25) -> list[str]:
    errors = [i for i, line in enumerate(tail) if re.search(r"\berror\b", line, re.I)]
    if errors:
        start = max(0, errors[0] - 2)
        return tail[start : start + n]
    return tail[-n:]


def _version_output(binary: Path) -> str:
    try:
        return proc.version(binary)
    except proc.ProcError as exc:
        return f"(--version failed: {exc.message})"


def capabilities(binary: Path) -> dict[str, Any] | None:
    """What the binary's --help offers (decide.capabilities), or None when it cannot say."""
    try:
        return probe.probe(binary).to_dict()
    except Exception:
        return None


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


def configure(plan: BuildPlan, src: source.Source, build_dir: Path, log: Path,
              progress: ProgressFn | None, force: bool) -> dict[str, Any]:
    """Run CMake's configure step for `plan` and the tree's own options (its web UI); the
    record of what CMake took (Manifest.configure), with `options` and `webui`.
    Raises BuildError when CMake fails."""
    if force:
        # A reused CMake cache keeps the options (and flags) it was first configured with.
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    tree_options, webui = webui_options(src.path)
    options = {**plan.options, **tree_options}
    tag = f" ({plan.cpu_isa})"
    cfg = ["cmake", "-S", str(src.path), "-B", str(build_dir)]
    cfg += [f"-D{k}={v}" for k, v in options.items()]
    if progress:
        progress("configure" + tag, None, None)
    started = time.monotonic()
    rc, tail = _run_logged(cfg, log, "configure" + tag, progress, dict(os.environ))
    if rc != 0:
        raise BuildError(
            f"CMake could not configure {src.path} (exit {rc}).",
            hint=f"Full log: {log}",
        ).with_tail(_error_excerpt(tail))
    accepted, rejected = judge_options(options, read_cmake_cache(build_dir),
                                       unused_variables("\n".join(tail)))
    return {"argv": cfg, "accepted": accepted, "rejected": rejected,
            "seconds": round(time.monotonic() - started, 1), "options": options,
            "webui": webui}


def _compile_targets(build_dir: Path, log: Path, tag: str, jobs: int | None,
                     progress: ProgressFn | None) -> dict[str, dict[str, str]]:
    n = jobs or os.cpu_count() or 2
    cmd = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(n), "--target"]
    cmd += list(TARGETS)
    # ccache (when it is the launcher) hashes absolute paths: relative to this build's own
    # folder, which holds the patched overlay too, the same source compiles to the same cache
    # entry whichever cache key (patch set, options) the build folder is named by.
    env = {**os.environ, "CCACHE_BASEDIR": str(build_dir), "CCACHE_NOHASHDIR": "true"}
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
        binaries[name] = {"path": str(exe), "cache_path": str(exe),
                          "sha256": hashing.sha256_file(exe)}
    return binaries


def compile_plan(plan: BuildPlan, src: source.Source, why: str, key: str, build_dir: Path,
                 compiler: str | None, jobs: int | None, progress: ProgressFn | None,
                 force: bool) -> Manifest:
    """Configure and compile one plan into build_dir; the manifest has no smoke result yet.
    A build_dir that was compiled before is compiled incrementally (new targets only)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    log = build_dir / "build.log"
    log.write_text("")
    started = time.monotonic()
    configured = configure(plan, src, build_dir, log, progress, force)
    options, webui = configured.pop("options"), configured.pop("webui")
    binaries = _compile_targets(build_dir, log, f" ({plan.cpu_isa})", jobs, progress)
    server = build_dir / "bin" / "llama-server"
    tk = toolchain.cuda_toolkit() if plan.variant.startswith("cuda") else None
    return Manifest(
        variant=plan.variant,
        source={**src.to_dict(), "why": why},
        cmake_options=options,
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
        capabilities=capabilities(server),
        extra={"plan_reason": plan.reason, "cmake_version": toolchain.cmake_version(),
               "flag_env": flag_env()},
        cpu_isa=plan.cpu_isa,
        cuda=plan.cuda,
        configure=configured,
        webui=webui,
    )
