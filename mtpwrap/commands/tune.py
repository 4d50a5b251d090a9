"""`mtpwrap tune`: sweep draft depth × p_min, fit α and the draft cost, pick the measured best."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from mtpwrap.config.options import setting_option, shared_option

if TYPE_CHECKING:
    from mtpwrap.bench.tune import TunePlan


@click.command("tune")
@click.option("--kind", type=click.Choice(["draft", "ngram", "mtp"]), default="draft",
              envvar="MTPWRAP_TUNE_KIND", show_default=True, help="Speculation kind to tune.")
@click.option("--depths", default="1,2,3,5", envvar="MTPWRAP_TUNE_DEPTHS", show_default=True)
@click.option("--p-min", "p_mins", default="0,0.75", envvar="MTPWRAP_TUNE_P_MIN",
              show_default=True, help="Minimum draft probabilities to sweep.")
@click.option("--context", type=click.IntRange(16, 1 << 20), default=512,
              envvar="MTPWRAP_TUNE_CONTEXT", show_default=True)
@click.option("--n-predict", type=click.IntRange(8, 4096), default=64,
              envvar="MTPWRAP_TUNE_N_PREDICT", show_default=True)
@click.option("--langs", default="ko,en", envvar="MTPWRAP_TUNE_LANGS", show_default=True,
              help="Corpora of the workload: ko and/or en.")
@click.option("--kv", "kv_type", default=None, envvar="MTPWRAP_TUNE_KV",
              help="KV cache type of every setting (default: the profile's).")
@setting_option("model", help="Model path or name (default: the profile's).")
@click.option("--draft-model", envvar="MTPWRAP_TUNE_DRAFT_MODEL", default=None,
              help="Drafter GGUF for --kind draft (default: the model itself).")
@setting_option("binary")
@shared_option("MTPWRAP_BENCH_THREADS")
@setting_option("profile",
                help="Profile whose speculation is tuned (every setting is this profile with "
                     "its spec replaced); --write saves the best as its override.")
@click.option("--per-class", "per_class", is_flag=True, envvar="MTPWRAP_TUNE_PER_CLASS",
              help="Measure each request class (Korean statutes, English licences, code) at "
                   "each depth on one server; --write saves the best as the profile's "
                   "spec.policy. Needs a build that honours a request's own depth.")
@click.option("--write", "write_", is_flag=True, envvar="MTPWRAP_TUNE_WRITE",
              help="Save the best setting as a user profile override.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, envvar="MTPWRAP_TUNE_OUT")
def command(kind: str, depths: str, p_mins: str, context: int, n_predict: int, langs: str,
            kv_type: str | None,
            model: str | None, draft_model: str | None, binary: str | None,
            threads: int | None, profile: str, per_class: bool, write_: bool,
            out_dir: Path | None) -> None:
    """Sweep speculation settings on a short workload and recommend the fastest measured one."""
    from mtpwrap import console
    from mtpwrap.bench import materials, tune
    from mtpwrap.errors import ConfigError
    from mtpwrap.supervision.inputs import gather

    lang_list = [g for g in langs.replace(" ", "").split(",") if g]
    if not lang_list or any(g not in ("ko", "en") for g in lang_list):
        raise ConfigError(f"--langs must list ko and/or en, got {langs!r}.")

    depth_list = materials.int_list(depths, "--depths")
    p_min_list = materials.float_list(p_mins, "--p-min")
    inp = gather(profile, model=model, binary=binary)
    assert inp.binary is not None
    plan = tune.TunePlan(binary=inp.binary, model=Path(inp.model), profile=inp.profile,
                         kind=kind, depths=depth_list, p_mins=p_min_list, context=context,
                         n_predict=n_predict, kv=kv_type, langs=lang_list,
                         draft_model=Path(draft_model) if draft_model else None,
                         threads=threads)
    configs = plan.configs()  # validates before anything starts
    out = materials.report_dir(out_dir, "tune-")
    if per_class:
        _per_class(plan, out, write_)
        return
    with console.steps("tune", len(configs)) as step:
        result = tune.run(plan, out, progress=step)
    files = tune.write_report(result, out)
    rows = [[r["name"], f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "–",
             f"{r['alpha']:.3f}" if r.get("alpha") is not None else "–",
             f"{r['formula_speedup']:.2f}" if r.get("formula_speedup") else "–",
             f"{r['modelled_speedup']:.2f}" if r.get("modelled_speedup") else "–",
             f"{r['measured_speedup']:.2f}"] for r in result["rows"]]
    console.table("tune", ["setting", "t/s", "alpha", "predicted (formula)",
                           "predicted (cost model)", "measured"], rows)
    best = result["best"]
    console.info(f"best measured: {best['name']} {best['tokens_per_s']:.1f} t/s; "
                 f"report {files['md']}")
    if write_:
        path = tune.write_override(result, plan)
        console.info(f"wrote profile override {path}")


def _per_class(plan: TunePlan, out: Path, write_: bool) -> None:
    import json

    from mtpwrap import console
    from mtpwrap.bench import tune

    with console.steps("tune per class", 3 * len({0, *plan.depths})) as step:
        result = tune.run_per_class(plan, out, progress=step)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune-per-class.json").write_text(json.dumps(result, indent=1))
    depths = sorted({int(d) for row in result["per_class"].values() for d in row})
    rows = [[cls, *(f"{row[str(d)]:.1f}" if row.get(str(d)) else "–" for d in depths),
             str(result["policy"][cls])] for cls, row in result["per_class"].items()]
    console.table("decode tokens/s per class and draft depth",
                  ["class", *(f"depth {d}" for d in depths), "best"], rows)
    if write_:
        path = tune.write_class_policy(result, plan)
        console.info(f"wrote profile override {path} (spec.policy)")
