"""Carry a build to another machine: pack an installed build's binaries and manifest into one
xz archive, and install such an archive after checking its source and GPU coverage."""

from __future__ import annotations

import io
import json
import lzma
import os
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths
from mtpwrap.build import source
from mtpwrap.build.binary import coverage_problem
from mtpwrap.build.manifest import MANIFEST, Manifest, write_json
from mtpwrap.errors import ConfigError

#: xz dictionary for --pack: more than one statically linked CUDA binary (81 MB for sm_89).
PACK_DICT_BYTES = 128 << 20


def pack_prebuilt(manifest: Manifest, dest: Path) -> Path:
    """An installed build's binaries and manifest.json as one xz archive, to carry to a machine
    that should not spend its time compiling (see `install_prebuilt`)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.private_tmp(dest)
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


def install_prebuilt(archive: str | Path, snap: Any | None = None,
                     root: Path | None = None) -> Manifest:
    """Install a carried build (`pack_prebuilt`) into build/<variant>/ (or `root`/<variant>/)
    after checking that it was built from the pinned source and has code for the GPUs present;
    raises ConfigError if not."""
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
        pinned = source.pin_identity(kind)
        if pinned is None or identity != pinned:
            raise ConfigError(
                f"prebuilt {path}: built from {kind} source {identity}, but the pin is "
                f"{pinned or 'the submodule or the offline source'}.",
                hint="Make it again from this checkout with `mtpwrap build --pack FILE`.")
        problem = coverage_problem(manifest, snap)
        if problem is not None:
            raise ConfigError(f"prebuilt {path}: {problem}")
        bin_dir = (root or paths.build_root()) / manifest.variant / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        binaries: dict[str, dict[str, str]] = {}
        for name, info in manifest.binaries.items():
            src_fh = tar.extractfile(f"bin/{name}")
            if src_fh is None:
                raise ConfigError(f"prebuilt {path}: bin/{name} is missing.")
            dst = bin_dir / name
            tmp = paths.private_tmp(dst)
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
    write_json(bin_dir.parent / MANIFEST, installed.to_dict())
    return installed
