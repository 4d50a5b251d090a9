"""The build loop: build (or reuse) llama-server and its tools, try each new binary, install one.

Builds live in a cache keyed by source identity, CMake options, compiler and host CPU
(`~/.cache/mtpwrap/builds/<variant>-<key>/`, planning.cache_key), so a fresh checkout on the same
machine reuses them; the checkout's `build/<variant>/` gets the binaries and `manifest.json`.
Each CPU configuration (planning.isa_order) is tried in turn until one passes its smoke test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths
from mtpwrap.build import cmake, patchset, planning, smoke, source, spec_probe, toolchain
from mtpwrap.build.cmake import ProgressFn
from mtpwrap.build.manifest import (
    MANIFEST,
    Manifest,
    binaries_ok,
    load_manifest,
    read,
    write_json,
)
from mtpwrap.build.planning import TARGETS, BuildPlan
from mtpwrap.errors import BuildError, MissingToolError

NoteFn = Callable[[str], None]

#: Crashed CPU configurations, by source, options, compiler and CPU (see `_crash_key`).
CRASHES = "cpu-isa-crashes.json"


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


def _patched_source(src: source.Source, applied: list[patchset.Patch], key_dir: Path,
                    force: bool) -> source.Source:
    """`src` with the applied patches, in an overlay beside the build folder (kept for an
    incremental compile: the key names the patches' content)."""
    if not applied:
        return src
    tree = key_dir.with_name(key_dir.name + ".src")
    if force or not (tree / "CMakeLists.txt").is_file():
        tree = patchset.overlay(src.path, tree, applied)
    return dataclasses.replace(src, path=tree)


def _smoke_test(server: Path, variant: str, work_dir: Path,
                archs: list[str] | None = None) -> dict[str, Any]:
    gpu = variant.startswith("cuda")
    present = planning.present_gpu_archs() if gpu else []
    if gpu and not present:
        return smoke.skipped("no NVIDIA GPU is visible on this machine, so the CUDA binary "
                             "cannot be tried here").to_dict()
    if gpu and archs and not set(present) & {str(planning.arch_number(a)) for a in archs}:
        return smoke.skipped(f"the GPUs here (sm_{', sm_'.join(present)}) are not among the "
                             f"build's architectures (sm_{', sm_'.join(archs)})").to_dict()
    try:
        model = smoke.smoke_model(work_dir)
    except Exception as exc:
        return smoke.SmokeResult("failed", f"no model to try the binary with: {exc}").to_dict()
    return smoke.run(server, model, gpu=gpu).to_dict()


def _spec_depth_probe(server: Path, variant: str, work_dir: Path) -> dict[str, Any]:
    if variant.startswith("cuda") and not planning.present_gpu_archs():
        return {"status": "unknown", "detail": "no GPU here to try the CUDA binary on"}
    try:
        model = smoke.smoke_model(work_dir)
    except Exception as exc:
        return {"status": "unknown", "detail": f"no model to probe with: {exc}"}
    return spec_probe.probe(server, model, gpu=variant.startswith("cuda"))


def _install(manifest: Manifest, variant_dir: Path) -> Manifest:
    """Copy the cached binaries into build/<variant>/bin and write manifest.json there."""
    bin_dir = variant_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binaries: dict[str, dict[str, str]] = {}
    for name, info in manifest.binaries.items():
        src = Path(info.get("cache_path", info["path"]))
        dst = bin_dir / name
        if not (dst.is_file() and hashing.sha256_file(dst) == info["sha256"]):
            tmp = paths.private_tmp(dst)
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
        binaries[name] = {"path": str(dst), "cache_path": str(src), "sha256": info["sha256"]}
    installed = Manifest.from_dict({**manifest.to_dict(), "binaries": binaries})
    write_json(variant_dir / MANIFEST, installed.to_dict())
    return installed


def _uninstall_if(variant_dir: Path, keys: set[str]) -> None:
    """Take an installed build out of build/<variant>/ when it is one that just failed here."""
    mf = variant_dir / MANIFEST
    with contextlib.suppress(OSError, ValueError):
        if json.loads(mf.read_text()).get("cache_key") in keys:
            mf.unlink()


def _attempt_summary(m: Manifest) -> dict[str, Any]:
    smoke_ = m.smoke or {}
    return {"cpu_isa": m.cpu_isa, "cache_key": m.cache_key, "build_dir": m.build_dir,
            "smoke": smoke_.get("status"), "detail": smoke_.get("detail"),
            "signal": smoke_.get("signal"), "log_tail": smoke_.get("log_tail", [])[-5:]}


def _isa_reason(plan: BuildPlan, tried: list[dict[str, Any]], forced: str | None,
                pinned: bool) -> str:
    if forced:
        return f"--cpu-isa {forced} asked for it"
    left_out = planning.isa_order(pinned)[1]
    first = f"{left_out}; " if left_out else ""
    if len(tried) == 1:
        return f"{first}the {plan.cpu_isa} configuration's smoke test {tried[0]['smoke']}"
    failed = ", ".join(f"{t['cpu_isa']} ({t['detail']})" for t in tried[:-1])
    return f"{first}kept {plan.cpu_isa}: {failed} failed on this CPU"


# --------------------------------------------------------------------------- crash memory


def _crash_key(job: _Job, plan: BuildPlan) -> str:
    """A crash of the CPU kernels depends on the source, the options, the compiler and the CPU
    (planning.cache_key without patches: they change the server, not ggml's kernels). A PATH
    tree is named by its path, so its commit is part of the key too."""
    identity = job.identity
    if job.src is not None and job.src.kind == "path":
        identity += f"@{job.src.commit or ''}"
    return planning.cache_key(identity, plan.options, job.compiler)


def _crashes() -> dict[str, dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((paths.build_cache_dir() / CRASHES).read_text())
        if isinstance(data, dict):
            return data
    return {}


def _remember_crash(key: str, summary: dict[str, Any]) -> None:
    with _locked(paths.build_cache_dir() / f"{CRASHES}.lock"):
        data = _crashes()
        data[key] = summary
        write_json(paths.build_cache_dir() / CRASHES, data)


# --------------------------------------------------------------------------- one attempt


@dataclass
class _Job:
    """What every attempt of one `build()` shares."""

    source_spec: str | None
    allow_unpinned: bool
    identity: str
    why: str
    src: source.Source | None
    applied: list[patchset.Patch]
    patch_records: list[dict[str, Any]]
    compiler: str | None  #: the C++ compiler's version line (part of the cache key)
    jobs: int | None
    progress: ProgressFn | None
    force: bool
    say: NoteFn

    def resolved(self) -> source.Source:
        if self.src is None:
            self.src = source.resolve(self.source_spec, allow_unpinned=self.allow_unpinned)
            self.why = self.src.reason
        return self.src

    def key(self, plan: BuildPlan) -> str:
        return planning.cache_key(self.identity, plan.options, self.compiler,
                                  patchset.key_part(self.applied))


def _cached(job: _Job, build_dir: Path) -> Manifest | None:
    """The cache entry's manifest when it can be reused as it is (or topped up)."""
    mf = build_dir / MANIFEST
    if job.force or not mf.is_file() or (job.src is not None and job.src.kind == "path"):
        return None
    found = read(mf)
    if not binaries_ok(found):
        return None
    if found.capabilities is None:
        # Recorded by an older mtpwrap: parse --help once and keep it.
        found.capabilities = cmake.capabilities(Path(found.binaries["llama-server"]
                                                      ["cache_path"]))
    if found.webui is None and Path(str(found.source.get("path", ""))).is_dir():
        found.webui = planning.webui_options(Path(str(found.source["path"])))[1]
    return found


def _compile(job: _Job, plan: BuildPlan, key: str, build_dir: Path,
             earlier: Manifest | None) -> Manifest:
    """Compile `plan`; with `earlier` (a cached build lacking some TARGETS), only what is
    missing is compiled, and its smoke result stays when llama-server did not change."""
    src = job.resolved()  # a bad source is a configuration error, told before a missing tool
    cmake.preflight()
    tree = _patched_source(src, job.applied, build_dir, job.force)
    manifest = cmake.compile_plan(plan, tree, job.why, key, build_dir, job.compiler, job.jobs,
                                  job.progress, job.force)
    manifest.patches = job.patch_records
    rejected = (manifest.configure or {}).get("rejected") or {}
    if rejected:
        taken = "; ".join(f"{k}: {w}" for k, w in rejected.items())
        job.say(f"CMake did not take {taken} (log: {manifest.log})")
    if earlier is not None:
        added = sorted(set(manifest.binaries) - set(earlier.binaries))
        manifest.extra = {**earlier.extra, **manifest.extra,
                          "added_targets": {"targets": added,
                                            "seconds": manifest.build_seconds}}
        manifest.build_seconds = earlier.build_seconds
        same = (earlier.binaries["llama-server"]["sha256"]
                == manifest.binaries["llama-server"]["sha256"])
        if same:
            manifest.smoke, manifest.spec_depth = earlier.smoke, earlier.spec_depth
    return manifest


def _attempt(job: _Job, plan: BuildPlan) -> tuple[Manifest, bool]:
    """One CPU configuration: reuse or compile, then try it. (manifest, reused)."""
    key = job.key(plan)
    build_dir = paths.build_cache_dir() / f"{plan.variant}-{key}"
    with _locked(paths.build_cache_dir() / f"{plan.variant}-{key}.lock"):
        manifest = _cached(job, build_dir)
        reused = manifest is not None
        missing = manifest is not None and not set(TARGETS) <= set(manifest.binaries)
        if manifest is None or (missing and manifest.smoke_status != "crashed"):
            manifest = _compile(job, plan, key, build_dir, manifest)
            reused = False
        server = Path(manifest.binaries["llama-server"]["cache_path"])
        if manifest.smoke is None:
            # New, or cached by an mtpwrap that did not try its builds: try it now.
            if job.progress:
                job.progress(f"smoke test ({plan.cpu_isa})", None, None)
            manifest.smoke = _smoke_test(server, plan.variant, build_dir,
                                         manifest.architectures)
        if manifest.spec_depth is None and manifest.smoke_status == "passed":
            manifest.spec_depth = _spec_depth_probe(server, plan.variant, build_dir)
        manifest.cpu_isa = plan.cpu_isa
        write_json(build_dir / MANIFEST, manifest.to_dict())
    return manifest, reused


def _remembered(job: _Job, plan: BuildPlan) -> dict[str, Any] | None:
    """The attempt summary of a crash of this configuration remembered from another build of
    the same source, options, compiler and CPU (the patched or the unpatched one, or an earlier
    build of the same PATH tree at the same commit), unless this exact build has a reusable
    cache entry of its own."""
    own_entry = paths.build_cache_dir() / f"{plan.variant}-{job.key(plan)}" / MANIFEST
    path_tree = job.src is not None and job.src.kind == "path"
    if job.force or (own_entry.is_file() and not path_tree):
        return None
    seen = _crashes().get(_crash_key(job, plan))
    if seen is None:
        return None
    detail = (f"{seen.get('detail')} (remembered: the build in {seen.get('build_dir')} "
              "crashed on this CPU; --force tries it again)")
    return {**seen, "detail": detail}


# --------------------------------------------------------------------------- build


def _pinned(source_spec: str | None) -> bool:
    """Whether the build is of a pinned source (the submodule or the offline one), not a PATH."""
    return source_spec in (None, "", "auto", "offline", "submodule")


def _plans(cpu: bool, cuda_arch: str | None, cpu_isa: str | None, fork: bool,
           pinned: bool, fa_all_quants: bool = False) -> list[BuildPlan]:
    plans: list[BuildPlan] = []
    for isa in [cpu_isa] if cpu_isa else list(planning.isa_order(pinned)[0]):
        plan = planning.plan_build(cpu=cpu, cuda_arch=cuda_arch, cpu_isa=isa, fork=fork,
                                   fa_all_quants=fa_all_quants)
        if all(p.options != plan.options for p in plans):  # on Arm, safe == baseline
            plans.append(plan)
    return plans


def _job(source_spec: str | None, allow_unpinned: bool, no_patches: bool,
         skip_patches: tuple[str, ...], jobs: int | None, progress: ProgressFn | None,
         force: bool, note: NoteFn | None) -> _Job:
    # The offline source's identity is known before downloading, so a cached build is reused
    # without touching the network or the 76 MB archive.
    src: source.Source | None = None
    commit: str | None
    if source_spec in (None, "", "auto") and source.submodule_source() is None:
        identity, why = source.offline_identity(), "the submodule is not initialised"
        kind, commit = "offline", source.OFFLINE_COMMIT
    elif source_spec == "offline":
        identity, why = source.offline_identity(), "asked for with --source offline"
        kind, commit = "offline", source.OFFLINE_COMMIT
    else:
        src = source.resolve(source_spec, allow_unpinned=allow_unpinned)
        identity, why = src.identity, src.reason
        kind, commit = src.kind, src.commit
    applied, records = patchset.for_source(kind, commit, no_patches=no_patches,
                                           skip=skip_patches)
    return _Job(source_spec, allow_unpinned, identity, why, src, applied, records,
                toolchain.cxx_version(), jobs, progress, force, note or (lambda _msg: None))


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
    fa_all_quants: bool = False,
) -> tuple[Manifest, bool, str]:
    """Build (or reuse) llama-server, tried on this machine. Returns (manifest, reused, why).

    Each CPU configuration (planning.isa_order, or only `cpu_isa` when given) is its own cache
    entry. A new binary is started on a real model and asked for tokens; one that crashes is
    remembered as crashed (never installed, never reused; another build of the same source on
    this CPU skips that configuration) and the next configuration is built.

    The patch set (patchset) is applied unless `no_patches`; `skip_patches` opts out of some.
    `install=False` leaves build/<variant>/ as it is and returns the cache entry's manifest.
    `fa_all_quants`: a CUDA build compiles flash attention for every K/V type pair.
    """
    plans = _plans(cpu, cuda_arch, cpu_isa, planning.source_is_fork(source_spec),
                   _pinned(source_spec), fa_all_quants)
    job = _job(source_spec, allow_unpinned, no_patches, skip_patches, jobs, progress, force,
               note)
    tried: list[dict[str, Any]] = []
    for i, plan in enumerate(plans):
        seen = _remembered(job, plan) if cpu_isa is None and i + 1 < len(plans) else None
        if seen is not None:
            tried.append(seen)
            job.say(f"the {plan.cpu_isa} build crashed here before ({seen['build_dir']}); "
                    f"trying the {plans[i + 1].cpu_isa} configuration.")
            continue
        manifest, reused = _attempt(job, plan)
        summary = _attempt_summary(manifest)
        tried.append(summary)
        if manifest.trusted:
            manifest.attempts = tried
            why_isa = _isa_reason(plan, tried, cpu_isa, _pinned(source_spec))
            manifest.extra = {**manifest.extra, "isa_reason": why_isa}
            write_json(Path(manifest.build_dir) / MANIFEST, manifest.to_dict())
            if progress:
                progress("up to date" if reused else "built", 100.0, None)
            if not install:
                return manifest, reused, job.why
            return _install(manifest, paths.build_root() / plan.variant), reused, job.why
        _give_up_unless_crashed(manifest, reused)
        _remember_crash(_crash_key(job, plan), summary)
        if i + 1 < len(plans):
            job.say(f"{_failure(manifest, reused)}; trying the {plans[i + 1].cpu_isa} "
                    "configuration.")
    last = tried[-1]
    _uninstall_if(paths.build_root() / plans[-1].variant, {t["cache_key"] for t in tried})
    raise BuildError(
        "every CPU configuration tried crashed in its smoke test ("
        + "; ".join(f"{t['cpu_isa']}: {t['detail']}" for t in tried)
        + "). Nothing was installed.",
        hint=f"Build log: {Path(last['build_dir']) / 'build.log'}. Force one with --cpu-isa, "
        "or report the log lines above.",
    ).with_tail(last.get("log_tail", []))


def _failure(manifest: Manifest, reused: bool) -> str:
    smoke_ = manifest.smoke or {}
    what = f"the {manifest.cpu_isa} build " + ("crashed" if smoke_.get("status") == "crashed"
                                               else "failed") + f": {smoke_.get('detail')}"
    if reused:
        what += " (remembered from an earlier try; --force tries it again)"
    return what


def _give_up_unless_crashed(manifest: Manifest, reused: bool) -> None:
    """Only a crash says the instruction sets are wrong; anything else is not fixed by
    building again with fewer of them."""
    smoke_ = manifest.smoke or {}
    if smoke_.get("status") != "crashed":
        raise BuildError(
            f"{_failure(manifest, reused)}. The binary was not installed.",
            hint=f"Build log: {manifest.log}. Run `mtpwrap build --force` to try again.",
        ).with_tail(smoke_.get("log_tail", []))


def configure_only(
    source_spec: str | None = None,
    *,
    cpu: bool = False,
    cuda_arch: str | None = None,
    cpu_isa: str | None = None,
    allow_unpinned: bool = False,
) -> dict[str, Any]:
    """CMake's configure step alone, in the build's own cache folder: seconds, no compile.

    Returns (and writes to configure.json there) the plan, the argv and which options CMake
    took; a build with the same options later reuses the configured folder."""
    first = planning.isa_order(_pinned(source_spec))[0][0]
    plan = planning.plan_build(cpu=cpu, cuda_arch=cuda_arch, cpu_isa=cpu_isa or first,
                               fork=planning.source_is_fork(source_spec))
    src = source.resolve(source_spec, allow_unpinned=allow_unpinned)
    compiler = cmake.preflight()
    applied = patchset.for_source(src.kind, src.commit)[0]
    key = planning.cache_key(src.identity, plan.options, compiler, patchset.key_part(applied))
    build_dir = paths.build_cache_dir() / f"{plan.variant}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _locked(paths.build_cache_dir() / f"{plan.variant}-{key}.lock"):
        src = _patched_source(src, applied, build_dir, force=True)
        log = build_dir / "configure.log"
        log.write_text("")
        record = cmake.configure(plan, src, build_dir, log, progress=None, force=True)
    result = {"variant": plan.variant, "reason": plan.reason, "cpu_isa": plan.cpu_isa,
              "source": {**src.to_dict(), "why": src.reason},
              "cmake_options": record.pop("options"), "cuda": plan.cuda, "cache_key": key,
              "build_dir": str(build_dir), "log": str(log), **record}
    write_json(build_dir / "configure.json", result)
    return result


def ensure_built(variant: str = "cpu") -> Manifest:
    """The manifest of a build of this variant, building it (quietly) when there is none."""
    if variant != "cpu":
        found = load_manifest(variant)
        if found is None:
            raise MissingToolError(f"no {variant} build.", hint="Run `mtpwrap build`.")
        return found
    manifest, _, _ = build(cpu=True)
    return manifest
