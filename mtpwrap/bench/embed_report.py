"""The embed benchmark's report: the medians over its rounds (`summarize`), one table with a
row per figure and a column per round (`table`, `title`), and report.json and report.md, each
figure defined (`write`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from mtpwrap.bench import corpora, stats

DEFINITIONS = {
    "docs/s": "passages embedded ÷ wall time of the pass (first request sent to last answer), "
              "c workers each sending the next batch as soon as its previous one is answered.",
    "tokens/s": "the sum of the responses' `usage.prompt_tokens` ÷ the same wall time.",
    "tokens/doc": "`usage.prompt_tokens` ÷ passages: the embedding model's own count of a "
                  "passage cut at --doc-tokens by the front's /tokenize.",
    "chat decode t/s": "tokens after the first ÷ time after the first, of one streamed "
                       "/v1/chat/completions at temperature 0 with `ignore_eos`: llama-server's "
                       "`timings.predicted_per_second` from the last chunk, else the stream's "
                       "(completion tokens − 1) ÷ (last token's arrival − first's).",
    "embedding idle / busy": "the same chat request with no embedding request in flight, and "
                             "while the background load keeps its workers' requests in flight "
                             "from before the request until after its last token.",
    "chat first token s": "seconds from sending the chat request to its first token: under "
                          "load, also the time it waited for the embeddings ahead of it.",
    "busy ÷ idle": "per round, busy decode t/s ÷ idle decode t/s of that round; median column: "
                   "median busy ÷ median idle.",
    "background docs/s": "what the background load embedded while it ran (all its answers ÷ its "
                         "wall time), so the load behind each busy figure is known.",
    "background answers in decode": "the background load's answers that came in between the "
                                    "chat's first and last token. 0: no embedding request "
                                    "finished while the chat decoded, so the busy decode rate "
                                    "may be the chat's alone (a server that ran it first); a "
                                    "longer decode (--chat-tokens) or shorter requests "
                                    "(--batch, --doc-tokens) make them overlap.",
}


def median(values: Sequence[float | None]) -> float | None:
    return stats.percentile([v for v in values if v is not None], 0.5)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: dict) -> dict:
    """Medians over the rounds: per corpus and concurrency, and the chat's idle, busy, ratio."""
    embed: list[dict] = []
    for (name, conc), group in itertools.groupby(
            sorted(results["embed"], key=lambda r: (r["corpus"], r["concurrency"])),
            key=lambda r: (r["corpus"], r["concurrency"])):
        rows = list(group)
        embed.append({"corpus": name, "concurrency": conc, "rounds": len(rows),
                      "docs_per_s": median([r["docs_per_s"] for r in rows]),
                      "tokens_per_s": median([r["tokens_per_s"] for r in rows]),
                      "tokens_per_doc": median([r["tokens_per_doc"] for r in rows])})
    idle = median([c["decode_tokens_per_s"] for c in results["chat"] if c["state"] == "idle"])
    busy = median([c["decode_tokens_per_s"] for c in results["chat"] if c["state"] == "busy"])
    return {"embed": embed, "chat_idle_decode_tokens_per_s": idle,
            "chat_busy_decode_tokens_per_s": busy, "busy_over_idle": ratio(busy, idle)}


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def title(results: dict) -> str:
    m = results["machine"]
    load = " ".join(f"{x:.2f}" for x in m.get("loadavg_start") or []) or "unknown"
    return (f"bench embed, {results['plan']['url']}: {m['cpu_model']} ({m['cpu_count']} CPUs), "
            f"load average at start {load}")


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """The run as one table: a row per figure, a column per round, then the median."""
    rounds = list(range(1, results["plan"]["rounds"] + 1))
    columns = ["measure", "corpus / state", "conc", *[f"round {r}" for r in rounds], "median"]
    rows: list[list[str]] = []
    by = {(r["corpus"], r["concurrency"], r["round"]): r for r in results["embed"]}
    summ = {(s["corpus"], s["concurrency"]): s for s in results["summary"]["embed"]}
    for name in results["plan"]["corpora"]:
        for conc in results["plan"]["concurrency"]:
            s = summ.get((name, conc), {})
            for key, label, fmt in (("docs_per_s", "embed docs/s", "{:.1f}"),
                                    ("tokens_per_s", "embed tokens/s", "{:.0f}"),
                                    ("tokens_per_doc", "embed tokens/doc", "{:.1f}")):
                rows.append([label, name, str(conc),
                             *[_f(by[(name, conc, r)][key], fmt) if (name, conc, r) in by
                               else "–" for r in rounds], _f(s.get(key), fmt)])
    chat = {(c["state"], c["round"]): c for c in results["chat"]}
    src = {c.get("decode_source") for c in results["chat"]}
    what = "chat decode t/s" + (" (stream)" if src == {"stream"} else "")
    load = str(results["plan"]["load_concurrency"])
    s = results["summary"]
    for state, conc, key in (("idle", "–", "chat_idle_decode_tokens_per_s"),
                             ("busy", load, "chat_busy_decode_tokens_per_s")):
        rows.append([what, f"embedding {state}", conc,
                     *[_f((chat.get((state, r)) or {}).get("decode_tokens_per_s")) for r in rounds],
                     _f(s[key])])
    rows.append(["chat busy ÷ idle", "", "",
                 *[_f(ratio((chat.get(("busy", r)) or {}).get("decode_tokens_per_s"),
                            (chat.get(("idle", r)) or {}).get("decode_tokens_per_s")), "{:.3f}")
                   for r in rounds], _f(s["busy_over_idle"], "{:.3f}")])
    for state, conc in (("idle", "–"), ("busy", load)):
        ttft = [(chat.get((state, r)) or {}).get("ttft_s") for r in rounds]
        rows.append(["chat first token s", f"embedding {state}", conc,
                     *[_f(v, "{:.3f}") for v in ttft], _f(median(ttft), "{:.3f}")])
    bg = [((chat.get(("busy", r)) or {}).get("background") or {}).get("docs_per_s")
          for r in rounds]
    rows.append(["background docs/s", "all corpora", load, *[_f(v) for v in bg],
                 _f(median(bg))])
    inside = [((chat.get(("busy", r)) or {}).get("background") or {}).get(
        "answers_during_decode") for r in rounds]
    rows.append(["background answers in decode", "all corpora", load,
                 *[_f(v, "{:.0f}") for v in inside], _f(median(inside), "{:.0f}")])
    return columns, rows


def markdown(results: dict) -> str:
    columns, rows = table(results)
    lines = [f"# {title(results)}", "",
             f"Started {results['started']}, finished {results.get('finished', '?')}. Passages "
             f"of {results['plan']['doc_tokens']} tokens, {results['plan']['docs']} per corpus, "
             f"{results['plan']['batch']} per request; chat: {results['plan']['chat_tokens']} "
             "tokens per request.", "",
             "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    notes = {c.get("attribution") or "" for c in results["corpora"].values()}
    if any(corpora.DOMAINS[n].lang == "ko" for n in results["corpora"] if n in corpora.DOMAINS):
        notes.add(corpora.KOREAN_LEGAL_NOTE)
    notes.discard("")
    if notes:
        lines += ["", "## Corpora", ""] + [f"- {n}" for n in sorted(notes)]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path, md: str | None = None) -> dict[str, Path]:
    """report.json and report.md in `out`: `md`, else this benchmark's markdown (`bench docs`
    writes its own report through here)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "report.json", "md": out / "report.md"}
    files["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    files["md"].write_text(markdown(results) if md is None else md)
    return files
