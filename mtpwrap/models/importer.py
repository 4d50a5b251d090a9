"""`models import`: model files carried to a site without internet (a USB disk, a share).

Each file is verified against a `SHA256SUMS` file (given, or beside it) or the JSON record
`models pull` wrote beside it on the connected machine; a file with neither is refused. A copy is
hashed while it is written; a hard link (`--link`) is hashed once made. Either way the file sits
under a hidden temporary name until its digest matched, and the parts of a split model get their
names only when every part has.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from mtpwrap import paths
from mtpwrap.decide.gguf_facts import SPLIT
from mtpwrap.errors import ConfigError, IntegrityError, RuntimeFailure
from mtpwrap.hashing import sha256_file
from mtpwrap.models.pull import record_path, recorded

SUMS = "SHA256SUMS"


@dataclass(frozen=True)
class Expected:
    sha256: str
    source: str  # what said so: a SHA256SUMS path or a record's path
    record: dict[str, object] | None = None


def read_sums(path: Path) -> dict[str, str]:
    """name → sha256 from a `sha256sum` listing (`HEX  NAME` or `HEX *NAME`)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}).") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64 or not all(
                c in "0123456789abcdefABCDEF" for c in parts[0]):
            raise ConfigError(f"{path}:{n}: not a sha256sum line (expected `HEX  NAME`).")
        out[Path(parts[1].strip().lstrip("*")).name] = parts[0].lower()
    return out


def expected_for(src: Path, sums: Path | None) -> Expected:
    """The digest `src` must have: from `--sums`, else a SHA256SUMS beside it that lists it,
    else the record `models pull` wrote beside it."""
    if sums is not None:
        if not sums.is_file():
            raise ConfigError(f"--sums {sums}: no such file.")
        digest = read_sums(sums).get(src.name)
        if digest is None:
            raise ConfigError(f"--sums {sums} lists no {src.name}.",
                              hint="Give the SHA256SUMS that came with the file.")
        return Expected(digest, str(sums))
    beside = src.parent / SUMS
    if beside.is_file() and (digest := read_sums(beside).get(src.name)):
        return Expected(digest, str(beside))
    rec = record_path(src)
    if rec.is_file():
        try:
            data = json.loads(rec.read_text())
            return Expected(str(data["sha256"]), str(rec), data)
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{rec}: not a record `models pull` wrote (no sha256).") from None
    raise ConfigError(f"{src}: nothing to verify it by ({SUMS} beside it does not list it, and "
                      f"there is no {rec.name}).",
                      hint="Give --sums FILE, or carry the .json record `models pull` wrote "
                           "beside the file.")


def with_split_parts(sources: Sequence[Path]) -> list[Path]:
    """The files given, each part of a split model completed by its sibling parts."""
    out: list[Path] = []
    for src in sources:
        m = SPLIT.match(src.name)
        group = [src]
        if m:
            n = int(m["n"])
            group = [src.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
            missing = [p.name for p in group if not p.is_file()]
            if missing:
                raise ConfigError(f"{src}: the split model lacks {', '.join(missing)} beside it.",
                                  hint="Carry every part of the model.")
        out += [p for p in group if p not in out]
    return out


def _copy_hashing(src: Path, tmp: Path) -> str:
    h = hashlib.sha256()
    with src.open("rb") as fin, tmp.open("wb") as fout:
        while block := fin.read(1 << 20):
            h.update(block)
            fout.write(block)
    return h.hexdigest()


def _place(src: Path, tmp: Path, link: bool) -> str:
    if link:
        try:
            os.link(src, tmp)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise ConfigError(f"--link: {src} is on another filesystem than {tmp.parent}; "
                                  "a hard link cannot cross filesystems.",
                                  hint="Drop --link to copy it.") from None
            raise
        return sha256_file(tmp)
    return _copy_hashing(src, tmp)


def stage(src: Path, dest: Path, exp: Expected, *, link: bool) -> Path:
    """`src` under a hidden name in `dest`, verified; removed again when it does not match."""
    tmp = paths.private_tmp(dest / src.name)
    tmp.unlink(missing_ok=True)
    try:
        actual = _place(src, tmp, link)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise RuntimeFailure(f"no space left in {dest} while copying {src.name}; nothing "
                                 "was kept.", hint="Free space, or give --dir elsewhere.") \
                from None
        raise RuntimeFailure(f"{src}: cannot {'link' if link else 'copy'} it into {dest} "
                             f"({exc.strerror}).") from None
    if actual != exp.sha256:
        tmp.unlink(missing_ok=True)
        raise IntegrityError(f"{src}: sha256 is {actual}, {exp.source} says {exp.sha256}; "
                             "it was not imported.",
                             hint="The copy is damaged or not the file that was listed; carry "
                                  "it again.")
    return tmp


def import_files(sources: Sequence[Path], *, dest: Path | None = None, sums: Path | None = None,
                 link: bool = False) -> list[Path]:
    """Verify and place each file (and the rest of a split set) into `dest`."""
    dest = dest or paths.models_dir()
    for src in sources:
        if not src.is_file():
            raise ConfigError(f"models import {src}: no such file.")
    files = with_split_parts(sources)
    wanted = [(src, expected_for(src, sums)) for src in files]
    dest.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Expected, Path]] = []
    try:
        for src, exp in wanted:
            final = dest / src.name
            if final.resolve() == src.resolve():
                raise ConfigError(f"models import {src}: the file is in {dest} already.")
            if recorded(final) == (exp.sha256, src.stat().st_size):
                continue  # imported before, with the same digest
            staged.append((src, exp, stage(src, dest, exp, link=link)))
    except BaseException:
        for _, _, tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    for src, exp, tmp in staged:
        final = dest / src.name
        rec = dict(exp.record or {})
        if "time" in rec:
            rec["pulled_time"] = rec.pop("time")
        rec.update({"sha256": exp.sha256, "size": src.stat().st_size,
                    "imported_from": str(src), "verified_by": exp.source,
                    "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        paths.replace_text(record_path(final), json.dumps(rec, indent=2) + "\n")
        os.replace(tmp, final)
    return [dest / src.name for src, _ in wanted]
