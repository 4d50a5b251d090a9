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
    """The first GPU's free memory, from the hardware snapshot or NVML."""
    try:
        from mtpwrap import hardware  # type: ignore[attr-defined]

        snap = hardware.snapshot()
        gpus = getattr(snap, "gpus", None) or []
        if gpus:
            g = gpus[0]
            free = getattr(g, "memory_free", None) or getattr(g, "free_bytes", None)
            if free:
                return str(getattr(g, "name", "GPU 0")), int(free), "cuda"
    except ImportError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            free = pynvml.nvmlDeviceGetMemoryInfo(h).free
        finally:
            pynvml.nvmlShutdown()
        return (name.decode() if isinstance(name, bytes) else str(name)), int(free), "cuda"
    except Exception as err:  # noqa: BLE001 - NVML raises its own error family
        raise ConfigError("--gpu auto: no NVIDIA GPU found (NVML unavailable); name one with "
                          f"--gpu ({', '.join(KNOWN_GPUS)}).") from err


def _kv_sizes() -> dict[str, Any] | None:
    try:
        from mtpwrap import build
        from mtpwrap.calibrate import load_kv_sizes

        return load_kv_sizes(build.load_manifest())
    except (ImportError, MissingToolError, OSError, ValueError):
        return None


def _fmt(n: int) -> str:
    return f"{n / MiB:,.0f}"


@click.command("plan")
@click.option("--model", "-m", "model", required=True, envvar="MTPWRAP_MODEL",
              help="GGUF model file (only its header is read).")
@click.option("--gpu", default="auto", show_default=True, envvar="MTPWRAP_GPU",
              help=f"GPU to plan for: {', '.join(KNOWN_GPUS)}, auto, or cpu.")
@click.option("--context", "-c", "context", type=int, envvar="MTPWRAP_CONTEXT",
              help="Context length (default: the model's trained context).")
@click.option("--kv", "kv", default="f16", show_default=True, envvar="MTPWRAP_KV",
              help="KV cache type for K and V.")
@click.option("--spec", type=click.Choice(["mtp", "draft", "ngram", "none"]), default="none",
              show_default=True, envvar="MTPWRAP_SPEC", help="Speculative decoding kind.")
@click.option("--depth", type=int, default=3, show_default=True, envvar="MTPWRAP_SPEC_DEPTH",
              help="Draft depth (MTP keeps this many recurrent-state snapshots).")
@click.option("--kv-draft", default="f16", show_default=True, envvar="MTPWRAP_KV_DRAFT",
              help="KV type of the MTP context (-ctkd/-ctvd).")
@click.option("--slots", type=int, default=1, show_default=True, envvar="MTPWRAP_SLOTS",
              help="Parallel slots (-np).")
@click.option("--ubatch", type=int, default=512, show_default=True, envvar="MTPWRAP_UBATCH",
              help="Micro-batch size (-ub).")
@click.option("--flash-attn/--no-flash-attn", default=True, show_default=True,
              envvar="MTPWRAP_FLASH_ATTN", help="Flash attention.")
@click.option("--json", "as_json", is_flag=True, envvar="MTPWRAP_JSON",
              help="Print the plan as JSON.")
def command(model: str, gpu: str, context: int | None, kv: str, spec: str, depth: int,
            kv_draft: str, slots: int, ubatch: int, flash_attn: bool, as_json: bool) -> None:
    """Plan memory for a model on a GPU: each buffer, verdict, largest context per KV type."""
    from mtpwrap import console
    from mtpwrap.gguf_facts import read_facts
    from mtpwrap.planner import PlanConfig, plan_with_limits, supported_kv_types

    facts = read_facts(Path(model))
    if gpu.lower() == "cpu":
        desc, device, backend = "CPU (host memory)", None, "cpu"
    else:
        desc, device, backend = gpu_memory(gpu)
    kv_sizes = _kv_sizes()
    cfg = PlanConfig(n_ctx=context or facts.n_ctx_train or 4096, type_k=kv, type_v=kv,
                     n_slots=slots, kv_unified=True, spec=spec, draft_depth=depth,
                     type_k_draft=kv_draft, type_v_draft=kv_draft, ubatch=ubatch,
                     flash_attn=flash_attn, backend=backend)
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
    title = (f"{Path(model).name}: {facts.architecture}, context {p.context:,}, KV {kv}"
             f"{', MTP depth ' + str(depth) if spec == 'mtp' else ''}, {desc}")
    rows = [[r.name, r.where, _fmt(r.bytes), r.note] for r in p.rows]
    rows.append(["total on device", "gpu" if backend == "cuda" else "host", _fmt(p.total), ""])
    console.table(title, ["buffer", "where", "MiB", "detail"], rows)
    if device is None:
        console.out.print(f"host memory needed: {p.total + p.host_total:,} bytes")
        return
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    assert p.headroom is not None
    console.out.print(f"{verdict}: {_fmt(p.total)} MiB + {_fmt(cfg.margin)} MiB margin of "
                      f"{_fmt(device)} MiB; headroom {_fmt(p.headroom)} MiB")
    largest = ", ".join(f"{t} {n:,}" for t, n in p.largest_context.items())
    console.out.print(f"largest context that fits: {largest}")
