"""Draft depth per request class: each static depth against the adaptive policy, in one run.

A mixed workload (Korean legal text from the pinned konlpy corpus, English licence texts from
/usr/share/common-licenses, C++ from the pinned offline llama.cpp source) is served by one
patched llama-server (it must honour `speculative.n_max`; see patches/llama.cpp) at each static
draft depth (0, 1, 2, 3, 4, 8) and with front/depth_policy's adaptive policy, request by request in
rotating order, so every configuration sees the same machine load. Depth 0 is run twice ("0'")
and the difference between the two is printed as the noise.

On the CPU the draft is not the target itself (with itself as draft every class accepts ~100 %):
`--spec draft` uses the demo model requantized to Q2_K by the build's llama-quantize; `--spec
ngram` uses ngram-simple. On a GPU, `--spec mtp --model FILE` uses the model's own MTP head
(benchmarks/gpu_check.sh runs it when ADAPTIVE_SPEC_MODEL names such a GGUF).

The adaptive policy's cost model (overhead a, per-draft cost c) is fitted first on a short
calibration (stats.fit_step_cost, as `mtpwrap tune` does), from prompts that are not in the
workload.

Printed: tokens/s (decode: predicted tokens ÷ the server's predicted_ms) per class and overall per
configuration, side by side, and the adaptive policy's choices over time per class.

    python benchmarks/adaptive_spec.py [--spec draft|ngram|mtp] [--model GGUF] [--per-class N]
                                       [--json OUT]

The binary and model come from MTPWRAP_BINARY / MTPWRAP_DEMO_MODEL, else from mtpwrap's
build and models modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpwrap import proc
from mtpwrap.bench import corpora, stats
from mtpwrap.build import manifest as build_manifest
from mtpwrap.build import spec_probe
from mtpwrap.build.binary import find_binary
from mtpwrap.build.probe import probe
from mtpwrap.decide import launch
from mtpwrap.decide.profile_types import SpecAdapt
from mtpwrap.front.depth_policy import DepthPolicy
from mtpwrap.models.known import ensure_demo_model
from mtpwrap.proc import free_loopback_port, running_server

STATIC = (0, 1, 2, 3, 4, 8)
SERVER_DEPTH = 8
N_PREDICT = 32
_TAG = {"learned": "L", "probe": "P", "profile": "T", "default": "D", "client": "C"}


def workload(per_class: int, skip: int = 0) -> dict[str, list[str]]:
    return corpora.class_workload(per_class, skip)


def quantized_draft(model: Path, work: Path) -> Path:
    """The demo model requantized to Q2_K with the build's llama-quantize."""
    out = work / (model.stem + ".Q2_K-draft.gguf")
    if out.is_file():
        return out
    manifest = build_manifest.load_manifest("cpu")
    if manifest is None or "llama-quantize" not in manifest.binaries:
        raise SystemExit("no llama-quantize in the CPU build: run `mtpwrap build --cpu`.")
    proc.run([str(manifest.binary("llama-quantize")), "--allow-requantize", str(model),
              str(out), "Q2_K"], timeout=1800, check=True)
    return out


def ask(base: str, prompt: str, extra: dict[str, Any]) -> dict[str, float]:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "cache_prompt": False,
            "ignore_eos": True, **extra}
    r = httpx.post(base + "/completion", json=body, timeout=600, trust_env=False)
    r.raise_for_status()
    t = r.json()["timings"]
    return {k: float(t.get(k, 0)) for k in ("predicted_n", "predicted_ms", "draft_n",
                                             "draft_n_accepted")}


def calibrate(base: str, prompts: list[str]) -> tuple[float, float]:
    """(a, c) of the verification step's cost r(k) = a + c·k, in depth-0 decode steps."""
    base_ms = sum(ask(base, p, {"speculative.n_max": 0})["predicted_ms"] for p in prompts)
    base_n = N_PREDICT * len(prompts)
    per_token = base_ms / base_n
    points: list[tuple[int, float]] = []
    for k in (1, 2, 4):
        for p in prompts:
            t = ask(base, p, {"speculative.n_max": k})
            steps = t["predicted_n"] - t["draft_n_accepted"]
            if steps > 0:
                points.append((k, (t["predicted_ms"] / steps) / per_token))
    return stats.fit_step_cost(points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", choices=("draft", "ngram", "mtp"), default="draft")
    ap.add_argument("--model", type=Path, help="the target model (default: the demo model)")
    ap.add_argument("--per-class", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    binary = Path(os.environ.get("MTPWRAP_BINARY") or find_binary())
    model = args.model or ensure_demo_model()  # honours MTPWRAP_DEMO_MODEL
    work = Path(tempfile.gettempdir()) / "mtpwrap-adaptive-spec"
    work.mkdir(exist_ok=True)
    spec: dict[str, Any] = {"depth": SERVER_DEPTH}
    if args.spec == "draft":
        draft = quantized_draft(model, work)
        spec.update(spec="draft", spec_type="draft-simple", draft_model=str(draft))
        what = f"draft-simple, draft {draft.name}"
    elif args.spec == "mtp":
        spec.update(spec="mtp", spec_type="draft-mtp", gpu_layers=99)
        what = "draft-mtp (the model's MTP head)"
    else:
        spec.update(spec="ngram", spec_type="ngram-simple")
        what = "ngram-simple"
    port = free_loopback_port()
    base = f"http://127.0.0.1:{port}"
    cfg = launch.plain(model, context=4096, threads=2, why="adaptive speculation benchmark",
                       **spec)
    argv = launch.render(cfg, probe(binary), binary=binary, port=port).argv
    load = workload(args.per_class)
    calib = workload(1, skip=args.per_class)
    with running_server(argv, base_url=base, timeout=300) as srv:
        with srv.client(timeout=120.0) as http:
            probe_default, _ = spec_probe.draft_counts(http, {})
            probe_zero, _ = spec_probe.draft_counts(http, {"speculative.n_max": 0})
        if spec_probe.verdict(probe_default, probe_zero) == "ignored":
            raise SystemExit(f"{binary} does not honour speculative.n_max (drafted "
                             f"{probe_zero} with n_max 0): build it with the patch set.")
        a, c = calibrate(base, [p for ps in calib.values() for p in ps])
        policy = DepthPolicy(
            supported=True, server_depth=SERVER_DEPTH,
            adapt=SpecAdapt(overhead=max(a, 0.1), per_draft=max(c, 0.0), probe_share=0.1,
                            half_life_tokens=128.0))
        configs = [str(d) for d in STATIC] + ["0'", "adaptive"]
        totals = {cfg: {cls: [0.0, 0.0] for cls in load} for cfg in configs}
        timeline: dict[str, list[str]] = {cls: [] for cls in load}
        order = [(cls, p) for i in range(args.per_class) for cls, ps in load.items()
                 if i < len(ps) for p in [ps[i]]]
        started = time.monotonic()
        for n, (cls, prompt) in enumerate(order):
            print(f"prompt {n + 1}/{len(order)} ({cls}), {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
            rotated = configs[n % len(configs):] + configs[:n % len(configs)]
            for cfg in rotated:
                if cfg == "adaptive":
                    doc = {"prompt": prompt}
                    d = policy.decide(doc)
                    extra = {} if d.depth is None else {"speculative.n_max": d.depth}
                    t = ask(base, prompt, extra)
                    policy.observe(d, int(t["draft_n"]), int(t["draft_n_accepted"]))
                    timeline[d.cls].append(f"{d.effective_depth}{_TAG[d.source]}")
                    if d.cls != cls:
                        print(f"note: a {cls} prompt was classified {d.cls}")
                else:
                    depth = int(cfg.rstrip("'"))
                    t = ask(base, prompt, {"speculative.n_max": depth})
                acc = totals[cfg][cls]
                acc[0] += t["predicted_n"]
                acc[1] += t["predicted_ms"]
        seconds = time.monotonic() - started

    def tps(cfg: str, cls: str | None = None) -> float:
        rows = [totals[cfg][cls]] if cls else list(totals[cfg].values())
        n = sum(r[0] for r in rows)
        ms = sum(r[1] for r in rows)
        return n / (ms / 1000) if ms else 0.0

    classes = list(load)
    print(f"adaptive speculation benchmark: {binary} ({what}), model {model.name}, "
          f"{args.per_class} prompts per class, {N_PREDICT} tokens each, {seconds:.0f} s")
    print(f"fitted step cost: a = {a:.3f}, c = {c:.3f} (depth-0 decode steps)")
    head = f"{'config':>9} " + " ".join(f"{c:>10}" for c in classes) + f" {'overall':>10}"
    print("decode tokens/s (predicted tokens ÷ predicted_ms)")
    print(head)
    for cfg in configs:
        print(f"{cfg:>9} " + " ".join(f"{tps(cfg, c):>10.1f}" for c in classes)
              + f" {tps(cfg):>10.1f}")
    noise = {c: abs(tps("0", c) - tps("0'", c)) / max(1e-9, (tps("0", c) + tps("0'", c)) / 2)
             for c in classes}
    print("noise (depth 0 run twice, relative difference): "
          + ", ".join(f"{c} {v:.1%}" for c, v in noise.items()))
    static_cfgs = [str(d) for d in STATIC]
    for cls in classes:
        best = max(static_cfgs, key=lambda cfg, cls=cls: tps(cfg, cls))
        print(f"{cls}: best static depth {best} at {tps(best, cls):.1f} t/s, adaptive "
              f"{tps('adaptive', cls):.1f} ({tps('adaptive', cls) / tps(best, cls) - 1:+.1%})")
    best_all = max(static_cfgs, key=tps)
    print(f"overall: best single static depth {best_all} at {tps(best_all):.1f} t/s, adaptive "
          f"{tps('adaptive'):.1f} ({tps('adaptive') / tps(best_all) - 1:+.1%})")
    print("adaptive choices over time (depth + source: L learned, P probe, D nothing sent, "
          "the server's depth):")
    for cls in classes:
        print(f"  {cls:>9}: {' '.join(timeline[cls])}")
    snap = policy.snapshot()["classes"]
    print("final estimates: " + ", ".join(
        f"{c} α={snap[c]['alpha']} depth={snap[c]['depth']}" for c in classes))
    if args.json:
        args.json.write_text(json.dumps({
            "binary": str(binary), "spec": what, "step_cost": {"a": a, "c": c},
            "tokens_per_s": {cfg: {**{cl: tps(cfg, cl) for cl in classes},
                                   "overall": tps(cfg)} for cfg in configs},
            "noise": noise, "timeline": timeline, "final": snap}, indent=2))


if __name__ == "__main__":
    main()
