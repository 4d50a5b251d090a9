"""`mtpwrap bench docs`: the document workflow as a benchmark — one long document asked many
questions, another user's document in between, and the service reloaded, restarted and
crashed under it — each request's read (prefill) measured as llama-server reports it.

A client of a running front (base URL and key), or of one `mtpwrap up` started for the run
(`docs_front.OwnFront`): every request is a streamed `/v1/chat/completions` with
`return_progress`, and every figure but the time to first token is llama-server's own, from
the `timings` of the answer's last chunk: `prompt_n` (tokens read), `cache_n` (tokens taken
from the cache), `prompt_ms`.

Documents: a corpus made into a prompt of exactly `doc_tokens` token ids by
`corpora.build_prompt` (the front's /tokenize), turned back into text by /detokenize (a
character a cut splits is dropped at either end) and sent as text; the document's tokens are
that text counted again by /tokenize. Document A comes from the first corpus, B (another
user's) from the second, or from the same corpus's documents in reverse order.

The read rate against ubatch (`ubatch` cells): each cell a launch of the profile with that
`ubatch` (`runner.start_launch`, as the other benchmarks launch their cells), one cold read of
document A and the first question.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mtpwrap.bench import corpora, docs_front, docs_report, embed, materials, runner, suite
from mtpwrap.decide import profiles
from mtpwrap.errors import ConfigError, RuntimeFailure

SCHEMA = 1
#: the steps, in the order they run; `cold` always runs first (every other step asks about the
#: document it read)
STEPS = tuple(docs_report.STEP_WHAT)
DEFAULT_CORPORA = ("ruling", "licence")
#: tokens kept free in the slot besides the document and the question: the chat template's
RESERVE_TOKENS = 128

QUESTIONS = {
    "ko": {"cold": "이 판결의 주문은 무엇입니까? 한 문장으로 답하십시오.",
           "same": "이 사건의 당사자는 누구입니까?",
           "separate": "법원이 적용한 법률 조항을 모두 나열하십시오.",
           "other": "이 문서의 핵심 의무를 한 문장으로 요약하십시오.",
           "back": "이 판결에서 가장 중요한 쟁점은 무엇입니까?",
           "reload": "상고 또는 항소의 이유는 무엇이었습니까?",
           "restart": "판결이 선고된 날짜는 언제입니까?",
           "crash": "이 판결의 결론을 세 문장으로 요약하십시오."},
    "en": {"cold": "What does this document require of a licensee? Answer in one sentence.",
           "same": "Who are the parties named in this document?",
           "separate": "List every condition on redistribution in this document.",
           "other": "Summarise the main obligation of this document in one sentence.",
           "back": "Which clause limits liability, and what does it say?",
           "reload": "What happens when a party breaches these terms?",
           "restart": "Which law governs this document, if any is named?",
           "crash": "Summarise the conclusion of this document in three sentences."},
}
#: the long first question on document B: numbered instructions, cut to `long_tokens`
INSTRUCTIONS = {
    "ko": ("{i}. 답변할 때 근거가 되는 조항의 번호와 제목을 인용하고, 그 조항이 {who}에게 "
           "적용되는지 밝히십시오. 조항 사이의 충돌이 있으면 {i}번째 원칙에 따라 설명하십시오."),
    "en": ("{i}. When you answer, quote the number and heading of each clause you rely on, say "
           "whether it applies to the {who}, and where two clauses conflict explain which one "
           "prevails under rule {i} and why, citing the text."),
}
WHO = {"ko": ("원고", "피고", "제3자", "법원", "검사"),
       "en": ("licensor", "licensee", "contributor", "distributor", "end user")}


def parse_steps(value: str | None) -> list[str]:
    """`--steps`: a comma list of step names, returned in the order they run, `cold` first."""
    if value is None or value.strip() in ("", "all"):
        return list(STEPS)
    names = [s for s in value.replace(" ", "").split(",") if s]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        raise ConfigError(f"--steps: unknown step(s) {', '.join(unknown)}; choose among "
                          f"{', '.join(STEPS)}.")
    return [s for s in STEPS if s == "cold" or s in names]


@dataclass
class DocsPlan:
    #: the running front (None: start one with `mtpwrap up --profile`)
    url: str | None = None
    api_key: str | None = None
    profile: str | None = None
    binary: str | None = None
    model: str | None = None
    corpora: list[str] = field(default_factory=lambda: list(DEFAULT_CORPORA))
    #: tokens of each document (None: what the slot's context holds)
    doc_tokens: int | None = None
    long_tokens: int = 2048
    steps: list[str] = field(default_factory=lambda: list(STEPS))
    ubatch: list[int] = field(default_factory=list)
    max_tokens: int = 8
    timeout_s: float = 3600.0
    #: the command line, for the report
    command: str = ""

    def __post_init__(self) -> None:
        known = ("ko", "en", *corpora.DOMAINS)
        if not 1 <= len(self.corpora) <= 2 or any(c not in known for c in self.corpora):
            raise ConfigError(f"--corpora must name one or two corpora among "
                              f"{', '.join(known)} (document A's, then B's), got "
                              f"{','.join(self.corpora)!r}.")
        if self.doc_tokens is not None and self.doc_tokens < 64:
            raise ConfigError(f"--doc-tokens must be at least 64, got {self.doc_tokens}.")
        if self.long_tokens < 16:
            raise ConfigError(f"--long-tokens must be at least 16, got {self.long_tokens}.")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be at least 1, got {self.max_tokens}.")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        return d


# -------------------------------------------------------------------------------------------
# The documents


@dataclass
class Doc:
    name: str  # "A" or "B"
    corpus: str
    lang: str
    text: str
    tokens: int  # the text as the front's /tokenize counts it (no special tokens)
    record: dict


def _corpus(name: str, reverse: bool) -> corpora.Corpus:
    corpus = corpora.load(name)
    if reverse:
        corpus = dataclasses.replace(corpus, documents=corpus.documents[::-1])
    return corpus


def make_doc(front: embed.Front, label: str, corpus_name: str, n_tokens: int,
             reverse: bool = False) -> Doc:
    corpus = _corpus(corpus_name, reverse)
    prompt = corpora.build_prompt(corpus, n_tokens, front.tokenize)
    text = embed.trim_cut(front.detokenize(prompt.tokens))
    record = {"source": corpus.source, "lang": corpus.lang, "attribution": corpus.attribution,
              "archive_sha256": corpus.archive_sha256, "cut_tokens": n_tokens,
              "reversed": reverse, "chars": len(text),
              "documents": [{"name": n, "sha256": h, "tokens": k} for n, h, k in prompt.used],
              "near_duplicates_skipped": prompt.skipped_near_duplicates}
    tokens = len(front.tokenize(text))
    record["tokens"] = tokens
    return Doc(label, corpus_name, corpus.lang, text, tokens, record)


def instructions(front: embed.Front, lang: str, n_tokens: int) -> str:
    """Numbered instructions in `lang`, cut at exactly `n_tokens` token ids, as text."""
    lines: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        start = len(lines) + 1
        lines += [INSTRUCTIONS[lang].format(i=i, who=WHO[lang][i % len(WHO[lang])])
                  for i in range(start, start + 16)]
        ids = front.tokenize("\n".join(lines))
    return embed.trim_cut(front.detokenize(ids[:n_tokens]))


def same_message(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


def separate_messages(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": doc}, {"role": "user", "content": question}]


# -------------------------------------------------------------------------------------------
# One request


@dataclass
class Read:
    ttft_s: float | None  # request sent to the first chunk carrying generated text
    total_s: float
    timings: dict
    usage: dict
    progress_events: int
    progress_last: dict | None
    model: str | None


def ask(client: runner.Client, messages: list[dict], max_tokens: int) -> Read:
    """One greedy streamed chat completion with `return_progress`; llama-server's `timings`
    from its last chunk."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True},
                            "return_progress": True, "cache_prompt": True}
    ttft: float | None = None
    timings: dict = {}
    usage: dict = {}
    progress: list[dict] = []
    seen: str | None = None
    t0 = time.perf_counter()
    try:
        with client.http.stream("POST", "/v1/chat/completions", json=body) as r:
            for chunk in runner.events(r, lambda resp: client._check(resp, "/v1/chat/completions")):
                if ttft is None and any((c.get("delta") or {}).get("content")
                                        or (c.get("delta") or {}).get("reasoning_content")
                                        for c in chunk.get("choices") or []):
                    ttft = time.perf_counter() - t0
                if isinstance(chunk.get("prompt_progress"), dict):
                    progress.append(chunk["prompt_progress"])
                timings = chunk.get("timings") or timings
                usage = chunk.get("usage") or usage
                seen = chunk.get("model") or seen
    except httpx.TimeoutException as exc:
        raise RuntimeFailure(f"{client.where}/v1/chat/completions sent nothing for the "
                             "--timeout.") from exc
    except httpx.HTTPError as exc:
        raise RuntimeFailure(f"{client.where}/v1/chat/completions broke off: "
                             f"{type(exc).__name__}: {exc}.") from exc
    return Read(ttft, time.perf_counter() - t0, timings, usage, len(progress),
                progress[-1] if progress else None, seen)


def read_rate(timings: dict) -> float | None:
    """Tokens read per second: llama-server's prompt_n ÷ prompt_ms."""
    n, ms = timings.get("prompt_n"), timings.get("prompt_ms")
    if not isinstance(n, (int, float)) or not isinstance(ms, (int, float)) or ms <= 0:
        return None
    return float(n) / (float(ms) / 1000.0)


def row(step: str, request: str, doc: Doc, question_form: str, read: Read | None,
        action: dict | None = None, error: str | None = None) -> dict:
    """One request's figures; `read` None with the `error` that kept it from an answer."""
    t = read.timings if read else {}
    usage = read.usage if read else {}
    return {"step": step, "request": request, "document": doc.name,
            "document_tokens": doc.tokens, "form": question_form,
            "prompt_tokens": usage.get("prompt_tokens"),
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"),
            "prompt_ms": t.get("prompt_ms"), "read_tokens_per_s": read_rate(t),
            "ttft_s": read.ttft_s if read else None, "total_s": read.total_s if read else None,
            "predicted_n": t.get("predicted_n"),
            "progress_events": read.progress_events if read else 0,
            "progress_last": read.progress_last if read else None, "timings": t,
            "usage": usage, "model": read.model if read else None, "action": action,
            "error": error}


def measure(client: runner.Client, messages: list[dict], max_tokens: int, *, step: str,
            request: str, doc: Doc, form: str, action: dict | None = None) -> dict:
    """One request's row; a request llama-server (or the front) refused or broke off is a row
    with its error, so the steps after it still run."""
    try:
        read = ask(client, messages, max_tokens)
    except RuntimeFailure as exc:
        return row(step, request, doc, form, None, action, str(exc))
    return row(step, request, doc, form, read, action)


# -------------------------------------------------------------------------------------------
# The run


def total_steps(plan: DocsPlan) -> int:
    """Progress steps of `run`: the front's start, the documents, the steps, the cells."""
    return ((0 if plan.url else 1) + (2 if "other" in plan.steps else 1) + len(plan.steps)
            + len(plan.ubatch))


def run(plan: DocsPlan, out: Path, *, progress: Callable[[str], None] = runner.quiet) -> dict:
    """Every step of the plan, then the ubatch cells; the raw results."""
    results: dict = {"schema": SCHEMA, "kind": "bench-docs",
                     "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                     "plan": plan.to_dict(), "machine": embed.machine(), "steps": [],
                     "ubatch": [], "documents": {}}
    results["machine"]["hardware"] = suite.hardware_snapshot()
    with contextlib.ExitStack() as stack:
        if plan.url:
            target = docs_front.Target.running(plan.url, plan.api_key, plan.timeout_s)
        else:
            progress("starting mtpwrap up")
            own = stack.enter_context(docs_front.OwnFront(
                plan.profile, plan.binary, plan.model, out / "up", plan.timeout_s,
                plan.api_key))
            target = own.target
            results["up_command"] = own.argv
        stack.callback(target.close)
        results["front"] = target.health(required=False)
        results["provenance"] = docs_front.provenance(plan, results["front"])
        target.check_actions(plan.steps)
        docs = _documents(plan, target, results, progress)
        for name in plan.steps:
            progress(f"step {name}")
            _step(plan, target, name, docs, results["steps"])
    if plan.ubatch:
        _ubatch_cells(plan, results, docs["A"], out, progress)
    results["provenance"]["binary_sha256_end"] = docs_front.digest(
        results["front"].get("binary"))
    with contextlib.suppress(OSError):
        results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results["summary"] = docs_report.summarize(results)
    return results


def _documents(plan: DocsPlan, target: docs_front.Target, results: dict,
               step: Callable[[str], None]) -> dict[str, Any]:
    """Documents A and B and the questions, made through the front's tokenizer."""
    front = embed.Front(target.url, target.api_key, plan.timeout_s)
    try:
        n_ctx = target.slot_context()
        need = plan.long_tokens + plan.max_tokens + RESERVE_TOKENS
        doc_tokens = plan.doc_tokens or (n_ctx - need if n_ctx else None)
        if doc_tokens is None:
            raise ConfigError("The front's /props gives no slot context; pass --doc-tokens.")
        if n_ctx and doc_tokens + need > n_ctx:
            raise ConfigError(f"--doc-tokens {doc_tokens} with --long-tokens "
                              f"{plan.long_tokens} and --max-tokens {plan.max_tokens} do not fit "
                              f"a slot's {n_ctx} tokens of context (the chat template takes "
                              f"about {RESERVE_TOKENS} more); ask for at most "
                              f"{n_ctx - need} tokens.")
        if doc_tokens < 64:
            raise ConfigError(f"A slot's {n_ctx} tokens of context leave {doc_tokens} for the "
                              "document; lower --long-tokens or raise the profile's context.")
        results["slot_context"] = n_ctx
        name_a = plan.corpora[0]
        name_b = plan.corpora[-1]
        step(f"document A ({name_a}, {doc_tokens} tokens)")
        a = make_doc(front, "A", name_a, doc_tokens)
        docs: dict[str, Any] = {"A": a}
        if "other" in plan.steps:
            step(f"document B ({name_b}, {doc_tokens} tokens)")
            b = make_doc(front, "B", name_b, doc_tokens, reverse=name_b == name_a)
            docs["B"] = b
            docs["long"] = instructions(front, b.lang, plan.long_tokens)
            results["long_question_tokens"] = len(front.tokenize(docs["long"]))
        results["documents"] = {k: v.record for k, v in docs.items() if isinstance(v, Doc)}
        return docs
    finally:
        front.close()


def _step(plan: DocsPlan, target: docs_front.Target, name: str, docs: dict[str, Any],
          rows: list[dict]) -> None:
    a: Doc = docs["A"]
    q = QUESTIONS[a.lang]
    action = None
    if name in ("reload", "restart", "crash"):
        try:
            action = target.act(name)
        except RuntimeFailure as exc:  # the report says so; the steps after it still run
            rows.append(row(name, "A + question", a, "same", None, {"action": name},
                            f"the {name} failed: {exc}"))
            return
    c, n = target.client, plan.max_tokens
    if name == "separate":
        rows.append(measure(c, separate_messages(a.text, q[name]), n, step=name,
                            request="A / question", doc=a, form="separate"))
    elif name == "other":
        b: Doc = docs["B"]
        rows.append(measure(c, same_message(b.text, docs["long"]), n, step=name,
                            request="B + long question", doc=b, form="same"))
        rows.append(measure(c, same_message(b.text, QUESTIONS[b.lang][name]), n, step=name,
                            request="B + question", doc=b, form="same"))
    else:
        rows.append(measure(c, same_message(a.text, q[name]), n, step=name,
                            request="A + question", doc=a, form="same", action=action))


def _ubatch_cells(plan: DocsPlan, results: dict, a: Doc, out: Path,
                  step: Callable[[str], None]) -> None:
    """One launch of the profile per ubatch, each one cold read of A and the first question."""
    prof_name = plan.profile or (results["front"].get("profile") if plan.url else None)
    base = profiles.load_profile(prof_name) if prof_name and prof_name != "auto" \
        else runner.default_profile()
    binary = materials.server_binary(plan.binary or (results["front"].get("binary")
                                                     if plan.url else None))
    model = materials.model_path(plan.model or (results["front"].get("model")
                                                if plan.url else None) or base.model)
    messages = same_message(a.text, QUESTIONS[a.lang]["cold"])
    caps = None
    for ub in plan.ubatch:
        step(f"ubatch {ub}")
        prof = profiles.with_overrides(base, {"ubatch": ub, "model": str(model)},
                                       where=f"the ubatch {ub} cell")
        cl, caps = runner.resolve_profile(prof, binary=binary, model=model, caps=caps)
        launch = {"profile": base.name, "ubatch": cl.ubatch, "batch": cl.batch,
                  "context": cl.context, "slots": cl.slots, "threads": cl.threads}
        try:
            srv = runner.start_launch(cl, caps, binary=binary,
                                      log_path=out / f"ubatch-{ub}.log", timeout=plan.timeout_s,
                                      what=f"llama-server with ubatch {ub}")
        except RuntimeFailure as exc:  # e.g. out of memory at a larger ubatch: the next cell
            cell = row("cold", f"ubatch {ub}", a, "same", None, error=str(exc))
        else:
            client = runner.Client.of(srv)
            try:
                cell = measure(client, messages, plan.max_tokens, step="cold",
                               request=f"ubatch {ub}", doc=a, form="same")
            finally:
                client.close()
                srv.stop()
        cell.update({"ubatch": ub, "launch": launch})
        results["ubatch"].append(cell)
        results["ubatch_binary"] = str(binary)
        results["ubatch_model"] = str(model)
