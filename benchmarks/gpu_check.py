"""What only a GPU can show, in one run: decode and prefill tokens/s vs context for a shape-real
Qwen3.6-27B-class model with f16 / q8_0 / q4_0 KV and MTP on and off, the planner's prediction
next to what CUDA allocated, the read cells (`mtpwrap bench docs` on the same model: the read
rate by ubatch at 32K and 128K tokens and a new question after `mtpwrap restart`; `--read-cells`),
and `mtpwrap bench --quick` on the demo model.

Called by benchmarks/gpu_check.sh, which builds first. Everything lands flat in one folder:
gpu_check.json (every figure), gpu_check.md, the PNG plots and logs. `--dry-run` does all the
CPU-side work (folder, model file, the command lines) without starting a server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import gpu_plan  # noqa: E402
from mtpwrap import proc  # noqa: E402
from mtpwrap.bench.runner import BenchConfig, cell_launch  # noqa: E402
from mtpwrap.build.probe import probe  # noqa: E402
from mtpwrap.decide import launch, profiles  # noqa: E402
from mtpwrap.decide.capabilities import Capabilities  # noqa: E402

KV_TYPES = ("f16", "q8_0", "q4_0")
CONTEXTS = (1024, 8192, 32768)
MTP_DEPTH = 3
#: GPU offload. The default micro-batch is kept: the recipe's `-ub 32` saves memory at 262K
#: but makes prefill crawl, and this check measures prefill speed.
GPU_EXTRA = ["--no-repack"]
#: the profile every cell derives from (all layers on the GPU)
BASE_PROFILE = "h200-262k"
#: the read cells: document tokens -> the ubatches read at, largest document last; each cell one
#: `mtpwrap bench docs` run (a launch per ubatch, a cold read, then a new question after
#: `mtpwrap restart` at the profile's own ubatch), so the plan's choice of ubatch can be
#: weighed against what the read gains
READ_CELLS = {32_768: (32, 128, 512, 2048), 131_072: (512, 2048)}
#: without a binary (--dry-run on a machine that has none): the pinned source's recorded --help
RECORDED_HELP = REPO / "tests" / "data" / "help" / "upstream-0c1e570.txt"


def server_caps(server_bin: Path) -> Capabilities:
    """The binary's own --help; the recorded one of the pinned source when it cannot answer
    here (a dry run, or a CUDA build on a machine without the GPU's libraries)."""
    from mtpwrap.errors import MtpwrapError

    if server_bin.is_file():
        try:
            return probe(server_bin)
        except MtpwrapError:
            pass
    return Capabilities.from_help(RECORDED_HELP.read_text(), binary=str(server_bin))


def configs() -> list[BenchConfig]:
    out = [BenchConfig(f"kv-{kv}", spec="none", kv=kv) for kv in KV_TYPES]
    out += [BenchConfig(f"mtp-kv-{kv}", spec="mtp", depth=MTP_DEPTH, kv=kv)
            for kv in ("f16", "q4_0")]
    return out


def command_lines(server_bin: Path, model: Path, contexts: tuple[int, ...] = CONTEXTS,
                  n_predict: int = 64) -> list[dict]:
    """The llama-server command line of every cell (ports are chosen at launch)."""
    ctx_size = launch_context(contexts, n_predict)
    caps = server_caps(server_bin)
    base = profiles.load_profile(BASE_PROFILE)
    out = []
    for c in configs():
        cfg, _ = cell_launch(c, binary=server_bin, model=model, ctx_size=ctx_size,
                             profile=base, caps=caps)
        argv = launch.render(cfg, caps, binary=server_bin, port=0, extra=GPU_EXTRA).argv
        out.append({"config": c.to_dict(), "argv": argv})
    return out


def read_commands(server_bin: Path, model: Path, out: Path) -> list[dict]:
    """The `mtpwrap bench docs` command of every read cell (`READ_CELLS`), its report in
    OUT/read-TOKENS."""
    cells = []
    for tokens, ubatches in READ_CELLS.items():
        argv = [sys.executable, "-m", "mtpwrap", "bench", "docs", "--profile", BASE_PROFILE,
                "--binary", str(server_bin), "--model", str(model), "--corpora", "licence",
                "--doc-tokens", str(tokens), "--steps", "cold,restart",
                "--ubatch", ",".join(map(str, ubatches)), "--max-tokens", "1",
                "--timeout", "600", "--out", str(out / f"read-{tokens}"), "--json"]
        cells.append({"doc_tokens": tokens, "ubatch": list(ubatches), "argv": argv})
    return cells


def run_read_cells(cells: list[dict], budget_s: float) -> list[dict]:
    """Each read cell in order while time is left; what each gave (exit code, seconds)."""
    done = []
    t0 = time.monotonic()
    for cell in cells:
        left = budget_s - (time.monotonic() - t0)
        if left < 60:
            done.append({**cell, "skipped": f"{left:.0f}s left of the budget"})
            continue
        t = time.monotonic()
        try:
            p = proc.run(cell["argv"], timeout=left, cwd=REPO)
            rec = {"rc": p.returncode, "tail": (p.stderr or "")[-2000:]}
        except proc.CommandTimedOut:
            rec = {"rc": None, "error": f"timed out after {left:.0f}s"}
        done.append({**cell, **rec, "seconds": round(time.monotonic() - t, 1)})
    return done


_BUF = re.compile(r"(\w+)\s*:\s*(\S+) (model|KV|RS|compute) buffer size =\s*([\d.]+) MiB")


def allocations(log_text: str) -> list[dict]:
    """Buffer sizes llama.cpp logged at -lv 4 (`load_tensors: CUDA0 model buffer size = X MiB`)."""
    return [{"where": m.group(1), "device": m.group(2), "kind": m.group(3),
             "mib": float(m.group(4))} for m in _BUF.finditer(log_text)]


def write_model(work: Path) -> tuple[Path | None, str]:
    try:
        from mtpwrap.build import tiny_gguf
    except ImportError as exc:
        return None, f"model writer unavailable: {exc}"
    path = work / "qwen3.6-27b-shape-q4_k_m.gguf"
    if not path.exists():
        tiny_gguf.write_shape_only(path, model="qwen3.6-27b", ftype="q4_k_m")
    return path, "ok"


def planner(model: Path, contexts: tuple[int, ...], gpu: str = "auto") -> list[dict]:
    """`mtpwrap plan --json` for every cell and context: the prediction to set beside what
    CUDA allocated (the `allocations` of the same cell)."""
    out = []
    env = dict(os.environ)
    if not Path(env.get("MTPWRAP_BINARY", "")).is_file():
        env.pop("MTPWRAP_BINARY", None)  # a dry run without a binary: the built one, if any
    for cfg in configs():
        for ctx in contexts:
            # the cell's own profile: what it launches with is what is planned
            cmd = [sys.executable, "-m", "mtpwrap", "plan", "--profile", BASE_PROFILE,
                   "-m", str(model), "--gpu", gpu, "-c", str(ctx), "--kv", str(cfg.kv),
                   "--spec", cfg.spec, "--json"]
            if cfg.spec != "none":
                cmd += ["--depth", str(cfg.depth)]
            rec: dict = {"config": cfg.name, "context": ctx}
            try:
                p = proc.run(cmd, timeout=120, cwd=REPO, env=env)
            except proc.CommandTimedOut:
                rec["error"] = "timed out"
                out.append(rec)
                continue
            rec["rc"] = p.returncode
            try:
                rec["plan"] = json.loads(p.stdout)
            except json.JSONDecodeError:
                rec["error"] = (p.stderr or p.stdout).strip()[-400:]
            out.append(rec)
    return out


def speed_plan(model: Path) -> dict:
    """The speed-only cells, with the bandwidth NVML reports when a GPU is present."""
    from mtpwrap.decide import gguf_facts, hardware

    snap = hardware.snapshot()
    bw = next((g.memory_bandwidth for g in snap.gpus if g.memory_bandwidth), None)
    return gpu_plan.plan(gguf_facts.read_facts(model), bandwidth=bw)


def engine_plan(out: Path, carried: Path | None) -> tuple[dict, list[dict]]:
    """Which llama-server runs (gpu_plan.engine): the carried build gpu_check.sh installed, else
    one compiled there from the checkout's source; and what is carried (gpu_plan.carry)."""
    manifest = None
    if carried is not None and (out / "prebuilt-manifest.json").is_file():
        manifest = json.loads((out / "prebuilt-manifest.json").read_text())
    tracked = proc.run(["git", "ls-files"], cwd=REPO, timeout=60).stdout.split()
    items = gpu_plan.carry(REPO, tracked)
    return gpu_plan.engine(REPO, manifest, carried.stat().st_size if manifest and carried
                           else None, items), items


def launch_context(contexts: tuple[int, ...], n_predict: int = 64) -> int:
    """The -c every cell is launched with (see `command_lines`)."""
    return (max(contexts) + n_predict + 64 + 255) // 256 * 256


def summary_markdown(result: dict) -> str:
    """Predicted (planner) next to allocated (llama.cpp's log), per cell, in MiB."""
    mib = 2**20
    lines = ["# gpu_check", "", f"llama-server: `{result['server_bin']}`; model: "
             f"`{(result.get('model') or {}).get('path')}`; launch context "
             f"{result.get('launch_context')}.", ""]
    if result.get("speed_error"):
        lines += [f"Speed matrix failed: {result['speed_error']}", ""]
    lines += ["## Planner vs CUDA allocations (MiB)", "",
              "| config | planner rows (at the launch context) | allocated (device kind MiB) |",
              "|---|---|---|"]
    plans = {p["config"]: p for p in result.get("planner_launch", [])}
    for name, allocs in (result.get("allocations") or {}).items():
        rows = ((plans.get(name) or {}).get("plan") or {}).get("rows") or []
        pred = "; ".join(f"{r['name']} {r['bytes'] / mib:.0f}" for r in rows)
        got = "; ".join(f"{a['device']} {a['kind']} {a['mib']:.0f}" for a in allocs)
        lines.append(f"| {name} | {pred or '–'} | {got or '–'} |")
    lines += ["", "Speed, acceptance and the rest: speed_report.md and the PNG plots.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--binary", dest="server_bin", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get(
        "GPU_CHECK_WORK", "/tmp/mtpwrap-gpu-check")))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--carried", type=Path, default=None,
                    help="the .prebuilt archive gpu_check.sh installed (its manifest is "
                    "prebuilt-manifest.json in OUT)")
    ap.add_argument("--plan-gpu", default=os.environ.get("GPU_CHECK_PLAN_GPU", "auto"),
                    help="GPU the planner predicts for (default: the one present)")
    ap.add_argument("--read-cells", type=float, default=None, metavar="SECONDS",
                    help="run only the read cells (READ_CELLS), within SECONDS; their results "
                    "in OUT/read_cells.json")
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.read_cells is not None:
        model, _ = write_model(args.work)
        if model is None:
            return 2
        cells = run_read_cells(read_commands(args.server_bin, model, out), args.read_cells)
        (out / "read_cells.json").write_text(json.dumps(cells, indent=1))
        return 0 if all(c.get("rc") == 0 for c in cells) else 1
    contexts = tuple(int(c) for c in args.contexts.split(","))
    t0 = time.monotonic()
    result: dict = {"dry_run": args.dry_run, "contexts": list(contexts),
                    "server_bin": str(args.server_bin)}
    model, why = write_model(args.work)
    result["model"] = {"path": str(model) if model else None, "status": why,
                       "bytes": model.stat().st_size if model else None,
                       "seconds_to_write": round(time.monotonic() - t0, 2)}
    if model:
        result["gpu_plan"] = speed_plan(model)
        result["gpu_plan"]["engine"], result["gpu_plan"]["carry"] = engine_plan(out,
                                                                                 args.carried)
        (out / "gpu_plan.txt").write_text("\n".join(gpu_plan.describe(result["gpu_plan"]))
                                          + "\n")
        result["commands"] = command_lines(args.server_bin, model, contexts)
        result["read_commands"] = read_commands(args.server_bin, model, out)
        # The planner reads only the GGUF header: its prediction is made on any machine.
        result["planner"] = planner(model, contexts, args.plan_gpu)
        result["launch_context"] = launch_context(contexts)
        result["planner_launch"] = planner(model, (launch_context(contexts),), args.plan_gpu)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    if args.dry_run or model is None:
        return 0 if model else 2

    from mtpwrap.bench import report, suite

    plan = suite.SuitePlan(configs=configs(), contexts=list(contexts), langs=["en"], n_predict=64,
                      concurrency=[1], quality_tokens=16, binary=args.server_bin, model=model,
                      server_extra=GPU_EXTRA, launch_timeout=600.0, profile=BASE_PROFILE)
    speed_dir = args.work / "speed"
    try:
        res = suite.run(plan, speed_dir)
    except Exception as exc:  # keep what was measured; the log says what broke
        result["speed_error"] = f"{type(exc).__name__}: {exc}"
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
        (out / "gpu_check.md").write_text(summary_markdown(result))
        raise
    files = report.write(res, speed_dir)
    for name, path in files.items():
        if name.startswith("png_") or name == "md":
            shutil.copy(path, out / (("speed_" + path.name) if name == "md" else path.name))
    result["speed"] = res["summary"]
    result["allocations"] = {
        c.name: allocations((speed_dir / f"server-{c.name}.log").read_text(errors="replace"))
        for c in configs() if (speed_dir / f"server-{c.name}.log").exists()}
    result["seconds"] = round(time.monotonic() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "gpu_check.md").write_text(summary_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
