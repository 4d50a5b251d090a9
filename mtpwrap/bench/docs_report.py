"""The documents benchmark's report: a row per request (`table`: step, tokens read and taken
from the cache, read time and rate, time to first token) and a row per ubatch cell
(`ubatch_table`), report.json with every raw figure and report.md with the machine, the model
and the binary stated, each figure defined (`write`)."""

from __future__ import annotations

from pathlib import Path

from mtpwrap.bench import corpora, embed_report

#: each step of the workflow, in the order they run, and what it asks
STEP_WHAT = {
    "cold": "document A + question 1, one user message, nothing cached",
    "same": "document A + a new question in the same message",
    "separate": "document A as its own user message, the question as a second one",
    "other": "another user's document B with a long first question, then a short question",
    "back": "back to document A, a new question (same message)",
    "reload": "after `mtpwrap reload`, a new question on A",
    "restart": "after `mtpwrap restart`, a new question on A",
    "crash": "after SIGKILL of llama-server and the supervisor's restart, a new question on A",
}
#: a request that read at least this share of its document read it again
REREAD_SHARE = 0.9

DEFINITIONS = {
    "prompt": "tokens of the request's prompt (the chat template applied): llama-server's "
              "`usage.prompt_tokens`.",
    "read": "tokens llama-server computed for this request: `timings.prompt_n`.",
    "cached": "tokens it took from the cache instead (slot, RAM cache or restored snapshot): "
              "`timings.cache_n`.",
    "read s": "llama-server's time reading them: `timings.prompt_ms` ÷ 1000.",
    "read t/s": "read ÷ read s: the read (prefill) rate.",
    "first token s": "seconds from sending the request to the first chunk carrying generated "
                     "text (content or reasoning), on the client: what a user waits for.",
    "ready s": "for reload, restart and crash: seconds from the command (or the SIGKILL) until "
               "the front answered /readyz again, before the question was sent.",
}


def _f(v: float | int | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def summarize(results: dict) -> dict:
    """The cold read's figures, the requests after a document's first that read it again,
    and the read rate of each ubatch cell."""
    rows = results["steps"]
    cold = next((r for r in rows if r["step"] == "cold"), None)
    reread: list[str] = []
    seen: set[str] = set()
    for r in rows:  # a document's first request reads it; the ones after it may read it again
        if (r["document"] in seen and isinstance(r.get("prompt_n"), int)
                and r["prompt_n"] >= REREAD_SHARE * r["document_tokens"]):
            reread.append(f"{r['step']}: {r['request']}")
        seen.add(r["document"])
    return {"cold_read_tokens_per_s": cold["read_tokens_per_s"] if cold else None,
            "cold_ttft_s": cold["ttft_s"] if cold else None,
            "read_again": reread,
            "ubatch_read_tokens_per_s": {str(c["ubatch"]): c["read_tokens_per_s"]
                                         for c in results.get("ubatch") or []}}


def title(results: dict) -> str:
    m = results["machine"]
    docs = results.get("documents") or {}
    a = docs.get("A") or {}
    return (f"bench docs: {a.get('tokens', '?')}-token documents, {m['cpu_model']} "
            f"({m['cpu_count']} CPUs)")


COLUMNS = ["step", "request", "prompt", "read", "cached", "read s", "read t/s",
           "first token s", "ready s"]


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    rows: list[list[str]] = []
    for r in results["steps"]:
        ms = r.get("prompt_ms")
        action = r.get("action") or {}
        rows.append([r["step"], r["request"], _f(r.get("prompt_tokens"), "{:d}"),
                     _f(r.get("prompt_n"), "{:d}"), _f(r.get("cache_n"), "{:d}"),
                     _f(ms / 1000.0 if isinstance(ms, (int, float)) else None, "{:.2f}"),
                     _f(r.get("read_tokens_per_s")), _f(r.get("ttft_s"), "{:.2f}"),
                     _f(action.get("ready_after_s"), "{:.1f}")])
    return COLUMNS, rows


UBATCH_COLUMNS = ["ubatch", "read", "cached", "read s", "read t/s", "first token s"]


def ubatch_table(results: dict) -> tuple[list[str], list[list[str]]]:
    rows: list[list[str]] = []
    for c in results.get("ubatch") or []:
        ms = c.get("prompt_ms")
        rows.append([str(c["launch"].get("ubatch") or c["ubatch"]), _f(c.get("prompt_n"), "{:d}"),
                     _f(c.get("cache_n"), "{:d}"),
                     _f(ms / 1000.0 if isinstance(ms, (int, float)) else None, "{:.2f}"),
                     _f(c.get("read_tokens_per_s")), _f(c.get("ttft_s"), "{:.2f}")])
    return UBATCH_COLUMNS, rows


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
            *["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]]


def _load(values: list[float] | None) -> str:
    return " ".join(f"{x:.2f}" for x in values or []) or "unknown"


def provenance_lines(results: dict) -> list[str]:
    """The machine, its load, the model, the binary and the profile, one line each."""
    m = results["machine"]
    p = results.get("provenance") or {}
    model = p.get("model") or {}
    binary = p.get("binary") or {}
    manifest = binary.get("manifest") or {}
    source = manifest.get("source") or {}
    gpus = (m.get("hardware") or {}).get("gpus") or []
    sha = ((manifest.get("binaries") or {}).get("llama-server") or {}).get("sha256")
    patches = [str(x.get("name")) for x in manifest.get("patches") or []
               if isinstance(x, dict) and x.get("status") == "applied"]
    lines = [f"- Machine: {m['cpu_model']}, {m['cpu_count']} CPUs"
             + (f"; GPUs: {'; '.join(gpus)}" if gpus else "; no GPU"),
             f"- Load average (1, 5, 15 min): {_load(m.get('loadavg_start'))} at the start, "
             f"{_load(m.get('loadavg_end'))} at the end",
             f"- Model: `{Path(str(model.get('path') or '?')).name}`, "
             f"{_f(model.get('bytes'), '{:d}')} bytes, sha256 `{model.get('sha256') or '?'}`",
             f"- Binary: `{binary.get('binary') or '?'}`; commit {p.get('commit') or '?'}"
             + (f"; source {source.get('kind') or ''} {source.get('commit') or ''}".rstrip()
                if source else "")
             + (f"; variant {manifest.get('variant')}" if manifest.get("variant") else "")
             + (f"; sha256 `{p.get('binary_sha256') or sha}`" if p.get("binary_sha256") or sha
                else "")
             + (f" (its manifest records `{sha}`: another build's)"
                if sha and p.get("binary_sha256") and sha != p["binary_sha256"] else "")
             + f"; patches applied: {', '.join(patches) or 'none'}",
             f"- Profile: {p.get('profile') or '?'} (context {p.get('context') or '?'}, KV "
             f"{p.get('kv') or '?'}, speculation "
             f"{p.get('speculation') or ('none' if p.get('profile') else '?')}); slot "
             f"context {results.get('slot_context') or '?'} tokens"
             + ("; started by the benchmark" if p.get("started_by_bench") else "")]
    end = p.get("binary_sha256_end")
    if end and end != p.get("binary_sha256"):
        lines.append(f"- **The binary was replaced during the run** (sha256 `{end}` at the "
                     "end): a restart or crash after that started the new one")
    if (results.get("front") or {}).get("unavailable"):
        lines.append(f"- {results['front']['unavailable']}")
    if results["plan"].get("command"):
        lines.insert(0, f"- Command: `{results['plan']['command']}`")
    return lines


def markdown(results: dict) -> str:
    plan = results["plan"]
    lines = [f"# {title(results)}", "",
             f"Started {results['started']}, finished {results.get('finished', '?')}; "
             f"{plan['max_tokens']} tokens generated per request.", "",
             *provenance_lines(results), ""]
    docs = results.get("documents") or {}
    for name, d in docs.items():
        n = len(d.get("documents") or [])
        lines.append(f"- Document {name}: {d.get('tokens')} tokens of {d.get('source')} "
                     f"({n} document{'' if n == 1 else 's'} joined"
                     + (", in reverse order" if d.get("reversed") else "") + ")")
    if results.get("long_question_tokens"):
        lines.append(f"- B's first question: {results['long_question_tokens']} tokens of "
                     "instructions")
    lines += ["", "## Steps", ""]
    lines += [f"- **{s}**: {STEP_WHAT[s]}" for s in plan["steps"]]
    lines += ["", *_md_table(*table(results))]
    acts = [r for r in results["steps"] if r.get("action")]
    if acts:
        lines += ["", "What each action did:", ""]
        for r in acts:
            a = r["action"]
            said = a.get("output") or (f"llama-server pid {a.get('killed_pid')} killed"
                                       if a.get("killed_pid") else "")
            lines.append(f"- {r['step']}: {' '.join(str(said).split())[:300]}; ready again "
                         f"after {_f(a.get('ready_after_s'), '{:.1f}')} s")
    if results.get("ubatch"):
        lines += ["", "## Read rate against ubatch", "",
                  "Each cell a launch of the profile with that ubatch; one cold read of document "
                  "A and the first question.", "", *_md_table(*ubatch_table(results))]
    failed = [r for r in [*results["steps"], *(results.get("ubatch") or [])] if r.get("error")]
    if failed:
        lines += ["", "Requests without an answer:", ""]
        lines += [f"- {r['step']}, {r['request']}: {' '.join(str(r['error']).split())[:300]}"
                  for r in failed]
    again = (results.get("summary") or {}).get("read_again") or []
    if again:
        lines += ["", f"Requests that read at least {REREAD_SHARE:.0%} of their document "
                      "again: " + "; ".join(again) + "."]
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    notes = {d.get("attribution") or "" for d in docs.values()}
    if any(d.get("lang") == "ko" for d in docs.values()):
        notes.add(corpora.KOREAN_LEGAL_NOTE)
    notes.discard("")
    if notes:
        lines += ["", "## Corpora", ""] + [f"- {n}" for n in sorted(notes)]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> dict[str, Path]:
    return embed_report.write(results, out, markdown(results))
