"""`mtpwrap bench docs`: a long document asked many questions — what each read costs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from mtpwrap.config.options import setting_option, shared_option


def _without_key(argv: list[str]) -> list[str]:
    """The command line for the report, the API key's value left out."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--api-key":
            arg = "…"
        elif arg.startswith("--api-key="):
            arg = "--api-key=…"
        out.append(arg)
    return out


@click.command("docs")
@shared_option("MTPWRAP_BENCH_URL",
               help="Base URL of the running front (default: `mtpwrap bench --url`; neither: "
                    "start `mtpwrap up --profile` for the run).")
@shared_option("MTPWRAP_API_KEY")
@setting_option("profile", default=None,
                help="Profile of the front started for the run and of the ubatch cells "
                     "(default: the one `up` chooses here; with --url, the front's).")
@setting_option("binary", "binary_opt",
                help="llama-server to run (default: the newest `mtpwrap build`).")
@setting_option("model", help="GGUF model, overriding the profile's.")
@click.option("--corpora", "corpus_names", default="ruling,licence",
              envvar="MTPWRAP_BENCH_DOCS_CORPORA", show_default=True,
              help="Document A's corpus, then B's (the other user's): ruling, statute, "
                   "interpretation, ko (Korean); licence, en (English). One name: both from it.")
@click.option("--doc-tokens", type=click.IntRange(64, 10_000_000), default=None,
              envvar="MTPWRAP_BENCH_DOCS_DOC_TOKENS",
              help="Tokens of each document (default: what one slot's context holds besides "
                   "the long question and the answer).")
@click.option("--long-tokens", type=click.IntRange(16, 1_000_000), default=2048,
              envvar="MTPWRAP_BENCH_DOCS_LONG_TOKENS", show_default=True,
              help="Tokens of the instructions that are B's first question.")
@click.option("--steps", "steps", default="all", envvar="MTPWRAP_BENCH_DOCS_STEPS",
              show_default=True,
              help="Steps to run, comma-separated: cold, same, separate, other, back, reload, "
                   "restart, crash (cold always runs first).")
@click.option("--ubatch", default=None, envvar="MTPWRAP_BENCH_DOCS_UBATCH",
              help="ubatch cells, comma-separated: each a launch of the profile with that "
                   "ubatch, one cold read ('none': no cells; default 32,128,512, none with "
                   "--url).")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=8,
              envvar="MTPWRAP_BENCH_DOCS_MAX_TOKENS", show_default=True,
              help="Tokens generated per request.")
@click.option("--timeout", "timeout_s", type=click.IntRange(1, 86_400), default=3600,
              envvar="MTPWRAP_BENCH_DOCS_TIMEOUT", show_default=True,
              help="Seconds one request, start or recovery may take.")
@shared_option("MTPWRAP_JSON", help="Print the results as JSON.")
@shared_option("MTPWRAP_BENCH_OUT", help="Report folder (default ./bench-results/docs-TIMESTAMP).")
@click.pass_context
def command(ctx: click.Context, url: str | None, api_key: str | None, profile: str | None,
            binary_opt: str | None, model: str | None, corpus_names: str,
            doc_tokens: int | None, long_tokens: int, steps: str, ubatch: str | None,
            max_tokens: int, timeout_s: int, as_json: bool, out_dir: Path | None) -> None:
    """Measure the document workflow: a cold read of a long document, new questions on it (in
    the same message, in a message of their own), another user's document in between, and the
    same document after a reload, a restart and a crash of llama-server; each request's tokens
    read and taken from the cache, read rate and time to first token, then the read rate
    against ubatch. Write JSON and Markdown."""
    from mtpwrap import console
    from mtpwrap.bench import docs, docs_report, materials

    parent = ctx.parent.params if ctx.parent is not None else {}
    url = url or parent.get("url")
    api_key = api_key or parent.get("api_key")
    if ubatch is None:
        ubatch = "none" if url else "32,128,512"
    cells = [] if ubatch.strip().lower() == "none" else materials.int_list(ubatch, "--ubatch")
    plan = docs.DocsPlan(url=url, api_key=api_key, profile=profile, binary=binary_opt,
                         model=model,
                         corpora=[c for c in corpus_names.replace(" ", "").split(",") if c],
                         doc_tokens=doc_tokens, long_tokens=long_tokens,
                         steps=docs.parse_steps(steps), ubatch=cells, max_tokens=max_tokens,
                         timeout_s=float(timeout_s),
                         command=shlex.join(["mtpwrap", *_without_key(sys.argv[1:])]))
    out = materials.report_dir(out_dir, "docs-")
    with console.steps("bench docs", docs.total_steps(plan)) as step:
        results = docs.run(plan, out, progress=step)
    files = docs_report.write(results, out)
    if as_json:
        console.print_json(results)
        return
    console.table(docs_report.title(results), *docs_report.table(results))
    if results["ubatch"]:
        console.table("read rate against ubatch", *docs_report.ubatch_table(results))
    console.info(f"report: {files['md']}  (json: {files['json'].name})")
