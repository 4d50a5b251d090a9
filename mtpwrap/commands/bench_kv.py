"""`mtpwrap bench kv`: KV cache quality against f16 by type, language and depth."""

from __future__ import annotations

from pathlib import Path

import click

from mtpwrap.config.options import setting_option, shared_option

DEFAULT_TYPES = "f16,q8_0,q5_0,q4_0,iq4_nl,tbq4_0,tbq3_0"


@click.command("kv")
@setting_option("model", help="GGUF model (default: the demo model).")
@setting_option("binary", "binary_opt",
                help="llama-server of the build whose llama-perplexity measures (default: the "
                     "newest `mtpwrap build`).")
@click.option("--types", default=DEFAULT_TYPES, envvar="MTPWRAP_BENCH_KV_TYPES",
              show_default=True, help="KV types to measure, K and V alike (f16 is the "
              "reference and always runs); those the build does not offer or the model does "
              "not admit are reported as not applicable.")
@click.option("--corpora", "corpus_names", default="ruling,licence",
              envvar="MTPWRAP_BENCH_KV_CORPORA", show_default=True,
              help="One corpus per language: ruling, statute, interpretation, ko (Korean); "
                   "licence, en (English).")
@click.option("--depths", default="1024,4096,16384", envvar="MTPWRAP_BENCH_KV_DEPTHS",
              show_default=True, help="Windows in tokens (llama-perplexity -c); each is scored "
              "on its second half.")
@click.option("--chunks", default="2", envvar="MTPWRAP_BENCH_KV_CHUNKS", show_default=True,
              help="Windows scored per depth (llama-perplexity --chunks): one number, or one "
                   "per depth (e.g. 4,2,1).")
@shared_option("MTPWRAP_BENCH_THREADS")
@click.option("--speed/--no-speed", default=True, envvar="MTPWRAP_BENCH_KV_SPEED",
              show_default=True, help="Also measure prefill and decode speed by filled depth "
              "(one llama-server per type).")
@click.option("--quality/--no-quality", default=True, envvar="MTPWRAP_BENCH_KV_QUALITY",
              show_default=True, help="The llama-perplexity runs against f16 (--no-quality "
              "with --speed: speed only).")
@click.option("--n-predict", type=click.IntRange(1, 4096), default=32,
              envvar="MTPWRAP_BENCH_KV_N_PREDICT", show_default=True,
              help="Tokens decoded per speed cell.")
@click.option("--from", "from_report", type=click.Path(dir_okay=False, path_type=Path),
              default=None, envvar="MTPWRAP_BENCH_KV_FROM",
              help="Use the figures of this report.json instead of measuring.")
@click.option("--write", "write_", is_flag=True, envvar="MTPWRAP_BENCH_KV_WRITE",
              help="Write the profile's KV list ordered by measured mean KLD (types whose plan "
                   "fits at --context), with the figures as its reason, as a user profile "
                   "override.")
@setting_option("profile", default=None,
                help="Profile --write orders the KV list of (default: the one `up` would "
                     "choose here).")
@click.option("--context", type=click.IntRange(256, 1 << 22), default=None,
              envvar="MTPWRAP_BENCH_KV_CONTEXT",
              help="Context --write plans for (default: the profile's); the figures of the "
                   "largest measured depth not above it are used.")
@shared_option("MTPWRAP_BENCH_OUT", help="Report folder (default ./bench-results/kv-TIMESTAMP).")
def command(model: str | None, binary_opt: str | None, types: str, corpus_names: str,
            depths: str, chunks: str, threads: int | None, speed: bool, quality: bool,
            n_predict: int, from_report: Path | None, write_: bool, profile: str | None,
            context: int | None, out_dir: Path | None) -> None:
    """Measure each KV type's loss against f16 (KL divergence, top-1 agreement, PPL ratio),
    its real bits per value and its speed, by language and depth; write JSON, Markdown, PNG."""
    from mtpwrap import console
    from mtpwrap.bench import kv_report

    if from_report is not None:
        results = kv_report.load(from_report)
    else:
        results = _measure(model, binary_opt, types, corpus_names, depths, chunks, threads,
                           speed, quality, n_predict, out_dir)
    console.table("KV quality against f16", kv_report.COLUMNS[:-1],
                  [r[:-1] for r in kv_report.table_rows(results)])
    for t in results["types"]:
        if not t["applicable"]:
            console.warn(f"{t['kv']}: not applicable: {t['reason']}")
    for r in results["rows"]:
        if r.get("error"):
            console.warn(f"{r['kv']} {r['corpus']} {r['depth']}: {r['error']}")
    for sentence in results["hypotheses"].values():
        console.info(sentence)
    if write_:
        from mtpwrap.bench import kv_tune

        path, why = kv_tune.write_kv_order(results, profile=profile, context=context,
                                           binary=binary_opt)
        console.info(f"wrote profile override {path}: {why}")


def _measure(model: str | None, binary_opt: str | None, types: str, corpus_names: str,
             depths: str, chunks: str, threads: int | None, speed: bool, quality: bool,
             n_predict: int, out_dir: Path | None) -> dict:
    from mtpwrap import console
    from mtpwrap.bench import kv_report, kv_run, materials
    from mtpwrap.decide.gguf_facts import read_facts
    from mtpwrap.errors import ConfigError

    if not quality and not speed:
        raise ConfigError("--no-quality with --no-speed leaves nothing to measure.")
    type_list = [t for t in types.replace(" ", "").split(",") if t]
    if not type_list:
        raise ConfigError(f"--types must list KV types, got {types!r}.")
    names = [c for c in corpus_names.replace(" ", "").split(",") if c]
    build = materials.kv_build(binary_opt)
    mpath = materials.model_path(model)
    depth_list = materials.int_list(depths, "--depths")
    chunk_list = materials.int_list(chunks, "--chunks")
    if len(chunk_list) not in (1, len(depth_list)):
        raise ConfigError(f"--chunks must be one number or one per depth ({len(depth_list)}), "
                          f"got {chunks!r}.")
    plan = kv_run.KvPlan(perplexity=build.perplexity, server=build.server, model=mpath,
                         types=type_list, offered=build.offered, corpora=names,
                         depths=depth_list, chunks=chunk_list,
                         threads=threads, speed=speed, quality=quality, n_predict=n_predict,
                         target=build.target)
    materials.check_kv_plan(plan)
    out = materials.report_dir(out_dir, "kv-")
    n_types = sum(1 for t in kv_run.admitted(plan, read_facts(mpath)) if t["applicable"])
    with console.steps("bench kv", kv_run.steps(plan, n_types)) as step:
        results = kv_run.run(plan, out, progress=step)
    files = kv_report.write(results, out)
    console.info(f"report: {files['md']}  (json: {files['json'].name}, plots: "
                 f"{', '.join(p.name for k, p in files.items() if k.startswith('png_'))})")
    return results
