"""`mtpwrap bench embed`: the embedding companion's throughput and its cost to chat decode."""

from __future__ import annotations

from pathlib import Path

import click

from mtpwrap.config.options import shared_option


@click.command("embed")
@shared_option("MTPWRAP_BENCH_URL",
               help="Base URL of the running front (default: `mtpwrap bench --url`).")
@shared_option("MTPWRAP_API_KEY")
@click.option("--corpora", "corpus_names", default="ruling,licence",
              envvar="MTPWRAP_BENCH_EMBED_CORPORA", show_default=True,
              help="Corpora the passages come from: ruling, statute, interpretation, ko "
                   "(Korean); licence, en (English).")
@click.option("--doc-tokens", type=click.IntRange(8, 32768), default=256,
              envvar="MTPWRAP_BENCH_EMBED_DOC_TOKENS", show_default=True,
              help="Tokens per passage, cut by the front's /tokenize.")
@click.option("--docs", type=click.IntRange(1, 100_000), default=64,
              envvar="MTPWRAP_BENCH_EMBED_DOCS", show_default=True,
              help="Passages per corpus, each embedded once per pass.")
@click.option("--batch", type=click.IntRange(1, 4096), default=8,
              envvar="MTPWRAP_BENCH_EMBED_BATCH", show_default=True,
              help="Passages per /v1/embeddings request (`input` as a list).")
@click.option("--concurrency", default="1,2", envvar="MTPWRAP_BENCH_EMBED_CONCURRENCY",
              show_default=True, help="Requests in flight, one pass per level; the largest "
              "is also the background load's.")
@click.option("--rounds", type=click.IntRange(1, 100), default=3,
              envvar="MTPWRAP_BENCH_EMBED_ROUNDS", show_default=True,
              help="Rounds; each is shown, then the median.")
@click.option("--chat-tokens", type=click.IntRange(8, 4096), default=128,
              envvar="MTPWRAP_BENCH_EMBED_CHAT_TOKENS", show_default=True,
              help="max_tokens of each chat request whose decode rate is measured.")
@click.option("--embed-model", default=None, envvar="MTPWRAP_BENCH_EMBED_MODEL",
              help="`model` of the embedding requests (default: left out; the front routes "
                   "/v1/embeddings to the embedding companion).")
@click.option("--chat-model", default=None, envvar="MTPWRAP_BENCH_CHAT_MODEL",
              help="`model` of the chat requests (default: left out).")
@click.option("--timeout", "timeout_s", type=click.IntRange(1, 86_400), default=600,
              envvar="MTPWRAP_BENCH_EMBED_TIMEOUT", show_default=True,
              help="Seconds one request may take before the run stops with an error.")
@shared_option("MTPWRAP_JSON", help="Print the results as JSON.")
@shared_option("MTPWRAP_BENCH_OUT", help="Report folder (default ./bench-results/embed-TIMESTAMP).")
@click.pass_context
def command(ctx: click.Context, url: str | None, api_key: str | None, corpus_names: str,
            doc_tokens: int, docs: int, batch: int, concurrency: str, rounds: int,
            chat_tokens: int, embed_model: str | None, chat_model: str | None, timeout_s: int,
            as_json: bool, out_dir: Path | None) -> None:
    """Measure the embedding companion's documents/s and tokens/s on Korean rulings and English
    licences, and the chat model's decode tokens/s with the companion idle and busy; write JSON
    and Markdown."""
    from mtpwrap import console
    from mtpwrap.bench import embed, embed_report, materials
    from mtpwrap.errors import ConfigError

    conc = materials.int_list(concurrency, "--concurrency")
    names = [c for c in corpus_names.replace(" ", "").split(",") if c]
    parent = ctx.parent.params if ctx.parent is not None else {}
    url = url or parent.get("url")
    api_key = api_key or parent.get("api_key")
    if not url:
        raise ConfigError("`bench embed` measures a running front: pass --url (and --api-key).")
    plan = embed.EmbedPlan(url=url, api_key=api_key, corpora=names, doc_tokens=doc_tokens,
                           docs=docs, batch=batch, concurrency=conc, rounds=rounds,
                           chat_tokens=chat_tokens, embed_model=embed_model,
                           chat_model=chat_model, timeout_s=float(timeout_s))
    out = materials.report_dir(out_dir, "embed-")
    with console.steps("bench embed", embed.steps(plan)) as step:
        results = embed.run(plan, progress=step)
    files = embed_report.write(results, out)
    alone = embed.no_overlap(results)
    if alone:
        console.warn(f"round(s) {', '.join(map(str, alone))}: no background embedding answer "
                     "came in while the chat decoded, so the busy decode rate may be the chat's "
                     "alone; raise --chat-tokens or lower --batch / --doc-tokens.")
    if as_json:
        console.print_json(results)
        return
    columns, rows = embed_report.table(results)
    console.table(embed_report.title(results), columns, rows)
    console.info(f"report: {files['md']}  (json: {files['json'].name})")
