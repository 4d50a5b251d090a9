"""Planner vs llama.cpp: predicted and allocated bytes, side by side, per architecture and config.

Writes shape-only GGUFs (sparse, header + tensor infos only) of five real architectures into a
temporary directory, asks the built `llama-fit-params` what it would allocate on the CPU
(`-lv 4`: model, KV, recurrent-state and compute buffers; nothing is allocated), and prints the
planner's prediction next to it. The temporary models are deleted at the end.

    python benchmarks/planner_accuracy.py [--bin-dir DIR] [--quick] [--heavy] [--json OUT]

MTP on/off is measured with llama-server (llama-fit-params has no speculative flags), on a tiny
random hybrid MTP model and, with --heavy, on the 27B shape model (plus the 8B without MTP).
llama-server maps the weights and the kernel reads the holes in: about 90 s and 16 GB of page
cache for the 27B, so --heavy is for a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpwrap.build import probe, tiny_gguf
from mtpwrap.build.calibrate import measure_config, measure_server
from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.decide.planner import MiB, PlanConfig, plan


@dataclass
class Case:
    model: str
    cfg: PlanConfig
    tool: str = "fit"  #: "fit": llama-fit-params; "server": llama-server (shows the MTP context)

    def label(self) -> str:
        c = self.cfg
        s = f"c={c.n_ctx} kv={c.type_k} np={c.n_slots}"
        if c.n_slots > 1:
            s += " unified" if c.kv_unified else " per-slot"
        if not c.flash_attn:
            s += " fa=off"
        if c.spec == "mtp":
            s += f" mtp d={c.draft_depth}"
            if c.type_k_draft != "f16":
                s += f" kvd={c.type_k_draft}"
        return s + (" [server]" if self.tool == "server" else "")


def cases(quick: bool, heavy: bool) -> list[Case]:
    def fit(**kw: object) -> PlanConfig:
        # llama-fit-params reserves logits for a whole ubatch (llama-server: slots × (1 + depth))
        kw.setdefault("n_outputs", kw.get("ubatch", 512))
        return PlanConfig(backend="cpu", **kw)  # type: ignore[arg-type]

    def srv(**kw: object) -> PlanConfig:
        return PlanConfig(backend="cpu", cpu_repack=False, **kw)  # type: ignore[arg-type]

    out: list[Case] = []
    for model in tiny_gguf.SHAPES:
        out += [
            Case(model, fit(n_ctx=4096, type_k="f16", type_v="f16")),
            Case(model, fit(n_ctx=32768, type_k="q8_0", type_v="q8_0")),
            Case(model, fit(n_ctx=131072, type_k="q4_0", type_v="q4_0")),
        ]
        if quick:
            continue
        out += [
            Case(model, fit(n_ctx=16384, type_k="f16", type_v="f16", n_slots=4,
                            kv_unified=False)),
            Case(model, fit(n_ctx=65536, type_k="q4_0", type_v="q4_0", n_slots=2,
                            kv_unified=False)),
            Case(model, fit(n_ctx=8192, type_k="f16", type_v="f16", flash_attn=False)),
        ]
    # MTP on and off through llama-server: the tiny hybrid MTP model, and (--heavy) the 27B
    # shape, which llama-server maps and prefetches (about 90 s and 16 GB of page cache).
    out += [
        Case("tiny-qwen35-mtp", srv(n_ctx=16384, type_k="f16", type_v="f16"), "server"),
        Case("tiny-qwen35-mtp", srv(n_ctx=16384, type_k="f16", type_v="f16", spec="mtp",
                                    draft_depth=3), "server"),
        Case("tiny-qwen35-mtp", srv(n_ctx=65536, type_k="q8_0", type_v="q8_0", spec="mtp",
                                    draft_depth=2, type_k_draft="q8_0", type_v_draft="q8_0"),
             "server"),
        Case("tiny-qwen35-mtp", srv(n_ctx=32768, type_k="q4_0", type_v="q4_0", n_slots=2,
                                    kv_unified=True, spec="mtp", draft_depth=3), "server"),
    ]
    if heavy:
        out += [Case("llama3-8b", srv(n_ctx=16384, type_k="f16", type_v="f16"), "server"),
                Case("llama3-8b", srv(n_ctx=4096, type_k="q4_0", type_v="q4_0"), "server"),
                Case("qwen3.6-27b", srv(n_ctx=16384, type_k="q4_0", type_v="q4_0",
                                        spec="mtp", draft_depth=3), "server")]
    return out


def pct(pred: int, got: int) -> str:
    if got == 0:
        return "exact" if pred == 0 else "n/a"
    return f"{100.0 * (pred - got) / got:+.2f}%"


def _write(model: str, tmp: Path) -> Path:
    if model == "tiny-qwen35-mtp":
        return tiny_gguf.write_tiny_random(tmp / f"{model}.gguf", arch="qwen35", mtp=True)
    return tiny_gguf.write_shape_only(tmp / f"{model}.gguf", model)




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", type=Path, help="folder with llama-fit-params and llama-server "
                    "(default: the installed build's)")
    ap.add_argument("--quick", action="store_true", help="three configurations per model")
    ap.add_argument("--heavy", action="store_true",
                    help="also start llama-server on the 8B and 27B (MTP) shape models")
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--models", nargs="*", default=None, help="subset of models")
    a = ap.parse_args()
    bin_dir = a.bin_dir
    if bin_dir is None:
        from mtpwrap.build import binary

        bin_dir = binary.find_binary("llama-server").parent
    fit_bin, server_bin = bin_dir / "llama-fit-params", bin_dir / "llama-server"
    # a llama.cpp without the logits-row cap (the fork at 0bc0a27) reserves a whole ubatch in
    # llama-server too and builds an f32 attention mask: the plan follows the binary
    capped = probe.outputs_capped(server_bin)
    rows: list[dict[str, object]] = []
    worst: dict[str, float] = {}
    print(f"{'model':16} {'configuration':44} {'item':12} {'predicted MiB':>14} "
          f"{'allocated MiB':>14} {'error':>8}")
    with tempfile.TemporaryDirectory(prefix="mtpwrap-shapes-") as tmp:
        paths: dict[str, Path] = {}
        for case in cases(a.quick, a.heavy):
            if a.models and case.model not in a.models:
                continue
            if case.model not in paths:
                paths[case.model] = _write(case.model, Path(tmp))
            path = paths[case.model]
            facts = read_facts(path)
            t0 = time.monotonic()
            if case.tool == "server":
                got, _log = measure_server(server_bin, path, case.cfg)
            else:
                got = measure_config(fit_bin, path, case.cfg)
            secs = time.monotonic() - t0
            pcfg = dataclasses.replace(
                case.cfg, mask_f32=not capped,
                n_outputs=case.cfg.n_outputs or (None if capped else case.cfg.ubatch))
            p = plan(facts, pcfg, None)
            weights = sum(r.bytes for r in p.rows if r.name.startswith("weights"))
            items = [("weights", weights, got.model_total),
                     ("KV", p.row("main KV").bytes, got.kv[0] if got.kv else 0),
                     ("recurrent", p.row("recurrent state").bytes, got.recurrent_total),
                     ("compute", p.row("compute").bytes, got.compute_total)]
            if case.cfg.spec == "mtp":
                items[0] = ("weights+MTP", weights + p.row("MTP weights").bytes, got.model_total)
                items += [("MTP KV", p.row("MTP context KV").bytes,
                           got.kv[1] if len(got.kv) > 1 else 0),
                          ("MTP compute", p.row("MTP compute").bytes,
                           got.compute_per_context[1] if len(got.compute_per_context) > 1
                           else 0)]
            for name, pred, alloc in items:
                err = pct(pred, alloc)
                if 0 < alloc < MiB:
                    err += "~"  # logged as MiB with two decimals: ±0.005 MiB dominates
                print(f"{case.model:16} {case.label():44} {name:12} {pred / MiB:14.2f} "
                      f"{alloc / MiB:14.2f} {err:>8}", flush=True)
                key = "compute" if "compute" in name else name.replace("+MTP", "")
                if alloc >= MiB:
                    worst[key] = max(worst.get(key, 0.0), abs(pred - alloc) / alloc * 100)
                rows.append({"model": case.model, "config": case.label(), "item": name,
                             "predicted": pred, "allocated": alloc, "seconds": round(secs, 2)})
    print()
    print("worst absolute error (buffers of 1 MiB or more): "
          + ", ".join(f"{k} {v:.2f}%" for k, v in worst.items()))
    print("~ marks buffers under 1 MiB, where the log's two-decimal MiB rounding dominates")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
