"""What the built binary really allocates: KV bytes per cache type, and buffer sizes from its log.

Fork cache types have no standard size (one fork's `tbq4_0` is 4.125 bits per value, another's
5.25), so each type the binary accepts is sized by running it: `llama-fit-params` on a tiny model
with `-ctk T -ctv T` prints the KV buffer it would allocate (no memory is allocated, it takes a
fraction of a second). The result is stored in the build manifest under `kv_type_sizes`.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap import proc
from mtpwrap.build import probe, tiny_gguf, trial
from mtpwrap.build.manifest import load_manifest, update_manifest
from mtpwrap.decide import launch
from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.errors import MissingToolError, RuntimeFailure
from mtpwrap.units import MiB

#: values per "block" in the stored sizes: every ggml block size divides 256, so bytes per 256
#: values is an integer for every real type.
CAL_BLOCK = 256
#: large enough that the log's two-decimal MiB figures are exact for every block type
_CAL_CELLS = 131072

_KV_SIZE = re.compile(
    r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers,\s+(\d+)/\s*(\d+) "
    r"seqs\), K \((\S+)\):\s+([\d.]+) MiB, V \((\S+)\):\s+([\d.]+) MiB")
_RS_SIZE = re.compile(r"llama_memory_recurrent: size =\s+([\d.]+) MiB")
_BREAKDOWN = re.compile(r"memory_breakdown_print: \|\s+- (.+?)\s*\|[^|=]*?(\d+) =\s+(\d+) "
                        r"\+\s+(\d+) \+\s+(\d+)")
_MODEL_BUF = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_COMPUTE_BUF = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_OUTPUT_BUF = re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB")


@dataclass
class Allocations:
    """Buffers llama.cpp reported, in bytes.

    KV, recurrent state and compute come from the `llama_kv_cache: size =`,
    `llama_memory_recurrent: size =` and `sched_reserve` lines (MiB with two decimals, ±5 KiB);
    the weights from the memory breakdown table (whole MiB, ±1 MiB per buffer type), because
    llama-fit-params loads without allocating and logs 0.00 MiB model buffers.
    """

    model: dict[str, int] = field(default_factory=dict)
    #: KV bytes per context, in log order (main first, then an MTP/draft context)
    kv: list[int] = field(default_factory=list)
    kv_detail: list[dict[str, Any]] = field(default_factory=list)
    recurrent: list[int] = field(default_factory=list)
    compute: dict[str, int] = field(default_factory=dict)
    #: per context, in log order (main first, then an MTP/draft context): largest compute buffer
    compute_per_context: list[int] = field(default_factory=list)
    output: int = 0

    @property
    def model_total(self) -> int:
        return sum(self.model.values())

    @property
    def kv_total(self) -> int:
        return sum(self.kv)

    @property
    def recurrent_total(self) -> int:
        return sum(self.recurrent)

    @property
    def compute_total(self) -> int:
        """The main context's compute buffer."""
        if self.compute_per_context:
            return self.compute_per_context[0]
        return sum(self.compute.values())


def _b(mib: str) -> int:
    return int(round(float(mib) * MiB))


def parse_allocations(log: str) -> Allocations:
    """Read model, KV, recurrent-state, compute and output buffers from a `-lv 4` log."""
    a = Allocations()
    for m in _MODEL_BUF.finditer(log):
        a.model[m.group(1)] = a.model.get(m.group(1), 0) + _b(m.group(2))
    if not any(a.model.values()):  # no_alloc load: take the breakdown table's model column
        a.model = {m.group(1): int(m.group(3)) * MiB for m in _BREAKDOWN.finditer(log)}
    for m in _KV_SIZE.finditer(log):
        a.kv_detail.append({"cells": int(m.group(2)), "layers": int(m.group(3)),
                            "streams": int(m.group(4)), "type_k": m.group(6),
                            "k": _b(m.group(7)), "type_v": m.group(8), "v": _b(m.group(9))})
    a.recurrent = [_b(m.group(1)) for m in _RS_SIZE.finditer(log)]
    for m in _COMPUTE_BUF.finditer(log):
        a.compute[m.group(1)] = max(a.compute.get(m.group(1), 0), _b(m.group(2)))
    # Each context logs its output buffer first, then its caches (two for sliding-window
    # models: full and SWA) and its compute reservations; split the log there.
    outs = list(_OUTPUT_BUF.finditer(log))
    a.output = _b(outs[0].group(2)) if outs else 0
    bounds = [m.start() for m in outs] + [len(log)]
    if not outs:
        bounds = [0, len(log)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        seg = log[lo:hi]
        caches = [_b(m.group(7)) + _b(m.group(9)) for m in _KV_SIZE.finditer(seg)]
        if caches:
            a.kv.append(sum(caches))
        sizes = [_b(m.group(2)) for m in _COMPUTE_BUF.finditer(seg)]
        if sizes:
            a.compute_per_context.append(max(sizes))
    return a


def fit_params_binary(binary: Path) -> Path:
    """llama-fit-params next to a llama-server (or the path itself when it is fit-params)."""
    binary = Path(binary)
    if binary.name.startswith("llama-fit-params"):
        return binary
    cand = binary.with_name("llama-fit-params")
    if not cand.is_file():
        raise MissingToolError(f"{cand}: llama-fit-params is missing next to {binary.name}; "
                               "rebuild with `mtpwrap build` (it builds both targets).")
    return cand


def accepted_cache_types(binary: Path, timeout: float = 30) -> list[str]:
    """The `-ctk` values the binary lists in --help ("allowed values: f32, f16, ...")."""

    caps = probe.probe(binary, timeout=timeout)
    flag = caps.first_of(("-ctk", "--cache-type-k"))
    if flag is None:
        raise RuntimeFailure(f"{binary}: --help does not list --cache-type-k; is this a "
                             "llama.cpp server binary?")
    allowed = caps.allowed(flag)
    if not allowed:
        raise RuntimeFailure(f"{binary}: --help lists no allowed values for --cache-type-k.")
    return list(allowed)


def run_fit_params(fit_bin: Path, model: Path, args: list[str], timeout: float = 300) -> str:
    """Run llama-fit-params at debug verbosity on the CPU and return its whole log."""
    # -v: the loader's per-buffer lines are only logged at debug verbosity in llama-fit-params
    cmd = [str(fit_bin), "-m", str(model), "-v", *args]
    done = proc.run(cmd, timeout=timeout)
    log = done.stdout + done.stderr
    if done.returncode != 0 and "llama_kv_cache: size" not in log:
        tail = " | ".join(log.strip().splitlines()[-3:])
        raise RuntimeFailure(f"{fit_bin.name} failed on {model.name} with {' '.join(args)}: "
                             f"{tail}")
    return log


def fit_params_launch(fit_bin: Path, cl: Any) -> launch.ChildCommand:
    """A launch as llama-fit-params takes it; what it lacks (and does not size memory) is left
    out and named in `dropped`."""
    return launch.render(cl, probe.probe(fit_bin), binary=fit_bin, serve=False)


def fit_params_args(fit_bin: Path, cl: Any) -> list[str]:
    """The flags of a launch as llama-fit-params takes them (after its -m MODEL)."""
    return fit_params_launch(fit_bin, cl).argv[3:]


def measure_kv_type(fit_bin: Path, model: Path, cache_type: str, n_values_per_cell: int) -> int:
    """Bytes per CAL_BLOCK values of cache_type, from the K buffer llama.cpp reports."""
    args = fit_params_args(fit_bin, launch.plain(model, context=_CAL_CELLS, cache=cache_type,
                                                 flash_attn="on", gpu_layers=0,
                                                 why="KV type calibration"))
    log = run_fit_params(fit_bin, model, args)
    details = parse_allocations(log).kv_detail
    if not details:
        raise RuntimeFailure(f"{fit_bin.name}: no KV cache line for type {cache_type}.")
    d = details[0]
    values = d["cells"] * d["layers"] * d["streams"] * n_values_per_cell
    return int(round((d["k"] + d["v"]) * CAL_BLOCK / (2 * values)))


def kv_type_sizes(binary: Path, types: list[str] | None = None) -> dict[str, dict[str, int]]:
    """{type: {"block": 256, "bytes": B}} for each cache type the binary accepts."""

    fit_bin = fit_params_binary(binary)
    types = types or accepted_cache_types(binary)
    with tempfile.TemporaryDirectory(prefix="mtpwrap-cal-") as tmp:
        model = tiny_gguf.write_tiny_random(Path(tmp) / "cal.gguf", arch="llama")
        facts = read_facts(model)
        nk, _ = facts.kv_row_values(facts.kv_layers[0])
        sizes: dict[str, dict[str, int]] = {}
        for t in types:
            try:
                sizes[t] = {"block": CAL_BLOCK, "bytes": measure_kv_type(fit_bin, model, t, nk)}
            except RuntimeFailure:
                continue  # a type the binary lists but cannot use for this head size
    return sizes


def load_kv_sizes(manifest: Any) -> dict[str, dict[str, int]] | None:
    """kv_type_sizes from a manifest (object or dict), if calibration has run."""
    if manifest is None:
        return None
    d = manifest if isinstance(manifest, dict) else manifest.to_dict()
    sizes = (d.get("extra") or {}).get("kv_type_sizes") or d.get("kv_type_sizes")
    return sizes or None


def plan_launch(model: Path, cfg: Any, *, server: bool) -> Any:
    """The launch that reproduces a planner.PlanConfig on the CPU, to measure what llama.cpp
    allocates for it.

    llama-fit-params has no -kvu/-no-kvu: it always uses per-slot streams (llama.cpp's default
    when -np is given), so a unified multi-slot config can be measured only with llama-server.
    """

    if cfg.n_slots > 1 and not server and cfg.kv_unified:
        raise ValueError("llama-fit-params cannot measure a unified KV pool with -np > 1")
    spec: dict[str, Any] = {}
    if cfg.spec == "mtp":
        spec = {"spec": "mtp", "spec_type": "draft-mtp", "depth": cfg.draft_depth,
                "draft_k": cfg.type_k_draft, "draft_v": cfg.type_v_draft}
    return dataclasses.replace(
        launch.plain(model, context=cfg.n_ctx, slots=cfg.n_slots, why="planner check",
                     flash_attn="on" if cfg.flash_attn else "off", ubatch=cfg.ubatch,
                     batch=cfg.batch,
                     kv_unified=(cfg.kv_unified if server and cfg.n_slots > 1 else None),
                     repack=None if getattr(cfg, "cpu_repack", True) else False, **spec),
        cache_k=cfg.type_k, cache_v=cfg.type_v)


def measure_config(fit_bin: Path, model: Path, cfg: Any, timeout: float = 300
                   ) -> Allocations:
    """What llama.cpp itself would allocate for cfg on the CPU (llama-fit-params, no allocation)."""
    args = fit_params_args(fit_bin, plan_launch(Path(model), cfg, server=False))
    return parse_allocations(run_fit_params(Path(fit_bin), Path(model), args, timeout=timeout))


def measure_server(server_bin: Path, model: Path, cfg: Any, timeout: float = 300
                   ) -> tuple[Allocations, str]:
    """Start llama-server for cfg (no warmup, no fit), read its allocations, stop it.

    Unlike llama-fit-params this shows the MTP context (its KV and compute buffers) and the
    server's own output reservation (slots × (1 + draft depth) logits rows, not a whole ubatch).
    The weights are memory-mapped; with --no-warmup nothing computes, so a shape-only model's
    holes are only read by the loader's prefetch. Pass cfg.cpu_repack=False for big models:
    repacking copies every quantized weight into RAM. It listens where every temporary server
    does (`mtpwrap.build.trial`: its own UNIX socket when the binary binds one).
    """

    caps = probe.probe(server_bin)
    cl = dataclasses.replace(plan_launch(Path(model), cfg, server=True), fit="off",
                             no_warmup=True, threads=2, verbosity=4)
    with tempfile.TemporaryDirectory(prefix="mtpwrap-cal-") as tmp:
        try:
            with trial.running(cl, caps, binary=server_bin, ready="listening", timeout=timeout,
                               what=server_bin.name, log_path=Path(tmp) / "server.log") as srv:
                pass
        except RuntimeFailure as exc:
            raise RuntimeFailure(f"{server_bin.name} did not start on {model.name}: "
                                 f"{exc.message}") from None
        text = srv.log_text()
    return parse_allocations(text), text


def calibrate_build(variant: str | None = None, force: bool = False) -> dict[str, dict[str, int]]:
    """Measure the installed build's cache types once and keep them in its manifest."""
    manifest = load_manifest(variant)
    if manifest is None:
        raise MissingToolError("no built llama-server to calibrate.", hint="Run `mtpwrap build`.")
    cached = load_kv_sizes(manifest)
    if cached and not force:
        return cached
    sizes = kv_type_sizes(manifest.binary("llama-server"))
    update_manifest(manifest, kv_type_sizes=sizes)
    return sizes
