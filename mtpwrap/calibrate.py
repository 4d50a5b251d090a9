"""What the built binary really allocates: KV bytes per cache type, and buffer sizes from its log.

Fork cache types have no standard size (one fork's `tbq4_0` is 4.125 bits per value, another's
5.25), so each type the binary accepts is sized by running it: `llama-fit-params` on a tiny model
with `-ctk T -ctv T` prints the KV buffer it would allocate (no memory is allocated, it takes a
fraction of a second). The result is stored in the build manifest under `kv_type_sizes`.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.errors import MissingToolError, RuntimeFailure

MiB = 1024 * 1024
#: values per "block" in the stored sizes: every ggml block size divides 256, so bytes per 256
#: values is an integer for every real type.
CAL_BLOCK = 256
_CAL_CELLS = 16384

_KV_BUF = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
_KV_SIZE = re.compile(
    r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers,\s+(\d+)/\s*(\d+) "
    r"seqs\), K \((\S+)\):\s+([\d.]+) MiB, V \((\S+)\):\s+([\d.]+) MiB")
_RS_BUF = re.compile(r"llama_memory_recurrent:\s+(\S+) RS buffer size =\s+([\d.]+) MiB")
_MODEL_BUF = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_COMPUTE_BUF = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_OUTPUT_BUF = re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB")
_ALLOWED = re.compile(r"allowed values:\s*([^\n]+)")


@dataclass
class Allocations:
    """Buffers llama.cpp reported, in bytes (from MiB with two decimals: ±5 KiB each)."""

    model: dict[str, int] = field(default_factory=dict)
    kv: list[int] = field(default_factory=list)
    kv_detail: list[dict[str, Any]] = field(default_factory=list)
    recurrent: list[int] = field(default_factory=list)
    compute: dict[str, int] = field(default_factory=dict)
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
        return sum(self.compute.values())


def _b(mib: str) -> int:
    return int(round(float(mib) * MiB))


def parse_allocations(log: str) -> Allocations:
    """Read model, KV, recurrent-state, compute and output buffers from a `-lv 4` log."""
    a = Allocations()
    for m in _MODEL_BUF.finditer(log):
        a.model[m.group(1)] = a.model.get(m.group(1), 0) + _b(m.group(2))
    a.kv = [_b(m.group(2)) for m in _KV_BUF.finditer(log)]
    for m in _KV_SIZE.finditer(log):
        a.kv_detail.append({"cells": int(m.group(2)), "layers": int(m.group(3)),
                            "streams": int(m.group(4)), "type_k": m.group(6),
                            "k": _b(m.group(7)), "type_v": m.group(8), "v": _b(m.group(9))})
    a.recurrent = [_b(m.group(2)) for m in _RS_BUF.finditer(log)]
    for m in _COMPUTE_BUF.finditer(log):
        a.compute[m.group(1)] = max(a.compute.get(m.group(1), 0), _b(m.group(2)))
    a.output = sum(_b(m.group(2)) for m in _OUTPUT_BUF.finditer(log))
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
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                         timeout=timeout, check=False)
    text = out.stdout + out.stderr
    idx = text.find("--cache-type-k")
    if idx < 0:
        raise RuntimeFailure(f"{binary}: --help does not list --cache-type-k; is this a "
                             "llama.cpp server binary?")
    m = _ALLOWED.search(text, idx)
    if not m:
        raise RuntimeFailure(f"{binary}: --help lists no allowed values for --cache-type-k.")
    return [t.strip() for t in m.group(1).split(",") if t.strip()]


def run_fit_params(fit_bin: Path, model: Path, args: list[str], timeout: float = 300) -> str:
    """Run llama-fit-params at verbosity 4 on the CPU and return its whole log."""
    cmd = [str(fit_bin), "-m", str(model), "-lv", "4", "--fit", "off", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 and "KV buffer size" not in log:
        tail = " | ".join(log.strip().splitlines()[-3:])
        raise RuntimeFailure(f"{fit_bin.name} failed on {model.name} with {' '.join(args)}: "
                             f"{tail}")
    return log


def measure_kv_type(fit_bin: Path, model: Path, cache_type: str, n_values_per_cell: int
                    ) -> int:
    """Bytes per CAL_BLOCK values of cache_type, from the K buffer llama.cpp reports."""
    log = run_fit_params(fit_bin, model, ["-c", str(_CAL_CELLS), "-ctk", cache_type,
                                          "-ctv", cache_type, "-fa", "on", "-np", "1",
                                          "-ngl", "0"])
    details = parse_allocations(log).kv_detail
    if not details:
        raise RuntimeFailure(f"{fit_bin.name}: no KV cache line for type {cache_type}.")
    d = details[0]
    values = d["cells"] * d["layers"] * d["streams"] * n_values_per_cell
    return int(round(d["k"] * CAL_BLOCK / values))


def kv_type_sizes(binary: Path, model: Path | None = None,
                  types: list[str] | None = None) -> dict[str, dict[str, int]]:
    """{type: {"block": 256, "bytes": B}} for each cache type the binary accepts."""
    from mtpwrap import gguf_writer
    from mtpwrap.gguf_facts import read_facts

    fit_bin = fit_params_binary(binary)
    types = types or accepted_cache_types(binary)
    with tempfile.TemporaryDirectory(prefix="mtpwrap-cal-") as tmp:
        if model is None:
            model = gguf_writer.write_tiny_random(Path(tmp) / "cal.gguf", arch="llama")
        facts = read_facts(model)
        nk, _ = facts.kv_row_values(facts.kv_layers[0])
        sizes: dict[str, dict[str, int]] = {}
        for t in types:
            try:
                sizes[t] = {"block": CAL_BLOCK, "bytes": measure_kv_type(fit_bin, model, t, nk)}
            except RuntimeFailure:
                continue  # a type the binary lists but cannot use for this head size
    return sizes


def store_in_manifest(sizes: dict[str, dict[str, int]], variant: str | None = None) -> bool:
    """Save sizes under `kv_type_sizes` in the build manifest; False when there is no build."""
    from mtpwrap import build

    manifest = build.load_manifest(variant)
    if manifest is None:
        return False
    build.update_manifest(manifest, kv_type_sizes=sizes)
    return True


def load_kv_sizes(manifest: Any) -> dict[str, dict[str, int]] | None:
    """kv_type_sizes from a manifest (object or dict), if calibration has run."""
    if manifest is None:
        return None
    d = manifest if isinstance(manifest, dict) else manifest.to_dict()
    sizes = (d.get("extra") or {}).get("kv_type_sizes") or d.get("kv_type_sizes")
    return sizes or None
