"""A launch's inputs, found the way every command finds them, and llama.cpp's own figures for
it: the binary and what its `--help` offers, its build manifest (measured KV sizes), the
hardware snapshot or a recording of one, the profile and the model — then the pure
`mtpwrap.decide.resolve`, then `llama-fit-params` where there is a device to fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtpwrap.build import calibrate, probe
from mtpwrap.build import manifest as build_manifest
from mtpwrap.build.binary import find_binary
from mtpwrap.decide import hardware, profiles
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.hardware import HardwareSnapshot
from mtpwrap.decide.profile_types import Profile
from mtpwrap.decide.resolve import GiB, Inputs, Resolved, device_bytes, on_device, resolve
from mtpwrap.errors import ConfigError, MissingToolError, MtpwrapError
from mtpwrap.models import known as models


def find_server(explicit: str | Path | None, snapshot: HardwareSnapshot | None = None,
                *, required: bool = True) -> tuple[Path | None, Capabilities | None,
                                                   Any | None]:
    """(binary, its capabilities, its manifest when it is the built one). `--binary` /
    `MTPWRAP_BINARY` win over the build. Without a build and with required=False: all None."""
    try:
        binary = find_binary(explicit=explicit, snap=snapshot)
    except MissingToolError:
        if required or explicit:
            raise
        return None, None, None
    manifest = build_manifest.load_manifest()
    built = manifest.binaries.get("llama-server", {}).get("path") if manifest else None
    if manifest is not None and built != str(binary):
        manifest = None  # another binary: its own facts count
    caps = (Capabilities.from_dict(manifest.capabilities)
            if manifest is not None and manifest.capabilities else probe.probe(binary))
    if caps.outputs_capped is None:  # a manifest written before the probe looked
        caps.outputs_capped = probe.outputs_capped(binary)
    return binary, caps, manifest


def load_snapshot(replay: str | Path | None) -> HardwareSnapshot:
    """This machine through NVML, or a recording of one (`--replay`, MTPWRAP_HW_REPLAY)."""
    return hardware.load_snapshot(Path(replay)) if replay else hardware.snapshot()


def load_profile(name: str, snapshot: HardwareSnapshot) -> tuple[Profile, str]:
    if name == "auto":
        return profiles.select_profile(snapshot)
    return profiles.load_profile(name), "chosen with --profile"


def find_model(name: str, *, what: str, fetch: bool) -> tuple[str, str | None]:
    """(path, warning). fetch=False: a preview; the demo model is not downloaded and a missing
    model is a warning (shown as given)."""
    if fetch:
        return str(models.resolve_model(name, what=what)), None
    known = models.known_model(name)
    if known is not None:
        there = models.cached(known) or known.path()
        if Path(there).is_file():
            return str(there), None
        return str(there), (f"the model {known.name} is not fetched yet ({there}); "
                            f"`mtpwrap models get {known.name}` gets it")
    try:
        return str(models.resolve_model(name, what=what)), None
    except ConfigError as exc:
        return name, f"{exc} (shown as given)"


def gather(profile: str | Profile, *, model: str | None = None, binary: str | Path | None = None,
           replay: str | Path | None = None, snapshot: HardwareSnapshot | None = None,
           fetch: bool = True, need_binary: bool = True) -> Inputs:
    """Everything a command needs before `resolve`, found the same way for every command."""
    snap = snapshot if snapshot is not None else load_snapshot(replay)
    if isinstance(profile, str):
        prof, why = load_profile(profile, snap)
    else:
        prof, why = profile, "given"
    what = "--model" if model else f"profile {prof.name}: model"
    path, warning = find_model(model or prof.model, what=what, fetch=fetch)
    warnings = [warning] if warning else []
    companion_models: dict[str, str] = {}
    for i, c in enumerate(prof.companions):
        found, warning = find_model(c.model, what=f"profile {prof.name}: companions[{i}].model",
                                    fetch=fetch)
        companion_models[c.name] = found
        warnings += [warning] if warning else []
    exe, caps, manifest = find_server(binary, snap, required=need_binary)
    commit = manifest.commit if manifest is not None else (caps.commit if caps else None)
    return Inputs(profile=prof, profile_reason=why, snapshot=snap, caps=caps, binary=exe,
                  model=path, commit=commit, kv_sizes=calibrate.load_kv_sizes(manifest),
                  warnings=warnings, manifest=manifest, companion_models=companion_models)


def resolve_inputs(inp: Inputs, *, plan: bool | None = None,
                   kv_limits: Sequence[str] | None = None, refuse: bool = True) -> Resolved:
    """`resolve` on gathered inputs; on a device, llama.cpp's own figures decide too."""
    r = resolve(inp.profile, snapshot=inp.snapshot, caps=inp.caps, model=inp.model,
                binary=inp.binary, kv_sizes=inp.kv_sizes, plan=plan, kv_limits=kv_limits,
                inputs=inp, refuse=refuse)
    if refuse and r.plan is not None and on_device(inp.profile, inp.snapshot):
        r = measure(r)
    return r


def measure(r: Resolved, *, timeout: float = 120.0, refuse: bool = True) -> Resolved:
    """Ask the built binary: llama-fit-params with this launch's flags reads the model's header
    and prints the buffers llama.cpp would allocate (nothing is allocated). A flag that
    llama-fit-params lacks and that does not size memory (the fork's rejects --spec-type) is
    left out and named; the plan's rows for what it left out (the MTP rows) are added to its
    figure. The figures go next to the plan's (`measured`, in the new Resolved returned); where
    there is a device, the verdict uses them: a launch llama.cpp itself sizes beyond the free
    memory is refused. Without the binary or the model file, `measured_text` says why nothing
    was measured."""
    inp = r.inputs
    if inp.binary is None or not Path(r.launch.model).is_file():
        return dataclasses.replace(
            r, measured_text="not measured (no built binary or no model file here)")
    try:
        fit = calibrate.fit_params_binary(inp.binary)
        rendered = calibrate.fit_params_launch(fit, r.launch)
        a = calibrate.parse_allocations(calibrate.run_fit_params(
            fit, Path(r.launch.model), rendered.argv[3:], timeout=timeout))
    except (MtpwrapError, OSError) as exc:
        return dataclasses.replace(r, measured_text=f"not measured ({exc})")
    measured = {"weights": a.model_total, "kv": a.kv_total, "recurrent": a.recurrent_total,
                  "compute": sum(a.compute_per_context) or a.compute_total,
                  "output": a.output}
    note = ""
    if rendered.dropped:
        spec_dropped = any(d.startswith("--spec-type") for d in rendered.dropped)
        planned = sum(row.bytes for row in (r.plan.rows if r.plan else [])
                      if row.name.startswith("MTP") and row.where == "gpu") if spec_dropped else 0
        if planned:
            measured["planned MTP"] = planned
        # without --spec-type llama.cpp keeps one recurrent row per slot; MTP keeps
        # 1 + depth of them (common/common.cpp: n_rs_seq = the draft depth)
        snapshots = (max(0, r.plan.row("recurrent state").bytes - a.recurrent_total)
                     if spec_dropped and r.plan else 0)
        if snapshots:
            measured["planned recurrent snapshots"] = snapshots
            planned += snapshots
        note = (f" without {', '.join(rendered.dropped)} (this llama-fit-params lacks "
                + ("them" if len(rendered.dropped) > 1 else "it")
                + (f"; the plan's {planned / GiB:.2f} GiB of MTP rows"
                   + (" and recurrent snapshots" if snapshots else "") + " added)" if planned
                   else ")"))
    total = sum(measured.values())
    measured["total"] = total
    r = dataclasses.replace(r, measured=measured,
                            measured_text=f"{total / GiB:.2f} GiB measured by llama-fit-params"
                                          f"{note}")
    device = device_bytes(r.profile, inp.snapshot)
    headroom = r.measured_headroom
    if refuse and device is not None and r.plan is not None and headroom is not None \
            and headroom < 0:
        raise ConfigError(
            f"{r.launch.model}: llama.cpp itself sizes this launch (context "
            f"{r.launch.context:,}, KV {r.launch.cache_k}/{r.launch.cache_v}) at "
            f"{total / GiB:.2f} GiB plus a {r.plan.config.margin / GiB:.2f} GiB margin, but the "
            f"device has {device / GiB:.2f} GiB free (the analytic plan said "
            f"{r.plan.total / GiB:.2f} GiB).",
            hint="Lower the context or choose a smaller KV type in the profile.")
    return r
