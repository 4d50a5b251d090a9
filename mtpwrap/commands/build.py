"""`mtpwrap build`."""

from __future__ import annotations

import click


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
    help="CUDA compute capability, e.g. 89 (RTX 4090); default from the GPU (NVML).",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(1, 512),
    envvar="MTPWRAP_BUILD_JOBS",
    default=None,
    help="Parallel compile jobs (default: all cores).",
)
@click.option("--force", is_flag=True, help="Rebuild even when a cached build matches.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def command(
    source_spec: str | None,
    cpu: bool,
    cuda_arch: str | None,
    jobs: int | None,
    force: bool,
    as_json: bool,
) -> None:
    """Build llama-server and llama-fit-params with CMake for this machine.

    The result goes to build/<variant>/ (cpu or cuda-smNN) with a manifest.json recording the
    source, commit, options, compiler, binary sha256 and --version. A second run with nothing
    changed reuses the cached build in seconds.
    """
    from mtpwrap import build, console
    from mtpwrap.errors import BuildError

    with console.progress() as prog:
        task = prog.add_task("preparing", total=100)
        state = {"phase": "preparing"}

        def on_progress(phase: str, percent: float | None, line: str | None) -> None:
            if phase != state["phase"]:
                state["phase"] = phase
                prog.update(task, description=phase)
            if percent is not None:
                prog.update(task, completed=percent)

        try:
            manifest, reused, why = build.build(
                source_spec,
                cpu=cpu,
                cuda_arch=cuda_arch,
                jobs=jobs,
                progress=on_progress,
                force=force,
            )
        except BuildError as exc:
            prog.stop()
            for line in exc.tail:
                console.err.print(f"  [dim]{line}[/dim]", markup=True, highlight=False)
            raise
        prog.update(task, completed=100, description="up to date" if reused else "built")

    if as_json:
        console.print_json(manifest.to_dict())
        return
    src = manifest.source
    console.info(f"source: {src.get('kind')} — {src.get('location')} (commit {src.get('commit')})")
    console.info(f"why: {why}")
    console.info(f"variant: {manifest.variant} ({manifest.extra.get('plan_reason', '')})")
    for name, info in manifest.binaries.items():
        console.info(f"{name}: {info['path']}")
    console.info(f"manifest: {build.paths.build_root() / manifest.variant / build.MANIFEST}")
    if reused:
        console.info("nothing changed since the last build; reused it.")
    else:
        console.info(f"built in {manifest.build_seconds:.0f} s; log: {manifest.log}")
