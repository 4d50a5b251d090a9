"""Where the llama.cpp source comes from.

Three kinds, chosen in this order when nothing is asked for:
1. `submodule`: `vendor/llama.cpp-mtp`, the MTP + TurboQuant fork pinned by the superproject;
2. `offline`: upstream llama.cpp inside the `llama-cpp-python` source distribution, fetched
   through the package index (reachable where GitHub is not) and checked against a pinned sha256;
3. a local `PATH` to any llama.cpp tree, only when asked for.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mtpwrap import paths, proc
from mtpwrap.errors import ConfigError, IntegrityError
from mtpwrap.models import fetch

SUBMODULE_PATH = "vendor/llama.cpp-mtp"
SUBMODULE_URL = "https://github.com/Indras-Mirror/llama.cpp-mtp.git"
#: The pin as shipped; a git checkout's own gitlink says it (pinned_commit), and a test keeps
#: the two equal.
SUBMODULE_COMMIT = "0bc0a270d43e6e0ed6b30386d278e45b6dc6dd9f"

OFFLINE_PACKAGE = "llama-cpp-python"
OFFLINE_VERSION = "0.3.36"
OFFLINE_SDIST = f"llama_cpp_python-{OFFLINE_VERSION}.tar.gz"
OFFLINE_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
OFFLINE_COMMIT = "0c1e570"
OFFLINE_SUBDIR = f"llama_cpp_python-{OFFLINE_VERSION}/vendor/llama.cpp"

#: written last into an unpacked tree, holding what it was unpacked from: a tree without it is
#: an interrupted extraction
_DONE_MARKER = ".mtpwrap-extracted"


@dataclass(frozen=True)
class Source:
    kind: str  # "submodule" | "offline" | "path"
    path: Path  # the llama.cpp tree (holds CMakeLists.txt)
    commit: str | None
    identity: str  # what the build cache is keyed by
    location: str  # where it came from, for people
    reason: str  # why this source was used
    pinned: bool = True  # the submodule holds the superproject's pinned commit

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _git(path: Path, *args: str) -> str | None:
    if shutil.which("git") is None:
        return None
    try:
        out = proc.run(["git", "-C", str(path), *args], timeout=30)
    except proc.ProcError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def pinned_commit(root: Path | None = None) -> str:
    """The fork commit the checkout pins: its gitlink for the submodule (`git ls-files -s`),
    else SUBMODULE_COMMIT (an install that is not a git checkout)."""
    out = _git(root or paths.repo_root(), "ls-files", "-s", "--", SUBMODULE_PATH) or ""
    parts = out.split()
    if len(parts) >= 2 and parts[0] == "160000":
        return parts[1]
    return SUBMODULE_COMMIT


def _is_llama_tree(path: Path) -> bool:
    return (path / "CMakeLists.txt").is_file()


def submodule_source(root: Path | None = None) -> Source | None:
    """The initialised submodule, or None when it is empty (it cannot be cloned offline)."""
    tree = (root or paths.repo_root()) / SUBMODULE_PATH
    if not _is_llama_tree(tree):
        return None
    commit = _git(tree, "rev-parse", "HEAD")
    dirty = bool(_git(tree, "status", "--porcelain", "--untracked-files=no"))
    identity = f"submodule:{commit or 'unknown'}{'+dirty' if dirty else ''}"
    pinned = commit == pinned_commit(root)
    return Source(
        kind="submodule",
        path=tree,
        commit=commit,
        identity=identity,
        location=f"{SUBMODULE_PATH} ({SUBMODULE_URL})",
        reason="the submodule is initialised" + ("" if pinned else
                                                  f" (at {commit}, not the pin)"),
        pinned=pinned and not dirty,
    )


def carried_fork_dir(commit: str) -> Path:
    """Where `bundle install` unpacks the fork tree a bundle carried (the submodule at `commit`)."""
    return paths.sources_dir() / f"llama.cpp-mtp-{commit}"


def carried_source(root: Path | None = None) -> Source | None:
    """The pinned fork tree a bundle carried into a machine with no GitHub, or None."""
    commit = pinned_commit(root)
    tree = carried_fork_dir(commit)
    marker = tree / _DONE_MARKER
    if not (_is_llama_tree(tree) and marker.is_file() and marker.read_text().strip() == commit):
        return None
    return Source(kind="submodule", path=tree, commit=commit, identity=f"submodule:{commit}",
                  location=f"{tree} ({SUBMODULE_URL} at {commit}, carried by a bundle)",
                  reason="the pinned fork tree a bundle carried")


def unpack_carried_fork(archive: Path, commit: str) -> Path:
    """Unpack a carried fork tarball (`git archive` of the submodule, top folder
    `llama.cpp-mtp/`) where `carried_source` finds it; beside, then renamed, so an interrupted
    unpack is never taken for a tree."""
    tree = carried_fork_dir(commit)
    if (tree / _DONE_MARKER).is_file() and (tree / _DONE_MARKER).read_text().strip() == commit:
        return tree
    staging = paths.sources_dir() / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _safe_extract(archive, staging)
        if not _is_llama_tree(staging / "llama.cpp-mtp"):
            raise IntegrityError(f"{archive}: no llama.cpp-mtp/CMakeLists.txt inside; it is not "
                                 "the fork tree `mtpwrap bundle create` packs.")
        shutil.rmtree(tree, ignore_errors=True)
        (staging / "llama.cpp-mtp").rename(tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    (tree / _DONE_MARKER).write_text(commit + "\n")
    return tree


def pin_status(root: Path | None = None) -> tuple[str, str]:
    """(pinned commit, what the checkout holds) for `doctor`: the checkout's HEAD, or 'empty'."""
    sub = submodule_source(root)
    pin = pinned_commit(root)
    if sub is None:
        return pin, "empty (not initialised)"
    held = sub.commit or "unknown commit"
    if sub.identity.endswith("+dirty"):
        held += " with local changes"
    return pin, held


def check_pin(sub: Source, allow_unpinned: bool, root: Path | None = None) -> Source:
    """The submodule as it is, if it holds the pinned commit or the user allowed otherwise."""
    if sub.pinned:
        return sub
    held = sub.commit or "an unknown commit"
    if sub.identity.endswith("+dirty"):
        held += " with local changes"
    if not allow_unpinned:
        raise ConfigError(
            f"{SUBMODULE_PATH} holds {held}, not the pinned fork commit {pinned_commit(root)}.",
            hint="Run `git submodule update` to check out the pin, or pass --allow-unpinned "
            "(or --source PATH) to build what is there.",
        )
    return dataclasses.replace(sub, reason=sub.reason + "; built anyway: --allow-unpinned")


def path_source(path: str | Path) -> Source:
    tree = Path(path).expanduser().resolve()
    if not tree.exists():
        raise ConfigError(
            f"--source {path}: no such directory.",
            hint="Give the path of a llama.cpp checkout, or use --source offline.",
        )
    if not _is_llama_tree(tree):
        raise ConfigError(
            f"--source {path}: no CMakeLists.txt there, so it is not a llama.cpp source tree.",
            hint="Give the top folder of a llama.cpp checkout, or use --source offline.",
        )
    commit = _git(tree, "rev-parse", "HEAD")
    # A path is built incrementally; its identity is the path itself, so edits rebuild in place.
    return Source(
        kind="path",
        path=tree,
        commit=commit,
        identity=f"path:{tree}",
        location=str(tree),
        reason="asked for with --source PATH",
    )


def _safe_extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12 has no extraction filters; refuse links that leave dest.
            root = dest.resolve()
            for m in tar.getmembers():
                target = (dest / m.name).resolve()
                if not str(target).startswith(str(root)) or m.issym() or m.islnk():
                    raise IntegrityError(f"{archive}: unsafe member {m.name}.")
            tar.extractall(dest)


def offline_source(reason: str = "asked for with --source offline") -> Source:
    """The pinned upstream tree from the llama-cpp-python sdist, downloaded and verified."""
    base = paths.sources_dir() / f"llama_cpp_python-{OFFLINE_VERSION}"
    tree = paths.sources_dir() / OFFLINE_SUBDIR
    marker = base / _DONE_MARKER
    if not (marker.is_file() and marker.read_text().strip() == OFFLINE_SHA256):
        archive = fetch.pinned_file(
            OFFLINE_PACKAGE, OFFLINE_VERSION, OFFLINE_SDIST, OFFLINE_SHA256, sdist=True,
            hint=f"Put {OFFLINE_SDIST} into {paths.downloads_dir()} by hand, or build with "
            "--source PATH.",
        )
        # Extract beside the final place, then rename, so an interrupted extraction is never
        # mistaken for a complete tree.
        staging = paths.sources_dir() / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            _safe_extract(archive, staging)
            shutil.rmtree(base, ignore_errors=True)
            (staging / f"llama_cpp_python-{OFFLINE_VERSION}").rename(base)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        marker.write_text(OFFLINE_SHA256 + "\n")
    # The sdist has no .git: its commit is the one its verified sha256 pins (asking git there
    # would answer for whatever repository holds the cache folder).
    return Source(
        kind="offline",
        path=tree,
        commit=OFFLINE_COMMIT,
        identity=f"offline:{OFFLINE_SHA256}",
        location=f"{OFFLINE_PACKAGE}=={OFFLINE_VERSION} sdist ({OFFLINE_SUBDIR}, sha256 "
        f"{OFFLINE_SHA256[:12]}…)",
        reason=reason,
    )


def resolve(spec: str | None = None, *, allow_unpinned: bool = False,
            root: Path | None = None) -> Source:
    """`None`/"auto": submodule if initialised, else offline. Or "submodule", "offline", a path.

    The submodule is used only at the pinned commit unless `allow_unpinned`.
    """
    if spec in (None, "", "auto"):
        sub = submodule_source(root) or carried_source(root)
        if sub is not None:
            return check_pin(sub, allow_unpinned, root)
        return offline_source(
            reason=f"the submodule {SUBMODULE_PATH} is not initialised "
            "(`git submodule update --init` needs GitHub), so the pinned offline source is used"
        )
    if spec == "submodule":
        sub = submodule_source(root) or carried_source(root)
        if sub is None:
            raise ConfigError(
                f"--source submodule: {SUBMODULE_PATH} is empty.",
                hint="Run `git submodule update --init` (needs GitHub), or use --source offline.",
            )
        return check_pin(sub, allow_unpinned, root)
    if spec == "offline":
        return offline_source()
    return path_source(spec)


def offline_identity() -> str:
    """The cache identity of the offline source, known without downloading anything."""
    return f"offline:{OFFLINE_SHA256}"


def pin_identity(kind: str | None) -> str | None:
    """The cache identity of the pinned source of this kind (None for a PATH source)."""
    if kind == "offline":
        return offline_identity()
    if kind == "submodule":
        return f"submodule:{pinned_commit()}"
    return None
