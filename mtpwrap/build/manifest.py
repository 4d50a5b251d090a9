"""What a build recorded about itself (`manifest.json`), and the builds installed here.

Each cache entry (`~/.cache/mtpwrap/builds/<variant>-<key>/`) and each installed variant
(`build/<variant>/`) holds one manifest: the source, CMake options, binaries with their sha256,
the smoke test, the patches, the capabilities parsed from --help.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.errors import MissingToolError

MANIFEST = "manifest.json"


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
    #: the llama.cpp patches (patchset.Patch.record): name, sha256, applied | opted-out |
    #: not-for-source, why, and what a build without it lacks
    patches: list[dict[str, Any]] | None = None
    #: whether the binary honours a request's own `speculative.n_max` (spec_probe.probe)
    spec_depth: dict[str, Any] | None = None
    #: whether llama-server serves its own web UI: {"in_binary": bool | None, "why": str}
    #: (planning.webui_options)
    webui: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

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

    def lacks(self) -> tuple[str, ...]:
        """One sentence per patch that is not for this build's source: what the build lacks."""
        return tuple(f"{r['name']} is not for this source ({r.get('why')}): "
                     f"{r.get('without') or 'its change is missing'}"
                     for r in self.patches or [] if r.get("status") == "not-for-source")

    @property
    def trusted(self) -> bool:
        """Tried on this machine and answered (or could not be tried here: no GPU)."""
        return self.smoke_status in ("passed", "skipped")


def write_json(path: Path, data: dict[str, Any]) -> None:
    paths.replace_text(path, json.dumps(data, indent=2) + "\n")


def read(path: Path) -> Manifest:
    return Manifest.from_dict(json.loads(path.read_text()))


def binaries_ok(manifest: Manifest) -> bool:
    """Every binary the manifest names is still in the build cache."""
    for info in manifest.binaries.values():
        p = Path(info.get("cache_path", info["path"]))
        if not p.is_file():
            return False
    return True


def installed_variants() -> list[Manifest]:
    root = paths.build_root()
    found: list[Manifest] = []
    if root.is_dir():
        for mf in sorted(root.glob(f"*/{MANIFEST}")):
            try:
                found.append(read(mf))
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
        if binaries_ok(m) and all(Path(b["path"]).is_file() for b in m.binaries.values()):
            return m
    return None


def update_manifest(manifest: Manifest, **extra: Any) -> Manifest:
    """Store extra facts (e.g. measured KV type sizes) in both copies of a manifest."""
    merged = Manifest.from_dict({**manifest.to_dict(), "extra": {**manifest.extra, **extra}})
    write_json(Path(manifest.build_dir) / MANIFEST, merged.to_dict())
    variant_file = paths.build_root() / manifest.variant / MANIFEST
    if variant_file.is_file():
        write_json(variant_file, merged.to_dict())
    return merged
