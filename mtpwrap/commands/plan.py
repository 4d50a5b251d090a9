"""`mtpwrap plan`: will a model fit a GPU at this context, and what is the largest that does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mtpwrap.config.options import setting_option, shared_option
from mtpwrap.decide.hardware import KNOWN_GPUS, gpu_snapshot
from mtpwrap.errors import ConfigError
from mtpwrap.units import MiB


def _gpu_for_profile(prof: Any) -> str:
    """The known GPU a profile names (its hardware.gpu_name pattern), else "auto"; "cpu" for a
    profile that needs no GPU."""
    import re

    if not prof.hardware.requires_gpu:
        return "cpu"
    if prof.hardware.gpu_name:
        for key, (desc, _) in KNOWN_GPUS.items():
            if re.search(prof.hardware.gpu_name, desc, re.IGNORECASE):
                return key
    return "auto"


def _fmt(n: int) -> str:
    return f"{n / MiB:,.0f}"


def _overrides(model: str | None, context: int | None, kv: str | None, spec: str | None,
               depth: int | None, kv_draft: str | None, slots: int | None, ubatch: int | None,
               flash_attn: bool | None, base_spec: dict[str, Any]) -> dict[str, Any]:
    """The flags as profile keys: `plan` plans a profile with these keys replaced."""
    out: dict[str, Any] = {}
    if model:
        out["model"] = model
    if context:
        out["context"] = context
    if kv:
        out["kv"] = {"k": [kv], "v": [kv]}
    if slots:
        out["slots"] = slots
    if ubatch:
        out["ubatch"] = ubatch
    if flash_attn is not None:
        out["flash_attn"] = "on" if flash_attn else "off"
    if spec or depth or kv_draft:
        same = not spec or spec == base_spec.get("kind")
        s: dict[str, Any] = dict(base_spec) if same else {"kind": spec}
        kind = s.get("kind", "none")
        if kind == "none" and (depth or kv_draft):
            raise ConfigError("--depth and --kv-draft need speculation: add --spec mtp or "
                              "--spec draft.")
        if kind in ("mtp", "draft"):
            s["depth"] = depth or s.get("depth") or 3
        if kind == "draft" and not s.get("draft_model"):
            s["draft_model"] = model or "demo"  # self-draft unless the profile names one
        if kv_draft:
            s["draft_kv"] = {"k": [kv_draft], "v": [kv_draft]}
        out["spec"] = s
    return out


@click.command("plan")
@setting_option("model", "--model", "-m", "model",
                help="GGUF model file (only its header is read); default: the profile's model.")
@setting_option("profile", "--profile", "-p", "profile", default=None,
                help="Plan this profile (the flags below replace its keys).")
@click.option("--gpu", default=None, envvar="MTPWRAP_GPU",
              help=f"GPU to plan for: {', '.join(KNOWN_GPUS)}, auto (this machine, or "
                   "--hw-replay), or cpu (default: auto).")
@setting_option("hw_replay", "--hw-replay", "replay",
                help="Hardware recording to plan for (--gpu auto).")
@setting_option("binary",
                help="llama-server whose KV and speculation types count (default: the built "
                     "one, if any).")
@click.option("--context", "-c", "context", type=int, envvar="MTPWRAP_CONTEXT",
              help="Context length (default: the profile's, else the model's trained context).")
@click.option("--kv", "kv", default=None, envvar="MTPWRAP_KV",
              help="KV cache type for K and V (default: the profile's, else f16).")
@click.option("--spec", type=click.Choice(["mtp", "draft", "ngram", "none"]), default=None,
              envvar="MTPWRAP_SPEC", help="Speculative decoding kind (default: the profile's).")
@click.option("--depth", type=int, default=None, envvar="MTPWRAP_SPEC_DEPTH",
              help="Draft depth (MTP keeps this many recurrent-state snapshots; default 3).")
@click.option("--kv-draft", default=None, envvar="MTPWRAP_KV_DRAFT",
              help="KV type of the MTP context (-ctkd/-ctvd; default f16).")
@click.option("--slots", type=int, default=None, envvar="MTPWRAP_SLOTS",
              help="Parallel slots (-np; default 1).")
@click.option("--ubatch", type=int, default=None, envvar="MTPWRAP_UBATCH",
              help="Micro-batch size (-ub; default: the profile's, else on a GPU the largest "
                   "whose compute buffers fit, else 512).")
@click.option("--flash-attn/--no-flash-attn", default=None, envvar="MTPWRAP_FLASH_ATTN",
              help="Flash attention (default: the profile's, else auto).")
@click.option("--measure/--no-measure", default=True, envvar="MTPWRAP_PLAN_MEASURE",
              show_default=True,
              help="Also ask the built binary (llama-fit-params with the same flags).")
@shared_option("MTPWRAP_JSON", help="Print the plan as JSON.")
def command(model: str | None, profile: str | None, gpu: str | None, replay: str | None,
            binary: str | None, context: int | None, kv: str | None, spec: str | None,
            depth: int | None, kv_draft: str | None, slots: int | None, ubatch: int | None,
            flash_attn: bool | None, measure: bool, as_json: bool) -> None:
    """Plan memory for a model on a GPU: each buffer, verdict, largest context per KV type."""
    from mtpwrap import console
    from mtpwrap.decide import profiles, resolve
    from mtpwrap.supervision import inputs

    if not (model or profile):
        raise ConfigError("--model or --profile is required: which GGUF should be planned?")
    base = profiles.load_profile(profile) if profile else None
    gpu_name = (gpu or ("auto" if replay or base is None else _gpu_for_profile(base))).lower()
    snap = (inputs.load_snapshot(replay) if gpu_name in ("auto", "cpu")
            else gpu_snapshot(gpu_name))
    if base is None:
        base = profiles.validate({"name": "plan", "description": "mtpwrap plan --model",
                                  "model": model, "context": 4096,
                                  "hardware": {"requires_gpu": gpu_name != "cpu"}},
                                 where="mtpwrap plan")
    changes = _overrides(model, context, kv, spec, depth, kv_draft, slots, ubatch, flash_attn,
                         profiles.to_yaml(base).get("spec", {}))
    if gpu_name == "cpu":
        changes["hardware"] = {"requires_gpu": False}
        changes["gpu_layers"] = 0
    prof = profiles.with_overrides(base, changes, where="mtpwrap plan flags")
    inp = inputs.gather(prof, model=model, binary=binary, snapshot=snap, need_binary=False)
    if base.name == "plan" and not context:
        # no profile and no --context: the model's own trained length
        from mtpwrap.decide.gguf_facts import read_facts

        trained = read_facts(Path(inp.model)).n_ctx_train or 4096
        inp.profile = profiles.with_overrides(prof, {"context": max(256, trained)},
                                              where="mtpwrap plan")
    r = inputs.resolve_inputs(inp, plan=True, refuse=False,
                              kv_limits=resolve.limit_types(inp.kv_sizes, inp.caps))
    if r.plan is None:
        raise ConfigError(f"{inp.model}: {r.plan_text}")
    p = r.plan
    if measure and inp.caps is not None and r.measured_text is None:
        r = inputs.measure(r, refuse=False)  # the same plan, with llama.cpp's own figures
    device = resolve.device_bytes(inp.profile, snap)
    desc = (snap.gpus[0].name or "GPU 0") if device is not None else "CPU (host memory)"
    if as_json:
        console.print_json({
            **p.to_dict(), "device": desc, "profile": inp.profile.name, "measured": r.measured,
            "measured_text": r.measured_text,
            "documents": r.documents.to_dict() if r.documents is not None else None,
            "ubatch": {"value": r.launch.ubatch, "why": _ubatch_why(r)}})
        return
    _print_plan(r, desc, device)


def _print_plan(r: Any, desc: str, device: int | None) -> None:
    """The plan as a table, llama.cpp's own figures, the verdict and the largest contexts."""
    from mtpwrap import console
    from mtpwrap.decide import planner

    p, inp = r.plan, r.inputs
    for w in [*inp.warnings, *r.launch.warnings, *p.warnings]:
        console.warn(w)
    cfg = p.config
    title = (f"{Path(inp.model).name}: {p.architecture}"
             f"{' (generic estimate)' if p.generic else ''}, context {p.context:,}, KV {cfg.type_k}"
             f"{', MTP depth ' + str(cfg.draft_depth) if cfg.spec == 'mtp' else ''}, {desc}")
    rows = [[row.name, row.where, _fmt(row.bytes), row.note] for row in p.rows]
    rows.append(["total on device", "gpu" if device is not None else "host", _fmt(p.total), ""])
    console.table(title, ["buffer", "where", "MiB", "detail"], rows)
    # on the CPU every row is host memory: the device total is the host total
    host_needed = p.total if device is None else p.total + p.host_total
    if r.measured:
        m = r.measured
        how = (r.measured_text or "").partition(" measured by llama-fit-params")[2]
        added = "".join(f", {k.removeprefix('planned ')} {_fmt(v)} (the plan's)"
                        for k, v in m.items() if k.startswith("planned "))
        console.out.print(
            f"llama.cpp's own figures (llama-fit-params, the launch's flags{how}): weights "
            f"{_fmt(m['weights'])}, KV {_fmt(m['kv'])}, recurrent {_fmt(m['recurrent'])}, "
            f"compute {_fmt(m['compute'])}, output {_fmt(m['output'])}{added}; total "
            f"{_fmt(m['total'])} MiB (plan, device and host: {_fmt(host_needed)} MiB)")
    elif r.measured_text:
        console.out.print(f"llama.cpp's own figures: {r.measured_text}")
    if device is None:
        console.out.print(f"host memory needed: {_fmt(host_needed)} MiB")
        _print_launch(r)
        return
    assert p.headroom is not None
    if r.measured:
        # llama.cpp's own figures decide; the plan's stand beside them
        total, headroom = r.measured["total"], r.measured_headroom
        assert headroom is not None
        verdict = "FITS" if headroom >= 0 else "DOES NOT FIT"
        beside = (f"{_fmt(cfg.reserved_bytes)} MiB of companions + " if cfg.reserved_bytes
                  else "")
        console.out.print(f"{verdict} (llama.cpp's own figures): {_fmt(total)} MiB + {beside}"
                          f"{_fmt(cfg.margin)} MiB margin of {_fmt(device)} MiB; headroom "
                          f"{_fmt(headroom)} MiB (plan, device: "
                          f"{_fmt(p.total)} MiB)")
    else:
        verdict = "FITS" if p.fits else "DOES NOT FIT"
        console.out.print(f"{verdict}: {_fmt(p.total)} MiB + {_fmt(cfg.margin)} MiB margin of "
                          f"{_fmt(device)} MiB; headroom {_fmt(p.headroom)} MiB")
    largest = ", ".join(f"{t} {n:,}" for t, n in p.largest_context.items())
    console.out.print(f"largest context that fits: {largest}")
    for note in planner.limit_notes(list(p.largest_context)):
        console.out.print(f"  {note}")
    for why in p.not_admitted.values():
        console.out.print(f"  not listed, {why}")
    _print_launch(r)


def _ubatch_why(r: Any) -> str:
    """The launch's ubatch (-ub) and why it has it: the profile's, or the plan's choice."""
    ub = r.launch.ubatch
    if ub is None:
        return "llama.cpp's default 512 (no device to fit it to)"
    return f"{ub:,}: {r.launch.reason('ubatch') or 'set'}"


def _print_launch(r: Any) -> None:
    """The launch's ubatch, then how documents stay warm under it (`decide.documents`), with
    each reason."""
    from mtpwrap import console

    console.out.print(f"ubatch: {_ubatch_why(r)}")
    if r.documents is None:
        return
    console.out.print(f"documents: {r.documents.summary()}")
    for key, why in r.documents.why:
        console.out.print(f"  {key}: {why}")
