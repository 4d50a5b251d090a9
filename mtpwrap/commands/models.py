"""`mtpwrap models`."""

from __future__ import annotations

import click


@click.group("models")
def command() -> None:
    """Fetch and list model files."""


@command.command("demo")
def demo() -> None:
    """Download the demo model (SmolLM2-135M-Instruct Q4_1, 98 MB), verify it, print its path."""
    from mtpwrap.decide import models

    click.echo(str(models.ensure_demo_model()))


@command.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(as_json: bool) -> None:
    """List the GGUF files in the models directory."""
    from mtpwrap import console, paths
    from mtpwrap.decide import models

    rows = models.list_models()
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
