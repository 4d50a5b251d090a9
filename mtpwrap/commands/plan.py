"""`mtpwrap plan`: will a model fit a GPU at this context, and what is the largest that does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mtpwrap.errors import ConfigError, MissingToolError

MiB = 1024 * 1024

#: memory a process can use on each card, MiB (the driver and display keep the rest).
KNOWN_GPUS: dict[str, tuple[str, int]] = {
    "rtx4090": ("NVIDIA GeForce RTX 4090 (24 GB)", 24_080),
    "rtx3090": ("NVIDIA GeForce RTX 3090 (24 GB)", 24_080),
    "rtx5090": ("NVIDIA GeForce RTX 5090 (32 GB)", 32_100),
    "h100": ("NVIDIA H100 80GB", 81_000),
    "h200": ("NVIDIA H200 (141 GB)", 143_200),
}
_ALIASES = {"4090": "rtx4090", "3090": "rtx3090", "5090": "rtx5090", "h100-80gb": "h100",
            "h200-141gb": "h200"}


def gpu_memory(name: str) -> tuple[str, int, str]:
    """(description, bytes usable, backend) for a known GPU name, `auto` or `cpu`."""
    key = name.lower().replace(" ", "").replace("_", "").replace("geforce", "")
    key = _ALIASES.get(key, key)
    if key == "auto":
        return _detect_gpu()
    if key in KNOWN_GPUS:
        desc, mib = KNOWN_GPUS[key]
        return desc, mib * MiB, "cuda"
    raise ConfigError(f"--gpu {name}: unknown GPU; use one of {', '.join(KNOWN_GPUS)} or auto.")


def _detect_gpu() -> tuple[str, int, str]:
    """The first GPU's free memory, from the hardware snapshot (NVML)."""
    from mtpwrap.decide import hardware

    snap = hardware.snapshot()
    gpus = [g for g in snap.gpus if g.memory_free or g.memory_total]
    if not gpus:
        why = f" ({snap.error})" if snap.error else ""
        raise ConfigError(f"--gpu auto: no NVIDIA GPU found{why}; name one with --gpu "
                          f"({', '.join(KNOWN_GPUS)}).")
    g = gpus[0]
    return g.name or f"GPU {g.index}", int(g.memory_free or g.memory_total or 0), "cuda"


def _gpu_for_profile(gpu_name: str | None) -> str:
    """A KNOWN_GPUS key whose description matches a profile's GPU pattern, else 'auto'."""
    import re

    if gpu_name:
        for key, (desc, _) in KNOWN_GPUS.items():
            if re.search(gpu_name, desc, re.IGNORECASE):
                return key
    return "auto"


def _kv_sizes() -> dict[str, Any] | None:
    try:
        from mtpwrap.build import builder
        from mtpwrap.build.calibrate import load_kv_sizes

        return load_kv_sizes(builder.load_manifest())
    except (ImportError, MissingToolError, OSError, ValueError):
        return None


def _fmt(n: int) -> str:
    return f"{n / MiB:,.0f}"


def _from_profile(name: str, kv_sizes: dict[str, Any] | None) -> dict[str, Any]:
    from mtpwrap.decide import profiles
    from mtpwrap.decide.planner import profile_settings

    prof = profiles.load_profile(name)
    settings = profile_settings(prof, kv_sizes)
    settings["gpu"] = (_gpu_for_profile(prof.hardware.gpu_name)
                       if prof.hardware.requires_gpu else "cpu")
    return settings


@click.command("plan")
@click.option("--model", "-m", "model", envvar="MTPWRAP_MODEL",
              help="GGUF model file (only its header is read); default: the profile's model.")
@click.option("--profile", "-p", "profile", envvar="MTPWRAP_PROFILE",
              help="Take model, GPU, context, KV and speculation from this profile.")
@click.option("--gpu", default=None, envvar="MTPWRAP_GPU",
              help=f"GPU to plan for: {', '.join(KNOWN_GPUS)}, auto, or cpu (default: auto).")
@click.option("--context", "-c", "context", type=int, envvar="MTPWRAP_CONTEXT",
              help="Context length (default: the profile's, else the model's trained context).")
@click.option("--kv", "kv", default=None, envvar="MTPWRAP_KV",
              help="KV cache type for K and V (default: f16).")
@click.option("--spec", type=click.Choice(["mtp", "draft", "ngram", "none"]), default=None,
              envvar="MTPWRAP_SPEC", help="Speculative decoding kind (default: none).")
@click.option("--depth", type=int, default=None, envvar="MTPWRAP_SPEC_DEPTH",
              help="Draft depth (MTP keeps this many recurrent-state snapshots; default 3).")
@click.option("--kv-draft", default=None, envvar="MTPWRAP_KV_DRAFT",
              help="KV type of the MTP context (-ctkd/-ctvd; default f16).")
@click.option("--slots", type=int, default=None, envvar="MTPWRAP_SLOTS",
              help="Parallel slots (-np; default 1).")
@click.option("--ubatch", type=int, default=None, envvar="MTPWRAP_UBATCH",
              help="Micro-batch size (-ub; default 512).")
@click.option("--flash-attn/--no-flash-attn", default=None, envvar="MTPWRAP_FLASH_ATTN",
              help="Flash attention (default on).")
@click.option("--json", "as_json", is_flag=True, envvar="MTPWRAP_JSON",
              help="Print the plan as JSON.")
def command(model: str | None, profile: str | None, gpu: str | None, context: int | None,
            kv: str | None, spec: str | None, depth: int | None, kv_draft: str | None,
            slots: int | None, ubatch: int | None, flash_attn: bool | None,
            as_json: bool) -> None:
    """Plan memory for a model on a GPU: each buffer, verdict, largest context per KV type."""
    from mtpwrap import console
    from mtpwrap.decide.gguf_facts import read_facts
    from mtpwrap.decide.planner import (
        PlanConfig,
        largest_context,
        plan_with_limits,
        supported_kv_types,
    )

    kv_sizes = _kv_sizes()
    base: dict[str, Any] = _from_profile(profile, kv_sizes) if profile else {}
    flags = {"model": model, "gpu": gpu, "context": context, "kv": kv, "spec": spec,
             "depth": depth, "kv_draft": kv_draft, "slots": slots, "ubatch": ubatch,
             "flash_attn": flash_attn}
    s = {**{"gpu": "auto", "kv": "f16", "spec": "none", "depth": 3, "kv_draft": "f16",
            "slots": 1, "ubatch": 512, "batch": 2048, "flash_attn": True, "ngl": 999},
         **base, **{k: v for k, v in flags.items() if v is not None}}
    if not s.get("model"):
        raise ConfigError("--model or --profile is required: which GGUF should be planned?")
    from mtpwrap.decide.models import resolve_model

    path = resolve_model(s["model"]) if profile and not model else Path(s["model"])
    facts = read_facts(path)
    if str(s["gpu"]).lower() == "cpu":
        desc, device, backend = "CPU (host memory)", None, "cpu"
    else:
        desc, device, backend = gpu_memory(str(s["gpu"]))
    want_max = s.get("context") == "max"
    n_ctx = facts.n_ctx_train or 4096 if want_max or not s.get("context") else int(s["context"])
    cfg = PlanConfig(n_ctx=n_ctx, type_k=s["kv"], type_v=s["kv"], n_slots=s["slots"],
                     kv_unified=True, spec=s["spec"], draft_depth=s["depth"],
                     type_k_draft=s["kv_draft"], type_v_draft=s["kv_draft"],
                     ubatch=s["ubatch"], batch=s["batch"], flash_attn=s["flash_attn"],
                     n_gpu_layers=s["ngl"], backend=backend)
    if want_max and device is not None:
        # a profile's `context: max`: the largest context that fits this device
        from dataclasses import replace

        best = largest_context(facts, cfg, device, kv_sizes)
        cfg = replace(cfg, n_ctx=best or 256)
    types = list(kv_sizes) if kv_sizes else supported_kv_types()
    types = [t for t in types if t not in ("f32", "bf16")]
    p = plan_with_limits(facts, cfg, device, kv_sizes, kv_types=types)
    if as_json:
        d = p.to_dict()
        d["device"] = desc
        console.print_json(d)
        return
    for w in p.warnings:
        console.warn(w)
    title = (f"{path.name}: {facts.architecture}"
             f"{' (generic estimate)' if facts.generic else ''}, context {p.context:,}, "
             f"KV {cfg.type_k}"
             f"{', MTP depth ' + str(cfg.draft_depth) if cfg.spec == 'mtp' else ''}, {desc}")
    rows = [[r.name, r.where, _fmt(r.bytes), r.note] for r in p.rows]
    rows.append(["total on device", "gpu" if backend == "cuda" else "host", _fmt(p.total), ""])
    console.table(title, ["buffer", "where", "MiB", "detail"], rows)
    if device is None:
        console.out.print(f"host memory needed: {_fmt(p.total + p.host_total)} MiB")
        return
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    assert p.headroom is not None
    console.out.print(f"{verdict}: {_fmt(p.total)} MiB + {_fmt(cfg.margin)} MiB margin of "
                      f"{_fmt(device)} MiB; headroom {_fmt(p.headroom)} MiB")
    largest = ", ".join(f"{t} {n:,}" for t, n in p.largest_context.items())
    console.out.print(f"largest context that fits: {largest}")
