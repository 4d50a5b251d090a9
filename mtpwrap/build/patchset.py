"""The llama.cpp patches mtpwrap carries: one file per purpose under `patches/llama.cpp/`.

Each patch is a unified diff (`a/`, `b/` prefixes, against the llama.cpp root) preceded by a
`# ` header saying why it exists, what upstream code it touches and when to drop it, with two
entries the build reads: `# For:` the sources it is written for (`offline@0c1e570`: the
offline source at that commit; several separated by spaces; none: every pinned source) and
`# Without it:` what a build of a source it is not for lacks (said by `build`, `doctor` and
/healthz). A build
applies them, in file-name order, to an overlay of the source in its own build folder (hard
links to the shared tree, with the files a patch touches copied), never to the shared tree
itself. The patch set's names and the sha256 of their diffs are part of the build's cache key,
and the manifest records each patch as applied, opted out or not for this source.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths, proc
from mtpwrap.errors import BuildError, ConfigError, MissingToolError

_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)


def patch_dir() -> Path:
    """`patches/llama.cpp` of the checkout, or the copy shipped inside the installed package."""
    for base in (paths.repo_root() / "patches", Path(__file__).resolve().parent.parent / "patches"):
        if (base / "llama.cpp").is_dir():
            return base / "llama.cpp"
    return paths.repo_root() / "patches" / "llama.cpp"


@dataclass(frozen=True)
class Patch:
    name: str  # file name without .patch: "0001-per-request-speculative"
    path: Path
    sha256: str  # of the whole file
    files: tuple[str, ...]  # the llama.cpp files it changes
    summary: str  # the header's first line
    #: the sources it is written for, from the header's `# For:` line: "KIND" or
    #: "KIND@COMMIT-PREFIX" (offline, submodule); empty: every pinned source
    sources: tuple[str, ...] = ()
    #: what a build without it lacks, from the header's `# Without it:` line
    without: str = ""
    diff_sha256: str = ""  # of the diff alone: the cache key's part (the header is prose)

    def meant_for(self, kind: str, commit: str | None) -> bool:
        """Whether this patch is written for a source of `kind` at `commit`."""
        if not self.sources:
            return True
        for entry in self.sources:
            want_kind, _, want_commit = entry.partition("@")
            if want_kind == kind and (not want_commit
                                      or (commit or "").startswith(want_commit)):
                return True
        return False

    def record(self, status: str, why: str | None = None) -> dict[str, Any]:
        """What the manifest says about this patch; status: applied | opted-out |
        not-for-source (`why` says which source it is for and what the build lacks)."""
        return {"name": self.name, "sha256": self.sha256, "status": status,
                "files": list(self.files), "summary": self.summary, "why": why,
                "for": list(self.sources), "without": self.without or None}


def _header_value(header: list[str], key: str) -> str:
    """A `# Key: value` header entry, continued on the lines indented under it."""
    out: list[str] = []
    for line in header:
        if out:
            if line.startswith("  ") and line.strip():
                out.append(line.strip())
                continue
            break
        if line.startswith(key + ":"):
            out.append(line[len(key) + 1:].strip())
    return " ".join(out)


def _load(path: Path) -> Patch:
    text = path.read_text(errors="replace")
    raw = [ln[2:].rstrip() for ln in text.splitlines() if ln.startswith("# ")]
    summary = raw[0].strip() if raw else path.stem
    start = re.search(r"^(diff |--- )", text, re.M)
    diff = text[start.start():] if start else text
    return Patch(path.stem, path, hashing.sha256_file(path), tuple(_FILE.findall(text)), summary,
                 tuple(_header_value(raw, "For").split()), _header_value(raw, "Without it"),
                 hashlib.sha256(diff.encode()).hexdigest())


def available(directory: Path | None = None) -> list[Patch]:
    """Every patch of the set, in the order they are applied."""
    d = directory or patch_dir()
    return [_load(p) for p in sorted(d.glob("*.patch"))] if d.is_dir() else []


def select(no_patches: bool = False, skip: Sequence[str] = (),
           directory: Path | None = None) -> tuple[list[Patch], list[Patch]]:
    """(to apply, opted out). `skip` names patches by file name, with or without .patch, or by
    their number prefix ("0001")."""
    every = available(directory)
    wanted: set[str] = set()
    for name in skip:
        stem = name.removesuffix(".patch")
        hits = [p.name for p in every if p.name == stem or p.name.split("-", 1)[0] == stem]
        if not hits:
            known = ", ".join(p.name for p in every) or "none"
            raise ConfigError(f"--skip-patch {name}: no such patch in {patch_dir()} "
                              f"(known: {known}).", hint="Name one of the known patches.")
        wanted.update(hits)
    if no_patches:
        return [], every
    return ([p for p in every if p.name not in wanted], [p for p in every if p.name in wanted])


def for_source(kind: str, commit: str | None, *, no_patches: bool = False,
               skip: Sequence[str] = (), directory: Path | None = None
               ) -> tuple[list[Patch], list[dict[str, Any]]]:
    """The one decision of which patches a build applies: (to apply, the manifest's records
    of every patch). A `path` source is built as it is; a patch written for another source is
    recorded `not-for-source` with why, never tried; --no-patches / --skip-patch opt out."""
    own_tree = kind not in ("offline", "submodule")
    applied, opted_out = select(no_patches or own_tree, skip, directory)
    why_out = ("a --source PATH tree is built as it is" if own_tree
               else "--no-patches" if no_patches else "--skip-patch")
    here = f"{kind} at {commit[:12]}" if commit else kind
    kept: list[Patch] = []
    records: list[dict[str, Any]] = []
    for p in sorted([*applied, *opted_out], key=lambda p: p.name):  # the set's own order
        if p in opted_out:
            records.append(p.record("opted-out", why_out))
        elif p.meant_for(kind, commit):
            kept.append(p)
            records.append(p.record("applied"))
        else:
            records.append(p.record("not-for-source", f"written for {', '.join(p.sources)}; "
                                    f"this build's source is the {here}"))
    return kept, records


def key_part(applied: Sequence[Patch]) -> list[list[str]]:
    """What the cache key holds about the applied patches."""
    return [[p.name, p.diff_sha256] for p in applied]


def _hunk_failures(output: str) -> list[str]:
    """`patch`'s report as "FILE hunk #N" items, for the one-sentence error."""
    failures: list[str] = []
    current = "?"
    for line in output.splitlines():
        m = (re.match(r"^(?:patching|checking) file (.+)$", line)
             or re.match(r"^\|\+\+\+ b/(\S+)", line))
        if m:
            current = m.group(1).strip()
            continue
        m = re.match(r"^Hunk #(\d+) FAILED", line)
        if m:
            failures.append(f"{current} hunk #{m.group(1)}")
            continue
        if "can't find file to patch" in line:
            failures.append(f"{current} (file not found)")
    return failures


def _patch_tool() -> str:
    tool = shutil.which("patch")
    if tool is None:
        raise MissingToolError("the `patch` tool is not installed, so the llama.cpp patch set "
                               "cannot be applied.",
                               hint="Install it (`apt-get install patch`), or build with "
                               "--no-patches.")
    return tool


def check(patch: Patch, tree: Path) -> None:
    """Raise BuildError naming the file and hunk when `patch` does not apply to `tree`."""
    done = proc.run([_patch_tool(), "-p1", "--dry-run", "--forward", "--batch",
                     "-d", str(tree), "-i", str(patch.path)], timeout=120)
    if done.returncode != 0:
        out = done.stdout + done.stderr
        lines = out.strip().splitlines()
        last = lines[-1] if lines else f"exit {done.returncode}"
        shown = "; ".join(_hunk_failures(out)) or last
        raise BuildError(
            f"patch {patch.name} does not apply to {tree}: {shown}.",
            hint=f"Update {patch.path} for this source, or build without it "
            f"(--skip-patch {patch.name.split('-', 1)[0]}, or --no-patches).",
        ).with_tail(out.splitlines()[-20:])


def overlay(tree: Path, dest: Path, applied: Sequence[Patch]) -> Path:
    """`tree` with `applied` patched in, at `dest`: hard links to `tree`, except the files a
    patch changes, which are copies. The shared tree is never written to."""
    for patch in applied:
        check(patch, tree)  # all of them are checked against the pristine tree first
    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(tree, staging, symlinks=True, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(".git"))
        _point_at_git(tree, staging)
        for rel in {f for p in applied for f in p.files}:
            target = staging / rel
            if target.is_file():
                tmp = target.with_name(target.name + ".mtpwrap-copy")
                shutil.copy2(target, tmp)
                os.replace(tmp, target)  # a new inode: the shared tree's file stays as it was
        for patch in applied:
            done = proc.run([_patch_tool(), "-p1", "--forward", "--batch", "-s",
                             "--no-backup-if-mismatch", "-d", str(staging),
                             "-i", str(patch.path)], timeout=120)
            if done.returncode != 0:
                out = done.stdout + done.stderr
                raise BuildError(f"patch {patch.name} failed on the overlay of {tree}: "
                                 f"{'; '.join(_hunk_failures(out)) or 'see the output'}.",
                                 ).with_tail(out.splitlines()[-20:])
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _point_at_git(tree: Path, staging: Path) -> None:
    """llama.cpp stamps its binaries with `git rev-parse HEAD` of the source tree (--version,
    the commit mtpwrap shows): the overlay names the tree's own git directory, absolutely, so
    the patched binary says which commit it was built from. Nothing is written there."""
    dot = tree / ".git"
    gitdir: Path | None = None
    if dot.is_dir():
        gitdir = dot
    elif dot.is_file():
        text = dot.read_text(errors="replace").strip()
        if text.startswith("gitdir:"):
            gitdir = (tree / text.removeprefix("gitdir:").strip()).resolve()
    if gitdir is not None and gitdir.is_dir():
        (staging / ".git").write_text(f"gitdir: {gitdir}\n")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
