"""The bundle's SBOM: CycloneDX 1.6 JSON made with cyclonedx-python-lib from the manifest's item
list — Python packages with versions and sha256, the llama.cpp sources with their commits and
the patches a build applied to them, builds and models with their sha256."""

from __future__ import annotations

from typing import Any

from mtpwrap.bundle.contents import Item, items_of

FILE = "sbom.cdx.json"
_PREFIX = "mtpwrap:"


def _component(item: Item, patches: dict[str, Item]) -> Any:
    from cyclonedx.model import HashAlgorithm, HashType, Property, XsUri
    from cyclonedx.model.component import (
        Component,
        ComponentType,
        Diff,
        Patch,
        PatchClassification,
        Pedigree,
    )
    from packageurl import PackageURL

    role = item.extra.get("role")
    # by what the file is; a pinned download by its role (a model's wheel is the model)
    kind = {
        "source": ComponentType.LIBRARY,
        "patch": ComponentType.FILE,
        "record": ComponentType.FILE,
        "build": ComponentType.APPLICATION,
        "model": ComponentType.MACHINE_LEARNING_MODEL,
    }.get(item.kind) or {
        "model": ComponentType.MACHINE_LEARNING_MODEL,
        "corpus": ComponentType.DATA,
    }.get(str(role), ComponentType.LIBRARY)
    purl = None
    if item.kind == "wheel" or (item.kind == "download" and role != "llama.cpp source"):
        purl = PackageURL("pypi", name=item.name, version=item.version)
    elif item.kind == "download":  # the sdist that carries upstream llama.cpp
        purl = PackageURL("pypi", name=item.name, version=item.version,
                          qualifiers={"commit": str(item.extra.get("commit"))})
    elif item.kind == "source":
        purl = PackageURL("github", "Indras-Mirror", "llama.cpp-mtp", item.version)
    props = [Property(name=f"{_PREFIX}path", value=item.path),
             Property(name=f"{_PREFIX}kind", value=item.kind)]
    for key in ("role", "variant", "cpu_isa", "smoke", "commit", "model", "file"):
        if item.extra.get(key):
            props.append(Property(name=f"{_PREFIX}{key}", value=str(item.extra[key])))
    for name, sha in sorted((item.extra.get("binaries") or {}).items()):
        props.append(Property(name=f"{_PREFIX}binary:{name}:sha256", value=str(sha)))
    pedigree = None
    applied = [patches[n] for n in item.extra.get("patches") or [] if n in patches]
    if applied:
        pedigree = Pedigree(
            patches=[Patch(type=PatchClassification.UNOFFICIAL, diff=Diff(url=XsUri(p.path)))
                     for p in applied],
            notes="patches applied to the llama.cpp source before compiling: "
                  + ", ".join(f"{p.name} (sha256 {p.sha256})" for p in applied))
    return Component(
        name=item.name, version=item.version, type=kind, bom_ref=item.path, purl=purl,
        hashes=[HashType(alg=HashAlgorithm.SHA_256, content=item.sha256)],
        description=item.extra.get("summary") or item.extra.get("role"),
        properties=props, pedigree=pedigree)


def document(manifest: dict[str, Any]) -> str:
    """The SBOM of a bundle's manifest, as CycloneDX 1.6 JSON text."""
    from cyclonedx.model import Property
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.output.json import JsonV1Dot6

    items = items_of(manifest)
    patches = {i.name: i for i in items if i.kind == "patch"}
    target = manifest.get("target") or {}
    root = Component(
        name="mtpwrap-bundle", version=str(manifest["id"]), type=ComponentType.APPLICATION,
        bom_ref="bundle",
        description="mtpwrap and what it needs on a machine with no network",
        properties=[Property(name=f"{_PREFIX}target:{k}", value=str(v))
                    for k, v in sorted(target.items()) if v not in (None, [], "")])
    bom = Bom()
    bom.metadata.component = root
    components = [_component(i, patches) for i in items]
    for c in components:
        bom.components.add(c)
    bom.register_dependency(root, components)
    return str(JsonV1Dot6(bom).output_as_string(indent=2)) + "\n"
