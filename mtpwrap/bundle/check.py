"""Check an offline bundle before anything in it is used: every file against SHA256SUMS (a
missing, changed or unlisted file is named), the detached signature when a public key is given,
and that the bundle was made for this Python, CPU architecture and C library.

Standard library only: the bundle carries a copy of this file, and its `install.sh` runs it
with the system's `python3` before a virtual environment exists. `mtpwrap bundle verify` and
`mtpwrap bundle install` run the same checks from the package.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

SUMS = "SHA256SUMS"
SIGNATURE = "SHA256SUMS.sig"
MANIFEST = "bundle.json"
#: what SHA256SUMS cannot list: itself and the signature over it
UNLISTED = (SUMS, SIGNATURE)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: what every bundle lists: the list of its files cannot be empty or lose these
REQUIRED = ("bundle.json", "check.py", "install.sh")
_HEX = frozenset("0123456789abcdef")


def read_sums(root: Path) -> tuple[dict[str, str], list[str]]:
    """Relative path → sha256 from the bundle's SHA256SUMS, and the problems reading it."""
    path = root / SUMS
    if not path.is_file():
        return {}, [f"{path} is missing: this is not a bundle `mtpwrap bundle create` made, or "
                    "it was not copied whole."]
    sums: dict[str, str] = {}
    problems = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        digest, _, name = line.partition("  ")
        digest = digest.lower()
        if (len(digest) != 64 or not set(digest) <= _HEX or not name or name.startswith("/")
                or ".." in name.split("/") or name in sums):
            problems.append(f"{path}:{n}: not a `HEX  RELATIVE-PATH` line of a file listed "
                            "once; the list itself is damaged.")
            continue
        sums[name] = digest
    missing = [name for name in REQUIRED if name not in sums]
    if missing and not problems:
        problems.append(f"{path} does not list {', '.join(missing)}: the list is damaged or "
                        "not a bundle's; copy the bundle again.")
    return sums, problems


def files_under(root: Path) -> tuple[list[str], list[str]]:
    """Every plain file under `root`, relative and with `/`, sorted; and every symbolic link
    (a bundle holds none: a link could lead a checked name out of the bundle)."""
    files, links = [], []
    for base, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + names):
            path = Path(base, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                links.append(rel)
            elif name in names:
                files.append(rel)
        dirs[:] = [d for d in dirs if not Path(base, d).is_symlink()]
    return files, links


def file_problems(root: Path) -> list[str]:
    """One sentence per file that is missing, changed, not listed in SHA256SUMS, or a link."""
    sums, problems = read_sums(root)
    if problems:
        return problems
    files, links = files_under(root)
    problems += [f"{root / name} is a symbolic link: a bundle holds plain files only; copy the "
                 "bundle again from where it was made." for name in links]
    if links:
        return problems
    for name, digest in sums.items():
        path = root / name
        if not path.is_file():
            problems.append(f"{path} is missing (SHA256SUMS lists it): copy the bundle again.")
        elif sha256(path) != digest:
            problems.append(f"{path} does not match its sha256 in SHA256SUMS: it was changed "
                            "or damaged; copy the bundle again from where it was made.")
    for name in files:
        if name not in sums and name not in UNLISTED:
            problems.append(f"{root / name} is not in SHA256SUMS: something was added to the "
                            "bundle; remove it or copy the bundle again.")
    return problems


def signature_problem(root: Path, public_key: Path | None) -> str | None:
    """None when the signature over SHA256SUMS verifies with `public_key` (openssl), or when no
    key is given; else why not."""
    if public_key is None:
        return None
    sig = root / SIGNATURE
    if not sig.is_file():
        return (f"{sig} is missing, but a public key was given: the bundle is not signed, or "
                "the signature was not copied.")
    if not public_key.is_file():
        return f"public key {public_key}: no such file."
    try:
        done = subprocess.run(
            ["openssl", "dgst", "-sha256", "-verify", str(public_key), "-signature", str(sig),
             str(root / SUMS)], capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return "openssl is not installed, so the signature cannot be checked: install openssl."
    if done.returncode != 0:
        return (f"{sig} does not verify with {public_key}: the bundle was not signed by that "
                "key, or SHA256SUMS was changed after signing.")
    return None


def read_manifest(root: Path) -> dict[str, object]:
    """The bundle's manifest; a ValueError with one sentence when it is unreadable."""
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("target"), dict):
        raise ValueError(f"{path}: no `target` in it; not a bundle `mtpwrap bundle create` made.")
    return data


def _glibc() -> tuple[int, ...] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def target_problem(manifest: dict[str, object]) -> str | None:
    """Why this machine cannot use a bundle made for `manifest["target"]`, or None."""
    target = manifest["target"]
    assert isinstance(target, dict)
    here_py = "{}.{}".format(*sys.version_info[:2])
    here_machine = platform.machine()
    want_py, want_machine = str(target.get("python")), str(target.get("machine"))
    if want_py != here_py:
        return (f"this bundle is for Python {want_py}, and python3 here is {here_py}: make a "
                f"bundle with `mtpwrap bundle create --python {here_py}` on the connected "
                "machine.")
    if want_machine != here_machine:
        return (f"this bundle is for {want_machine} machines, and this one is {here_machine}: "
                f"make one with `--platform manylinux2014_{here_machine}`.")
    want_glibc = str(target.get("glibc") or "")
    have = _glibc()
    if want_glibc and have is None:
        return (f"this bundle's wheels need glibc {want_glibc}, and this machine's C library "
                "is not glibc: a bundle for musl systems is not made.")
    if want_glibc and have is not None:
        want = tuple(int(p) for p in want_glibc.split("."))
        if have < want:
            return (f"this bundle's wheels need glibc {want_glibc} or newer, and this machine "
                    f"has {'.'.join(map(str, have))}: make one with an older --platform.")
    return None


def problems(root: Path, public_key: Path | None = None) -> list[str]:
    """Everything that stops the bundle at `root` from being installed here, one sentence each;
    empty when it can be."""
    if not root.is_dir():
        return [f"bundle {root}: no such directory (unpack it with `tar xf` first)."]
    found = file_problems(root)
    if found:
        return found
    sig = signature_problem(root, public_key)
    if sig:
        return [sig]
    try:
        why = target_problem(read_manifest(root))
    except ValueError as exc:
        return [str(exc)]
    return [why] if why else []


def bundle_id(manifest: dict[str, object]) -> str:
    """The bundle's id, which names its folder inside the prefix: letters, digits, `.`, `-`."""
    value = str(manifest.get("id") or "")
    if not value or value.startswith(".") or not all(c.isalnum() or c in ".-" for c in value):
        raise ValueError(f"bundle id {value!r} is not a name a bundle has; the manifest is "
                         "damaged.")
    return value


def requirement(manifest: dict[str, object]) -> str:
    """What pip installs from the carried wheels: mtpwrap at the version of the carried wheel,
    with the cuda extra for a CUDA bundle."""
    items = manifest.get("items")
    wheels = [i for i in items if isinstance(i, dict) and i.get("kind") == "wheel"
              and i.get("name") == "mtpwrap"] if isinstance(items, list) else []
    if len(wheels) != 1:
        raise ValueError("the manifest names no mtpwrap wheel; it is damaged.")
    target = manifest["target"]
    extra = "[cuda]" if isinstance(target, dict) and target.get("cuda") else ""
    return f"mtpwrap{extra}=={wheels[0]['version']}"


def main(argv: list[str]) -> int:
    """`python3 check.py BUNDLE_DIR [PUBLIC_KEY]`: exit 0 when it can be installed here, else
    one line per problem on stderr and exit 1. `--id BUNDLE_DIR` prints the bundle's id,
    `--requirement BUNDLE_DIR` what pip installs from its wheels."""
    if len(argv) == 2 and argv[0] in ("--id", "--requirement"):
        try:
            print(bundle_id(read_manifest(Path(argv[1]))) if argv[0] == "--id"
                  else requirement(read_manifest(Path(argv[1]))))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if len(argv) not in (1, 2):
        print("usage: check.py BUNDLE_DIR [PUBLIC_KEY]", file=sys.stderr)
        return 2
    found = problems(Path(argv[0]), Path(argv[1]) if len(argv) == 2 else None)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
