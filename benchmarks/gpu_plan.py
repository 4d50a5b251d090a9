"""The speed-only cells of the GPU check, planned to fit a lent GPU's lease.

A lent machine has no network, takes at most 64 MiB of carried files and is held for 15 minutes,
of which the check may use 10. Its cells: a shape-only Qwen3.6-27B (weight values mean nothing,
so no acceptance is measured and speculation is off), prompts of synthetic token ids filled to
32K and 128K tokens (262K where the budget allows), KV f16 / q8_0 / q4_0. Each cell's decode
tokens/s is set beside the roofline: memory bandwidth ÷ (weights + recurrent state + the KV
bytes one decoded token reads at that fill).

The expected seconds are estimates from stated assumptions (ASSUMED), so that the plan can be
checked before a machine is lent; the run records what each cell really took.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mtpwrap import proc
from mtpwrap.build import source
from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import ModelFacts

LEASE_S = 900
BUDGET_S = 600
CARRY_LIMIT = 64 * 2**20
KV_TYPES = ("f16", "q8_0", "q4_0")
CONTEXTS = (32_768, 131_072)
OPTIONAL_CONTEXTS = (262_144,)
N_PREDICT = 64

#: Conservative figures for one H200-class GPU running a 27B Q4_K_M model (llama.cpp CUDA).
ASSUMED = {
    "setup_s": 90,  # wheelhouse install, carried build install, writing the shape-only model
    "load_bytes_per_s": 1.5e9,  # model file into GPU memory
    "load_fixed_s": 20,  # llama-server start, graph reservation, /health
    "prefill_flops_per_s": 1.5e14,  # effective, weights and attention together
    "decode_fraction_of_roofline": 0.5,
    "bandwidth_bytes_per_s": 4.0e12,  # when no GPU is present to ask
}


#: One CUDA architecture of llama.cpp compiled on 2 cores took 29.5 min (the offline source's
#: sm_89, docs/measurements/2026-11-30-cuda-build.md): core-seconds per architecture, spread over
#: the lent machine's cores.
CUDA_COMPILE_CORE_S = 29.5 * 60 * 2
LENT_CORES = 16
CONFIGURE_S = 30
PREBUILT_INSTALL_S = 30

#: Distributions the lent machine's image holds (the device notes' package list, read
#: 2026-11-17) at versions mtpwrap accepts: a wheelhouse made for it (`make wheelhouse
#: WHEELS=lent`) leaves them out. Not here although the image has it: huggingface-hub (its 1.33
#: is older than the 2.x mtpwrap needs).
LENT_IMAGE_HAS = frozenset({
    "annotated-doc", "anyio", "certifi", "charset-normalizer", "click", "contourpy", "cycler",
    "filelock", "fonttools", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "idna",
    "kiwisolver", "markdown-it-py", "matplotlib", "mdurl", "numpy", "nvidia-ml-py", "packaging",
    "pillow", "prometheus-client", "psutil", "pygments", "pyparsing", "python-dateutil",
    "pyyaml", "requests", "rich", "shellingham", "six", "tqdm", "typer", "typing-extensions",
    "urllib3", "uvloop"})


def wheels(for_lent: bool) -> list[str]:
    """`name==version` of every distribution mtpwrap needs at run time (its requirements and
    theirs, as installed here; no extra: the `bench` extra's plots are skipped where it is
    missing), less what the lent image has when `for_lent`."""
    seen: dict[str, str] = {}
    todo = ["mtpwrap"]
    while todo:
        dist = metadata.distribution(todo.pop())
        for line in dist.requires or []:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            seen[name] = metadata.version(req.name)
            todo.append(req.name)
    return sorted(f"{n}=={v}" for n, v in seen.items()
                  if not (for_lent and n in LENT_IMAGE_HAS))


@dataclass(frozen=True)
class Cell:
    kv: str
    context: int
    expected_s: float
    kv_bytes_per_token: int  # of filled context, K and V of every attention layer
    roofline_tokens_per_s: float


def kv_bytes_per_token(facts: ModelFacts, t: str) -> int:
    """Bytes of K and V one token of context takes in the main KV cache."""
    total = 0
    for il in facts.kv_layers:
        k_vals, v_vals = facts.kv_row_values(il)
        total += kv.row_bytes(t, k_vals) + (kv.row_bytes(t, v_vals) if v_vals else 0)
    return total


def state_bytes(facts: ModelFacts) -> int:
    """Recurrent state (f32) read once per decoded token."""
    return 4 * len(facts.recurrent_layers) * (facts.recurrent_r_floats
                                              + facts.recurrent_s_floats)


def weight_bytes(facts: ModelFacts) -> int:
    """Weights a trunk token reads (MTP layers are not loaded with speculation off)."""
    return facts.tensor_bytes - facts.mtp_bytes


def roofline(facts: ModelFacts, t: str, fill: int, bandwidth: float) -> float:
    """Decode tokens/s ceiling: bandwidth ÷ bytes read per token at `fill` tokens of context."""
    per_token = weight_bytes(facts) + state_bytes(facts) + fill * kv_bytes_per_token(facts, t)
    return bandwidth / per_token


def _prefill_s(facts: ModelFacts, n: int) -> float:
    # 2 FLOPs per weight per token (about 4.85 bits a weight at Q4_K_M), plus attention: per
    # token at depth d, 4·d·heads·head size per attention layer; the mean depth is n/2.
    params = weight_bytes(facts) * 8 / 4.85
    heads = facts.n_head[facts.kv_layers[0]] if facts.kv_layers else 0
    attn = 4 * (n / 2) * heads * facts.head_dim_k * len(facts.kv_layers)
    return n * (2 * params + attn) / ASSUMED["prefill_flops_per_s"]


def plan(facts: ModelFacts, bandwidth: float | None = None, budget_s: float = BUDGET_S,
         contexts: tuple[int, ...] = CONTEXTS,
         optional: tuple[int, ...] = OPTIONAL_CONTEXTS) -> dict:
    """Cells in run order (one server per KV type, contexts ascending), the optional lengths
    kept only while the whole plan stays inside the budget."""
    bw = bandwidth or ASSUMED["bandwidth_bytes_per_s"]
    load_s = ASSUMED["load_fixed_s"] + weight_bytes(facts) / ASSUMED["load_bytes_per_s"]

    def cells_for(ctxs: tuple[int, ...]) -> list[Cell]:
        out = []
        for t in KV_TYPES:
            for i, n in enumerate(ctxs):
                roof = roofline(facts, t, n, bw)
                dec = N_PREDICT / (roof * ASSUMED["decode_fraction_of_roofline"])
                out.append(Cell(t, n, round((load_s if i == 0 else 0) + _prefill_s(facts, n)
                                            + dec, 1), kv_bytes_per_token(facts, t), roof))
        return out

    chosen = tuple(contexts)
    left_out: list[str] = []
    for n in optional:
        trial = cells_for(chosen + (n,))
        total = ASSUMED["setup_s"] + sum(c.expected_s for c in trial)
        if total <= budget_s:
            chosen += (n,)
        else:
            left_out.append(f"{n} tokens: the plan would take {total / 60:.1f} min,"
                            f" over the {budget_s / 60:.0f}-minute budget")
    cells = cells_for(chosen)
    total = ASSUMED["setup_s"] + sum(c.expected_s for c in cells)
    return {"cells": [asdict(c) for c in cells], "setup_s": ASSUMED["setup_s"],
            "expected_s": round(total, 1), "budget_s": budget_s, "lease_s": LEASE_S,
            "bandwidth_bytes_per_s": bw, "assumed": dict(ASSUMED), "left_out": left_out,
            "n_predict": N_PREDICT, "speculation": "off"}


def _bytes(root: Path, names: list[str]) -> int:
    """The size of the files `names` (relative to `root`) that are there."""
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def carry(repo: Path, tracked: list[str]) -> list[dict]:
    """What the machine needs carried (it has no network): the tracked tree, the runtime
    wheels (`make wheelhouse`) and a build made elsewhere (`.prebuilt/`), where present."""
    items = [{"path": ".", "bytes": _bytes(repo, tracked)}]
    for extra in (".wheelhouse", ".prebuilt"):
        d = repo / extra
        files = [f for f in d.rglob("*") if f.is_file()] if d.is_dir() else []
        items.append({"path": extra, "bytes": sum(f.stat().st_size for f in files),
                      "present": d.is_dir()})
    return items


def carry_line(items: list[dict[str, Any]]) -> str:
    """The carried total against the limit, part by part."""
    total = sum(i["bytes"] for i in items)
    parts = " + ".join(f"{i['path']} {i['bytes'] / 2**20:.1f}" for i in items if i["bytes"])
    verdict = "fits" if total <= CARRY_LIMIT else "does NOT fit"
    return (f"  carry: {parts} = {total / 2**20:.1f} MiB: {verdict} the"
            f" {CARRY_LIMIT // 2**20} MiB limit")


def _tree_bytes(tree: Path) -> int | None:
    """The size of a git tree's checked-out files (None: not a git tree)."""
    try:
        done = proc.run(["git", "-C", str(tree), "ls-files", "-z"], timeout=60)
    except proc.ProcError:
        return None
    return _bytes(tree, done.stdout.split("\0")) if done.returncode == 0 else None


def engine(repo: Path, carried: dict[str, Any] | None, carried_bytes: int | None,
           carry_items: list[dict[str, Any]]) -> dict[str, Any]:
    """Which llama-server the check runs on the lent machine, and what it costs: a carried
    `.prebuilt` build (`carried`: its manifest, as `build --from-prebuilt` installed it), else
    one compiled there from the source the checkout holds — the fork when the submodule is
    initialised at its pin (the recipe's engine), else the offline source."""
    pin = source.pinned_commit(repo)
    sub = source.submodule_source(repo)
    if carried is not None:
        src = carried.get("source") or {}
        fork = src.get("kind") == "submodule"
        return {"engine": "fork" if fork else "upstream", "how": "carried",
                "variant": carried.get("variant"), "commit": src.get("commit"),
                "bytes": carried_bytes, "expected_s": PREBUILT_INSTALL_S,
                "why": f"the carried {carried.get('variant')} build of the "
                       f"{'fork' if fork else 'offline source'} at {src.get('commit')}"}
    others = sum(i["bytes"] for i in carry_items if i["path"] != ".prebuilt")
    compile_s = CONFIGURE_S + CUDA_COMPILE_CORE_S / LENT_CORES
    if sub is not None and sub.pinned:
        size = _tree_bytes(sub.path) or 0
        fits = others + size <= CARRY_LIMIT
        return {"engine": "fork", "how": "built there", "commit": pin, "bytes": size,
                "expected_s": round(compile_s), "fits_carry": fits,
                "why": f"the submodule at the pin {pin[:12]}, compiled there for the GPU present"
                       + ("" if fits else
                          f"; but its {size / 2**20:.0f} MiB of sources and the "
                          f"{others / 2**20:.0f} MiB of checkout and wheels exceed the "
                          f"{CARRY_LIMIT // 2**20} MiB carry: carry a packed build instead "
                          "(`mtpwrap build --cuda-arch 90 --pack .prebuilt/cuda-sm90.tar.xz`)")}
    return {"engine": "upstream", "how": "built there", "commit": source.OFFLINE_COMMIT,
            "bytes": None, "expected_s": round(compile_s), "fits_carry": None,
            "why": "the submodule is not initialised, so the pinned offline source (it must be "
                   "in the cache: the lent machine has no network) is compiled there; the "
                   "recipe's engine is the fork: carry its packed build"}


def describe(p: dict) -> list[str]:
    """The plan as lines a person reads before lending the machine."""
    lines = [f"GPU speed-only cells: shape-only Qwen3.6-27B, synthetic token-id prompts,"
             f" speculation off, {p['n_predict']} tokens decoded per cell",
             f"  setup (wheels, build, model)   {p['setup_s'] / 60:5.1f} min"]
    for c in p["cells"]:
        lines.append(f"  KV {c['kv']:<5} fill {c['context']:>7}   {c['expected_s'] / 60:5.1f} min"
                     f"   roofline {c['roofline_tokens_per_s']:6.1f} t/s"
                     f" ({c['kv_bytes_per_token']} KV bytes per token of fill)")
    lines.append(f"  total {p['expected_s'] / 60:.1f} min of a {p['budget_s'] / 60:.0f}-minute"
                 f" budget inside the {p['lease_s'] / 60:.0f}-minute lease; bandwidth"
                 f" {p['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    lines += [f"  left out: {why}" for why in p["left_out"]]
    if p.get("carry"):
        lines.append(carry_line(p["carry"]))
    e = p.get("engine")
    if e:
        size = f", {e['bytes'] / 2**20:.1f} MiB" if e.get("bytes") else ""
        lines.append(f"  engine: {e['engine']} ({e['how']}{size}), {e['expected_s'] / 60:.1f} min:"
                     f" {e['why']}")
        first = e["expected_s"] + p["expected_s"]
        rerun = p["expected_s"]  # a warm machine keeps the build
        fits = first + rerun <= p["lease_s"]
        lines.append(f"  lease: {first / 60:.1f} min for the first run, {rerun / 60:.1f} min for"
                     f" a rerun: {'fits' if fits else 'does NOT fit'} the"
                     f" {p['lease_s'] / 60:.0f}-minute lease with room for a rerun")
    return lines
