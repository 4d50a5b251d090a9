"""`mtpwrap doctor`."""

from __future__ import annotations

import sys

import click

from mtpwrap.config.options import setting_option


@click.command("doctor")
@setting_option("model", help="Model file to check.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def command(model: str | None, as_json: bool) -> None:
    """Check the NVIDIA driver, GPUs, CUDA toolkit, cmake, compiler, disk, build and model.

    Exits 0 when everything needed to run is there (warnings allowed), non-zero when a hard
    requirement such as the C++ compiler is missing.
    """
    from mtpwrap import console, doctor
    from mtpwrap.errors import EXIT_UNAVAILABLE

    checks = doctor.run_checks(model)
    hard = [c for c in checks if c.hard and c.status == doctor.MISSING]
    if as_json:
        console.print_json({"ok": not hard, "checks": [c.to_dict() for c in checks]})
    else:
        colour = {doctor.OK: "green", doctor.WARNING: "yellow", doctor.MISSING: "red"}
        for c in checks:
            console.out.print(
                f"[{colour[c.status]}]{c.status:>7}[/]  [bold]{c.name}[/]: {c.detail}"
            )
            if c.fix and c.status != doctor.OK:
                console.out.print(f"         fix: {c.fix}")
    if hard:
        sys.exit(EXIT_UNAVAILABLE)
