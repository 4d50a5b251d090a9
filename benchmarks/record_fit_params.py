"""Record what llama.cpp itself allocates on the CPU for several architectures, as test data.

For each model below, runs the given build's `llama-fit-params` (nothing is allocated; `-v`
logs every buffer) and, with --server, its `llama-server` (`--no-warmup`, stopped once it
listens), and writes the lines that size memory (buffers, KV and recurrent sizes, the memory
breakdown, the context parameters) to `OUT/<case>.txt`, after a first line with the command.
`tests/test_planner_recorded.py` compares the planner against these recordings.

    python benchmarks/record_fit_params.py --bin-dir DIR --out tests/data/fit-params/NAME \
        [--models DIR] [--server]

`--grid` records nothing: it asks llama-fit-params for five shape-only models at contexts
4K-131K, f16 and q4_0 KV, ubatch 512 and 32, and prints its compute buffer next to the plan's
(the plan following this binary's logits-row cap), with the worst difference.

`--models DIR` holds the models; the shape-only and tiny ones are written there when missing
(`mtpwrap.build.tiny_gguf`), the demo model and gemma-3-270m are taken from the model cache
(`mtpwrap models get gemma-3-270m`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpwrap.build import tiny_gguf
from mtpwrap.build.calibrate import (
    fit_params_args,
    measure_server,
    plan_launch,
    run_fit_params,
)
from mtpwrap.decide.planner import PlanConfig
from mtpwrap.errors import RuntimeFailure

#: the lines of a `-v` log that size memory or say how the context was set up
KEEP = re.compile(r"MiB|memory_breakdown_print|llama_context: +n_|n_outputs|n_seq_max|n_rs_seq")

#: case name -> (model file, planner config); CPU, one slot, flash attention on
CASES: dict[str, tuple[str, PlanConfig]] = {
    "demo-c4096-f16": ("SmolLM2-135M-Instruct.Q4_1.gguf", PlanConfig(backend="cpu")),
    "gemma-3-270m-c4096-f16": ("gemma-3-270m-q4_k_m.gguf", PlanConfig(backend="cpu")),
    "gemma-3-270m-c4096-q4_0": ("gemma-3-270m-q4_k_m.gguf",
                                PlanConfig(backend="cpu", type_k="q4_0", type_v="q4_0")),
    "tiny-qwen35-mtp-c4096-f16": ("tiny-qwen35-mtp.gguf", PlanConfig(backend="cpu")),
    "llama3-8b-c16384-q8_0": ("llama3-8b.gguf",
                              PlanConfig(backend="cpu", n_ctx=16384, type_k="q8_0",
                                         type_v="q8_0")),
    "gemma3-12b-c32768-f16": ("gemma3-12b.gguf", PlanConfig(backend="cpu", n_ctx=32768)),
    "qwen3.6-35b-a3b-c32768-q8_0": ("qwen3.6-35b-a3b.gguf",
                                    PlanConfig(backend="cpu", n_ctx=32768, type_k="q8_0",
                                               type_v="q8_0")),
    "deepseek2-lite-c8192-f16": ("deepseek2-lite.gguf", PlanConfig(backend="cpu", n_ctx=8192)),
    "qwen3.6-27b-c32768-q4_0": ("qwen3.6-27b.gguf",
                                PlanConfig(backend="cpu", n_ctx=32768, type_k="q4_0",
                                           type_v="q4_0")),
    "qwen3.6-27b-c262144-q4_0-ub32": ("qwen3.6-27b.gguf",
                                      PlanConfig(backend="cpu", n_ctx=262144, type_k="q4_0",
                                                 type_v="q4_0", ubatch=32)),
    # the recipe's launch (4090-262k) as the fork's llama-fit-params takes it (no --spec-type)
    "qwen3.6-27b-c262144-tbq4_0-ub32": ("qwen3.6-27b.gguf",
                                        PlanConfig(backend="cpu", n_ctx=262144, type_k="tbq4_0",
                                                   type_v="tbq4_0", ubatch=32)),
}
#: the cases llama-server is started for with --server (small files: it maps every weight)
SERVER_CASES = ("demo-c4096-f16", "gemma-3-270m-c4096-f16", "tiny-qwen35-mtp-c4096-f16")
SHAPES = {"llama3-8b", "gemma3-12b", "qwen3.6-35b-a3b", "deepseek2-lite", "qwen3.6-27b"}


def model_path(models: Path, name: str) -> Path:
    path = models / name
    if path.is_file():
        return path
    cached = Path.home() / ".cache" / "mtpwrap" / "models" / name
    if cached.is_file():
        return cached
    stem = name.removesuffix(".gguf")
    if stem in SHAPES:
        return tiny_gguf.write_shape_only(path, stem)
    if stem == "tiny-qwen35-mtp":
        return tiny_gguf.write_tiny_random(path, "qwen35", mtp=True)
    raise SystemExit(f"{name}: not in {models} nor in the model cache")


def kept(log: str) -> str:
    return "".join(line + "\n" for line in log.splitlines() if KEEP.search(line))


def grid(fit: Path, models: Path, ubatches: tuple[int, ...] = (512, 32),
         contexts: tuple[int, ...] = (4096, 16384, 32768, 131072)) -> None:
    import itertools

    from mtpwrap.build.calibrate import measure_config
    from mtpwrap.build.probe import outputs_capped
    from mtpwrap.decide.gguf_facts import read_facts
    from mtpwrap.decide.planner import MiB, plan

    capped = outputs_capped(fit.with_name("llama-server"))
    worst = 0.0
    for name, ctx, kv, ub in itertools.product(
            ("llama3-8b", "gemma3-12b", "qwen3.6-27b", "qwen3.6-35b-a3b", "deepseek2-lite"),
            contexts, ("f16", "q4_0"), ubatches):
        path = model_path(models, name + ".gguf")
        cfg = PlanConfig(backend="cpu", n_ctx=ctx, type_k=kv, type_v=kv, ubatch=ub,
                         n_outputs=ub, mask_f32=not capped)
        got = measure_config(fit, path, cfg).compute_per_context[0]
        pred = plan(read_facts(path), cfg, None).row("compute").bytes
        err = 100 * (pred - got) / got
        worst = max(worst, abs(err))
        print(f"{name:16} c={ctx:<7} kv={kv:5} ub={ub:<4} llama.cpp {got / MiB:8.2f} MiB  "
              f"plan {pred / MiB:8.2f} MiB  {err:+6.1f} %", flush=True)
    print(f"worst: {worst:.1f} %")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=Path("/tmp/mtpwrap-record-models"))
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--ubatches", default="512,32", help="the grid's ubatches")
    ap.add_argument("--contexts", default="4096,16384,32768,131072", help="the grid's contexts")
    a = ap.parse_args()
    if a.grid:
        a.models.mkdir(parents=True, exist_ok=True)
        grid(a.bin_dir / "llama-fit-params", a.models,
             tuple(int(u) for u in a.ubatches.split(",")),
             tuple(int(c) for c in a.contexts.split(",")))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    a.models.mkdir(parents=True, exist_ok=True)
    fit = a.bin_dir / "llama-fit-params"
    for case, (name, cfg) in CASES.items():
        if a.only and case not in a.only:
            continue
        model = model_path(a.models, name)
        args = fit_params_args(fit, plan_launch(model, cfg, server=False))
        try:
            log = run_fit_params(fit, model, args)
        except RuntimeFailure as exc:  # e.g. a KV type this build does not offer
            print(f"{case}: skipped ({exc.message[:120]})")
            continue
        cmd = " ".join(["llama-fit-params", "-m", name, *args])
        (a.out / f"{case}.txt").write_text(f"# {cmd}\n" + kept(log))
        print(f"{case}: fit-params {len(log)} bytes of log")
        if a.server and case in SERVER_CASES:
            srv_cfg = dataclasses.replace(cfg, cpu_repack=False)
            _, text = measure_server(a.bin_dir / "llama-server", model, srv_cfg)
            (a.out / f"{case}.server.txt").write_text(
                f"# llama-server -m {name} -c {srv_cfg.n_ctx} -np {srv_cfg.n_slots} "
                f"-ub {srv_cfg.ubatch} -ctk {srv_cfg.type_k} -ctv {srv_cfg.type_v} "
                "--flash-attn on --no-warmup --no-repack -lv 4\n" + kept(text))
            print(f"{case}: llama-server {len(text)} bytes of log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
