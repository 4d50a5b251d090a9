"""`mtpwrap hw`: what this machine has (GPUs through NVML, cores and RAM)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mtpwrap import console
from mtpwrap.config.options import setting_option, shared_option
from mtpwrap.decide import hardware
from mtpwrap.units import GiB


@click.command("hw")
@shared_option("MTPWRAP_JSON", help="Print the snapshot as JSON.")
@click.option("--record", "record_to", type=click.Path(dir_okay=False, path_type=Path),
              envvar="MTPWRAP_HW_RECORD",
              help="Write NVML's raw answers to this file, to replay elsewhere with --replay.")
@setting_option("hw_replay", "--replay", "replay",
                help="Read a recording (or a saved --json snapshot) instead of this machine.")
def command(as_json: bool, record_to: Path | None, replay: str | None) -> None:
    """Show the GPUs (name, memory, compute capability, driver, power, PCIe), CPU and RAM."""
    if record_to is not None:
        data = hardware.record(note="mtpwrap hw --record")
        record_to.write_text(json.dumps(data, indent=2) + "\n")
        console.info(f"wrote {record_to}")
    snap = hardware.load_snapshot(replay) if replay else hardware.snapshot()
    if as_json:
        console.print_json(snap.to_dict())
        return
    gib = GiB
    rows = []
    for g in snap.gpus:
        cc = (f"{g.compute_capability[0]}.{g.compute_capability[1]}"
              if g.compute_capability else None)
        mem = (f"{g.memory_free / gib:.1f} / {g.memory_total / gib:.1f}"
               if g.memory_total is not None and g.memory_free is not None else None)
        pcie = f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen and g.pcie_width else None
        rows.append([g.index, g.name, mem, cc, g.power_limit_w, pcie, g.temperature_c, g.uuid])
    if rows:
        console.table(f"GPUs (driver {snap.driver_version}, CUDA {snap.cuda_driver_version})",
                      ["#", "name", "free / total GiB", "cc", "power limit W", "PCIe", "°C",
                       "uuid"], rows)
    else:
        console.out.print(f"GPU: none ({snap.error})")
    ram = (f"{snap.ram_available / gib:.1f} of {snap.ram_total / gib:.1f} GiB available"
           if snap.ram_total is not None and snap.ram_available is not None else "unknown")
    console.out.print(f"CPU: {snap.cpu_physical if snap.cpu_physical is not None else '?'} "
                      f"physical / {snap.cpu_logical if snap.cpu_logical is not None else '?'} "
                      f"logical cores; RAM: {ram}")
