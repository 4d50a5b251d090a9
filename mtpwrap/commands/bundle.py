"""`mtpwrap bundle create | verify | install`: one verified folder that carries mtpwrap into a
building with no internet."""

from __future__ import annotations

from pathlib import Path

import click

_KEY = click.Path(dir_okay=False, path_type=Path)


@click.group("bundle")
def command() -> None:
    """Carry mtpwrap to a machine with no network: make, check and install a bundle.

    Outside: `mtpwrap bundle create OUT --model demo --with-build cpu --tar`. Inside:
    `tar xf OUT.tar && ./OUT/install.sh`, then `mtpwrap up --profile …`.
    """


@command.command("create")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--python", "python", metavar="X.Y", help="The target's Python (default: this "
              "one's).")
@click.option("--platform", "platforms", multiple=True, metavar="TAG",
              help="A pip platform tag of the target, e.g. manylinux2014_x86_64; repeat for "
              "several (default: this machine's manylinux tags).")
@click.option("--cuda", is_flag=True, help="Carry the cuda extra (cuBLAS) for CUDA builds.")
@click.option("--with-build", "builds", multiple=True, metavar="VARIANT",
              help="Carry an installed, smoke-tested build (cpu, cuda-sm89, …); repeatable.")
@click.option("--model", "models", multiple=True, metavar="NAME|PATH",
              help="Carry a known model (demo, gemma-3-270m) or a GGUF file; repeatable.")
@click.option("--corpora", is_flag=True, help="Carry the benchmark's corpus wheels.")
@click.option("--sign-key", type=_KEY, help="Sign SHA256SUMS with this PEM private key "
              "(openssl); check inside with `--public-key`.")
@click.option("--tar", "as_tar", is_flag=True, help="Also write OUT.tar.")
def create_command(out: Path, python: str | None, platforms: tuple[str, ...], cuda: bool,
                   builds: tuple[str, ...], models: tuple[str, ...], corpora: bool,
                   sign_key: Path | None, as_tar: bool) -> None:
    """Make the bundle folder OUT on a connected machine, from this checkout.

    It holds the wheels of mtpwrap and every dependency for the target, the pinned llama.cpp
    sources (the offline sdist; the fork's tree when the submodule is initialised at its pin)
    and the patch set, with SHA256SUMS over every file, bundle.json and a CycloneDX SBOM
    (sbom.cdx.json).
    """
    from mtpwrap import console
    from mtpwrap.bundle import create

    want = create.target(python, platforms, cuda)
    manifest = create.create(out, want, builds=builds, models=models, with_corpora=corpora,
                             sign_key=sign_key, as_tar=as_tar)
    size = sum(int(i["size"]) for i in manifest["items"])
    console.info(f"bundle {manifest['id']}: {len(manifest['items'])} files, "
                 f"{size / (1 << 20):.1f} MiB, for Python {want.python} on {want.machine}: {out}"
                 + (f" and {out}.tar" if as_tar else ""))
    for note in manifest["notes"]:
        console.info(note)


@command.command("verify")
@click.argument("bundle", type=click.Path(file_okay=False, path_type=Path))
@click.option("--public-key", type=_KEY, help="Check the signature over SHA256SUMS with this "
              "PEM public key.")
def verify_command(bundle: Path, public_key: Path | None) -> None:
    """Check every file of BUNDLE against SHA256SUMS (and the signature), and that it was made
    for this Python and CPU architecture. Exit 0 when it can be installed here."""
    from mtpwrap import console
    from mtpwrap.bundle import install

    manifest = install.verified(bundle, public_key)
    console.info(f"bundle {manifest['id']}: {len(manifest['items'])} files check"
                 + (", signature verified" if public_key else ""))


@command.command("install")
@click.argument("bundle", type=click.Path(file_okay=False, path_type=Path))
@click.option("--public-key", type=_KEY, help="Check the signature over SHA256SUMS with this "
              "PEM public key.")
def install_command(bundle: Path, public_key: Path | None) -> None:
    """Place what BUNDLE carries where `build`, `up` and `models` find it, then run `doctor`.

    Its `install.sh` runs this from the venv it made of the carried wheels; every file is
    checked first, and a carried build is smoke-tested on this machine before it is used.
    """
    from mtpwrap import console, doctor
    from mtpwrap.bundle import install

    manifest = install.install(bundle, public_key, say=console.info)
    console.info(f"bundle {manifest['id']} installed; doctor says:")
    for c in doctor.run_checks():
        console.info(f"  {c.status:>7}  {c.name}: {c.detail}")
