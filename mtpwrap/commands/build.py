"""`mtpwrap build`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from mtpwrap.units import MiB

if TYPE_CHECKING:
    from mtpwrap.build.manifest import Manifest


@click.command("build")
@click.option(
    "--source",
    "source_spec",
    envvar="MTPWRAP_SOURCE",
    default=None,
    help="submodule, offline, or a PATH to a llama.cpp tree (default: submodule if "
    "initialised, else offline).",
)
@click.option("--cpu", is_flag=True, envvar="MTPWRAP_BUILD_CPU", help="Build for the CPU only.")
@click.option(
    "--cuda-arch",
    envvar="MTPWRAP_CUDA_ARCH",
    default=None,
    help="CUDA compute capabilities, comma-separated: 89 (RTX 4090), 89,90 (and H100); "
    "default: the GPUs NVML sees.",
)
@click.option(
    "--cpu-isa",
    type=click.Choice(["native", "safe", "baseline"]),
    envvar="MTPWRAP_CPU_ISA",
    default=None,
    help="How to compile the CPU backend: native (GGML_NATIVE), safe (this CPU's instruction "
    "sets named one by one, AMX off) or baseline (AVX2). Default: native, then safe, then "
    "baseline, keeping the first that passes its smoke test (on a CPU with AMX the pinned "
    "sources start at safe).",
)
@click.option(
    "--allow-unpinned",
    is_flag=True,
    envvar="MTPWRAP_ALLOW_UNPINNED",
    help="Build the submodule even when it is not at the pinned fork commit.",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(1, 512),
    envvar="MTPWRAP_BUILD_JOBS",
    default=None,
    help="Parallel compile jobs (default: all cores).",
)
@click.option("--force", is_flag=True, help="Rebuild (and re-try) even when a cached build "
              "matches.")
@click.option("--configure-only", is_flag=True, help="Run CMake's configure step only (seconds) "
              "and print the options CMake took; exit 1 when it did not take one of them.")
@click.option("--log-objects", is_flag=True, envvar="MTPWRAP_BUILD_LOG_OBJECTS",
              help="On a pipe, print one line per compiled object instead of one every 10 %.")
@click.option("--pack", "pack", type=click.Path(dir_okay=False), default=None,
              help="Also write the build's binaries and manifest to this .tar.xz, to carry to "
              "a machine that should not compile (benchmarks/gpu_check.sh installs it).")
@click.option("--from-prebuilt", "prebuilt", type=click.Path(dir_okay=False), default=None,
              help="Install a carried --pack archive instead of compiling, after checking it "
              "is of the source pin and has code for the GPUs present.")
@click.option("--no-patches", is_flag=True, help="Build the source as it is, without mtpwrap's "
              "llama.cpp patch set (patches/llama.cpp).")
@click.option("--skip-patch", "skip_patches", multiple=True, metavar="NAME",
              help="Leave out one patch of the set (by file name or number, e.g. 0001); "
              "repeatable.")
@click.option("--fa-all-quants", is_flag=True, help="CUDA: compile flash attention for every "
              "K/V type pair (GGML_CUDA_FA_ALL_QUANTS), which the fork's planar/iso KV types "
              "need; tbq4_0 does not. Several times the CUDA compile.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def command(
    source_spec: str | None,
    cpu: bool,
    cuda_arch: str | None,
    cpu_isa: str | None,
    allow_unpinned: bool,
    jobs: int | None,
    force: bool,
    configure_only: bool,
    log_objects: bool,
    pack: str | None,
    prebuilt: str | None,
    no_patches: bool,
    skip_patches: tuple[str, ...],
    fa_all_quants: bool,
    as_json: bool,
) -> None:
    """Build llama-server and llama-fit-params with CMake for this machine, and try them.

    Each new binary is started on a real model (the demo model when cached, else a tiny one)
    and asked for a few tokens; one that crashes is never installed, and the next CPU
    configuration is built. The result goes to build/<variant>/ (cpu or cuda-smNN) with a
    manifest.json recording the source, commit, options, compiler, binary sha256, --version
    and the smoke test. A second run with nothing changed reuses the cached build in seconds.
    """
    from mtpwrap import console
    from mtpwrap.build import builder
    from mtpwrap.build.prebuilt import install_prebuilt, pack_prebuilt
    from mtpwrap.errors import BuildError, ConfigError

    if sum(map(bool, (configure_only, pack, prebuilt))) > 1:
        raise ConfigError("--configure-only, --pack and --from-prebuilt exclude each other: "
                          "give one of them.")
    if configure_only:
        _configure_only(source_spec, cpu, cuda_arch, cpu_isa, allow_unpinned, as_json)
        return
    if prebuilt:
        installed = install_prebuilt(prebuilt)
        if as_json:
            console.print_json(installed.to_dict())
        else:
            console.info(f"installed the carried {installed.variant} build (commit "
                         f"{installed.commit}): {installed.binary('llama-server')}")
        return
    with _Reporter(log_objects) as rep:
        try:
            manifest, reused, why = builder.build(
                source_spec, cpu=cpu, cuda_arch=cuda_arch, jobs=jobs, progress=rep.progress,
                force=force, cpu_isa=cpu_isa, allow_unpinned=allow_unpinned, note=rep.note,
                no_patches=no_patches, skip_patches=skip_patches, fa_all_quants=fa_all_quants)
        except BuildError as exc:
            rep.stop()
            for line in exc.tail:
                console.err.print(f"  [dim]{line}[/dim]", markup=True, highlight=False)
            raise
        rep.done("up to date" if reused else "built")
        kv_note = _calibrate(manifest.variant)
    if pack:
        from pathlib import Path

        packed = pack_prebuilt(manifest, Path(pack))
        console.info(f"packed {manifest.variant} into {packed} "
                     f"({packed.stat().st_size / MiB:.0f} MiB)")

    if as_json:
        console.print_json(manifest.to_dict())
        return
    _summary(manifest, reused, why, kv_note)


def _summary(manifest: Manifest, reused: bool, why: str, kv_note: str) -> None:
    """What `build` says after a build or a reuse: source, variant, smoke, patches, binaries."""
    from mtpwrap import console, paths
    from mtpwrap.build import manifest as build_manifest

    src = manifest.source
    console.info(f"source: {src.get('kind')} — {src.get('location')} (commit {src.get('commit')})")
    console.info(f"why: {why}")
    console.info(f"variant: {manifest.variant} ({manifest.extra.get('plan_reason', '')})")
    console.info(f"CPU configuration: {manifest.cpu_isa} — {manifest.extra.get('isa_reason', '')}")
    smoke = manifest.smoke or {}
    console.info(f"smoke test: {smoke.get('status')} — {smoke.get('detail')}")
    for rec in manifest.patches or []:
        if rec["status"] != "not-for-source":
            console.info(f"patch {rec['name']}: {rec['status']}")
    for sentence in manifest.lacks():
        console.info(f"patch {sentence}")
    depth = manifest.spec_depth or {}
    if depth:
        console.info(f"per-request draft depth: {depth.get('status')} — {depth.get('detail')}")
    for name, info in manifest.binaries.items():
        console.info(f"{name}: {info['path']}")
    console.info(f"manifest: {paths.build_root() / manifest.variant / build_manifest.MANIFEST}")
    console.info(kv_note)
    if reused:
        console.info("nothing changed since the last build; reused it.")
    elif "added_targets" in manifest.extra and manifest.extra["added_targets"]["targets"]:
        added = manifest.extra["added_targets"]
        console.info(f"added {', '.join(added['targets'])} to the cached build in "
                     f"{added['seconds']:.0f} s; log: {manifest.log}")
    else:
        console.info(f"built in {manifest.build_seconds:.0f} s; log: {manifest.log}")


def _configure_only(source_spec: str | None, cpu: bool, cuda_arch: str | None,
                    cpu_isa: str | None, allow_unpinned: bool, as_json: bool) -> None:
    """`--configure-only`: CMake's configure step, then the options it took, one per line."""
    from mtpwrap import console
    from mtpwrap.build import builder
    from mtpwrap.errors import BuildError

    try:
        result = builder.configure_only(source_spec, cpu=cpu, cuda_arch=cuda_arch, cpu_isa=cpu_isa,
                                      allow_unpinned=allow_unpinned)
    except BuildError as exc:
        for line in exc.tail:
            console.err.print(f"  [dim]{line}[/dim]", markup=True, highlight=False)
        raise
    if as_json:
        console.print_json(result)
    else:
        console.info(f"variant: {result['variant']} ({result['reason']}); configured in "
                     f"{result['seconds']:.0f} s; log: {result['log']}")
        for name, value in result["accepted"].items():
            console.out.print(f"{name}={value}", markup=False, highlight=False)
    rejected = result["rejected"]
    if rejected:
        raise BuildError(
            "CMake did not take " + "; ".join(f"{k} ({why})" for k, why in rejected.items())
            + ".", hint=f"Configure log: {result['log']}")


class _Reporter:
    """Build progress for a person: a rich bar on a terminal; on a pipe (a CI log, journald,
    `make up > log`) one line per phase and one every 10 % of the compile, or with `objects`
    one per compiled object."""

    def __init__(self, objects: bool = False) -> None:
        from mtpwrap import console

        self.console = console
        self.objects = objects
        self.tty = console.err.is_terminal
        self.phase = "preparing"
        self.last_decile = -1
        self.prog: Any = None
        self.task: Any = None

    def __enter__(self) -> _Reporter:
        if self.tty:
            self.prog = self.console.progress()
            self.prog.__enter__()
            self.task = self.prog.add_task(self.phase, total=100)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.prog is not None:
            self.prog.__exit__(None, None, None)
            self.prog = None

    def _line(self, text: str) -> None:
        import time

        self.console.info(f"{time.strftime('%H:%M:%S')} build: {text}")

    def progress(self, phase: str, percent: float | None, line: str | None) -> None:
        if phase != self.phase:
            self.phase = phase
            self.last_decile = -1
            if self.prog is not None:
                self.prog.update(self.task, description=phase, completed=0)
            else:
                self._line(phase)
        if percent is None:
            return
        if self.prog is not None:
            self.prog.update(self.task, completed=percent)
        elif self.objects:
            if line and " object " in line:
                self._line(line.strip())
        elif int(percent) // 10 > self.last_decile:
            self.last_decile = int(percent) // 10
            if 0 < percent < 100:
                self._line(f"{phase}: {percent:.0f} %")

    def note(self, message: str) -> None:
        if self.prog is not None:
            self.prog.console.print(message)
        else:
            self._line(message)

    def done(self, description: str) -> None:
        if self.prog is not None:
            self.prog.update(self.task, completed=100, description=description)
        elif self.phase != description:
            self._line(description)


def _calibrate(variant: str) -> str:
    """Size each KV cache type from what this binary allocates (fork types have no standard)."""
    from mtpwrap.build import calibrate
    from mtpwrap.decide import kv
    from mtpwrap.errors import MtpwrapError

    try:
        sizes = calibrate.calibrate_build(variant)
    except MtpwrapError as exc:
        return f"KV type sizes: not measured ({exc.message}); the built-in table is used."
    said = [f"KV type sizes measured from the binary: {', '.join(sorted(sizes))}"]
    return "\n".join(said + kv.differences(sizes))
