"""Which installed llama-server a command runs, and whether a CUDA build has code for the GPUs here.

An explicit path or `MTPWRAP_BINARY` wins; otherwise the installed build (build/<variant>/),
a CUDA build before the CPU one, as long as it was compiled for every GPU NVML sees.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mtpwrap.build.manifest import Manifest, binaries_ok, installed_variants, load_manifest
from mtpwrap.build.planning import arch_number, present_gpus
from mtpwrap.errors import ConfigError, MissingToolError


def uncovered_gpus(manifest: Manifest, snap: Any | None = None) -> list[tuple[str, str]]:
    """The present GPUs, as (name, arch), that a CUDA build has no code for; [] for CPU builds.

    A build covers a GPU when it was compiled for that compute capability (89 covers an RTX
    4090's 8.9; "90a" covers 9.0)."""
    if not manifest.variant.startswith("cuda"):
        return []
    built = {str(arch_number(a)) for a in manifest.architectures if re.match(r"\d", a)}
    return [(name, arch) for name, arch in present_gpus(snap) if arch not in built]


def rebuild_command(manifest: Manifest, gaps: list[tuple[str, str]]) -> str:
    """The `mtpwrap build` that covers both what this build has and the GPUs it lacks."""
    archs = list(dict.fromkeys([*manifest.architectures, *(a for _, a in gaps)]))
    return f"mtpwrap build --cuda-arch {','.join(sorted(archs, key=arch_number))}"


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
    """An explicit path (`--binary`, or the `binary` setting and its MTPWRAP_BINARY, which the
    commands resolve), or the installed build's binary.

    An installed CUDA build must have code for every GPU NVML sees; otherwise another installed
    CUDA build that has is used, or the command that builds one is named."""
    candidate = explicit
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
                  and binaries_ok(m) and not uncovered_gpus(m, snap)]
        if not others:
            raise MissingToolError(problem)
        manifest = others[0]
    return manifest.binary(name)
