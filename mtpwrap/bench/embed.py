"""`mtpwrap bench embed`: the embedding companion's throughput, and what it costs the chat model.

A client of a running front (base URL and key), or of one llama-server started with
`--embeddings` standing in for it: the same `/v1/embeddings` and `/v1/chat/completions`.

Passages: each corpus is made into one prompt of exactly `docs × doc_tokens` tokens by
`corpora.build_prompt` (whole documents, each once, near-duplicates skipped, counted by the
front's `/tokenize`), cut into `docs` passages of `doc_tokens` token ids, and each passage is
turned back into text by `/detokenize` (a character a cut splits is dropped at either end).
Passages are sent as text, `batch` to a request (`input` a list), so the embedding model
tokenizes them itself; the tokens counted are the response's `usage.prompt_tokens`, never an
estimate.

A round measures, for each corpus and concurrency level, one pass over the passages (c workers
taking the next batch until none is left; documents/s and tokens/s over the pass's wall time),
then the chat model's decode rate twice: with the embedding companion idle, and while a
background embedding load (all corpora's batches, cycled, at the largest concurrency level)
runs from before the chat request until after its last token. Every time is `time.perf_counter`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import httpx

from mtpwrap.bench import corpora, embed_report
from mtpwrap.bench.runner import Client, events, quiet, run_together
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError, RuntimeFailure

SCHEMA = 1
#: Korean court rulings and English licence texts
DEFAULT_CORPORA = ("ruling", "licence")
#: the chat request of every decode measurement (greedy, `ignore_eos`: exactly max_tokens)
CHAT_PROMPT = ("Write a long, detailed history of lighthouses, from the ancient world to the "
               "automated beacons of today, in plain prose.")
#: what /detokenize gives for the bytes of a character a cut splits
REPLACEMENT = "\ufffd"

T = TypeVar("T")


# -------------------------------------------------------------------------------------------
# The plan


@dataclass
class EmbedPlan:
    url: str
    api_key: str | None = None
    corpora: list[str] = field(default_factory=lambda: list(DEFAULT_CORPORA))
    doc_tokens: int = 256
    docs: int = 64
    batch: int = 8
    concurrency: list[int] = field(default_factory=lambda: [1, 2])
    rounds: int = 3
    chat_tokens: int = 128
    #: the `model` field of embedding requests (None: left out, the front routes by path)
    embed_model: str | None = None
    #: the `model` field of chat requests (None: left out)
    chat_model: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        known = ("ko", "en", *corpora.DOMAINS)
        if not self.corpora or any(c not in known for c in self.corpora):
            raise ConfigError(f"--corpora must list corpora among {', '.join(known)}, got "
                              f"{','.join(self.corpora)!r}.")
        if len(set(self.corpora)) != len(self.corpora):
            raise ConfigError(f"--corpora names a corpus twice: {','.join(self.corpora)!r}.")
        for flag, value, low in (("--doc-tokens", self.doc_tokens, 8), ("--docs", self.docs, 1),
                                 ("--batch", self.batch, 1), ("--rounds", self.rounds, 1),
                                 ("--chat-tokens", self.chat_tokens, 2)):
            if value < low:
                raise ConfigError(f"{flag} must be at least {low}, got {value}.")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ConfigError(f"--concurrency must list positive integers, got "
                              f"{self.concurrency!r}.")

    @property
    def load_concurrency(self) -> int:
        """Workers of the background load: the largest concurrency level."""
        return max(self.concurrency)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        d["load_concurrency"] = self.load_concurrency
        return d


# -------------------------------------------------------------------------------------------
# Pure parts


def batches(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive groups of `size` items, in order; the last one holds what is left."""
    if size < 1:
        raise ConfigError(f"--batch must be at least 1, got {size}.")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def passages(tokens: Sequence[int], doc_tokens: int) -> list[list[int]]:
    """`tokens` cut into consecutive passages of exactly `doc_tokens` ids (a short tail is
    dropped)."""
    if doc_tokens < 1:
        raise ConfigError(f"--doc-tokens must be at least 1, got {doc_tokens}.")
    n = len(tokens) // doc_tokens
    return [list(tokens[i * doc_tokens:(i + 1) * doc_tokens]) for i in range(n)]


def trim_cut(text: str) -> str:
    """A detokenized passage less the pieces of a character its cuts split (U+FFFD at either
    end)."""
    return text.strip(REPLACEMENT)


def rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def stream_decode_rate(arrivals: Sequence[float], n_tokens: int) -> float | None:
    """Tokens after the first ÷ time after the first: the same definition as the main bench's
    `client_decode_tokens_per_s`, with the count from the server (a chunk can carry a token
    held back from the one before)."""
    if len(arrivals) < 2 or n_tokens < 2:
        return None
    return rate(n_tokens - 1, arrivals[-1] - arrivals[0])


def machine() -> dict:
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {"cpu_model": hardware.cpu_model(), "cpu_count": os.cpu_count(), "loadavg_start": load}


# -------------------------------------------------------------------------------------------
# The front's API


def _ok(r: httpx.Response, where: str, what: str) -> httpx.Response:
    if r.status_code == 401:
        raise ConfigError(f"{where} refused {what} (401); pass the right --api-key.")
    if r.status_code >= 400:
        raise RuntimeFailure(f"{where} {what} answered {r.status_code}: {r.text[:300]}")
    return r


@dataclass
class EmbedReply:
    docs: int
    prompt_tokens: int
    seconds: float
    model: str | None
    done_at: float = 0.0  # time.perf_counter() when the answer was in


@dataclass
class ChatReply:
    arrivals: list[float]  # seconds since the request was sent, per chunk that carried text
    tokens: int  # completion tokens: usage, else timings.predicted_n, else chunks with text
    total_s: float
    timings: dict
    model: str | None
    sent_at: float = 0.0  # time.perf_counter() when the request was sent

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    @property
    def decode_window(self) -> tuple[float, float] | None:
        """perf_counter() of the first and the last token's arrival."""
        if len(self.arrivals) < 2:
            return None
        return self.sent_at + self.arrivals[0], self.sent_at + self.arrivals[-1]


class Front:
    """The routes of a front (or a llama-server standing in for one) the benchmark uses."""

    def __init__(self, url: str, api_key: str | None, timeout: float = 600.0):
        self.client = Client(url, api_key, timeout)
        self.where = self.client.where
        self.timeout = timeout

    def _broke(self, path: str, exc: httpx.HTTPError) -> RuntimeFailure:
        if isinstance(exc, httpx.TimeoutException):
            return RuntimeFailure(f"{self.where}{path} sent nothing for {self.timeout:.0f} s "
                                  "(--timeout).")
        return RuntimeFailure(f"{self.where}{path} broke off: {type(exc).__name__}: {exc}.")

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self.client.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise self._broke(path, exc) from exc
        return dict(_ok(r, self.where, path).json())

    def tokenize(self, text: str) -> list[int]:
        """Token ids without special tokens (how `corpora.build_prompt` counts)."""
        return self.client.tokenize(text)

    def count(self, text: str) -> int:
        """Tokens of `text` with the special tokens an embedding request adds."""
        return len(self._post("/tokenize", {"content": text, "add_special": True})["tokens"])

    def detokenize(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": ids})["content"])

    def models(self) -> list[str]:
        """The ids /v1/models lists (empty when it lists none or cannot say); the first
        request, so an unreachable front (httpx.HTTPError) is known before corpora load."""
        r = self.client.http.get("/v1/models")
        try:
            data = _ok(r, self.where, "/v1/models").json().get("data") or []
        except (RuntimeFailure, ValueError, AttributeError):
            return []
        return [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id")]

    def embed(self, texts: list[str], model: str | None) -> EmbedReply:
        body: dict[str, Any] = {"input": texts, "encoding_format": "float"}
        if model is not None:
            body["model"] = model
        t0 = time.perf_counter()
        out = self._post("/v1/embeddings", body)
        done = time.perf_counter()
        seconds = done - t0
        data = out.get("data")
        if not isinstance(data, list) or len(data) != len(texts):
            raise RuntimeFailure(f"{self.where}/v1/embeddings answered {len(texts)} inputs with "
                                 f"{len(data) if isinstance(data, list) else 'no'} embeddings.")
        usage = out.get("usage") or {}
        if not isinstance(usage.get("prompt_tokens"), int):
            raise RuntimeFailure(f"{self.where}/v1/embeddings gave no usage.prompt_tokens; "
                                 "the benchmark counts tokens from it, never by estimate.")
        return EmbedReply(len(texts), usage["prompt_tokens"], seconds, out.get("model"), done)

    def chat(self, max_tokens: int, model: str | None) -> ChatReply:
        """One greedy streamed chat completion of exactly `max_tokens` tokens."""
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
        if model is not None:
            body["model"] = model
        arrivals: list[float] = []
        timings: dict = {}
        usage: dict = {}
        seen: str | None = None
        t0 = time.perf_counter()
        try:
            with self.client.http.stream("POST", "/v1/chat/completions", json=body) as r:
                for chunk in events(r, lambda resp: _ok(resp, self.where, "/v1/chat/completions")):
                    now = time.perf_counter() - t0
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content"):
                            arrivals.append(now)
                            break
                    timings = chunk.get("timings") or timings
                    usage = chunk.get("usage") or usage
                    seen = chunk.get("model") or seen
        except httpx.HTTPError as exc:
            raise self._broke("/v1/chat/completions", exc) from exc
        total = time.perf_counter() - t0
        n = usage.get("completion_tokens") or timings.get("predicted_n") or len(arrivals)
        return ChatReply(arrivals, int(n), total, timings, seen, t0)


# -------------------------------------------------------------------------------------------
# Measuring


@dataclass
class CorpusPassages:
    name: str
    texts: list[str]
    #: where the passages came from, and each one's tokens as the front's /tokenize counts it
    record: dict


def make_passages(front: Front, name: str, docs: int, doc_tokens: int) -> CorpusPassages:
    corpus = corpora.load(name)
    prompt = corpora.build_prompt(corpus, docs * doc_tokens, front.tokenize)
    texts = [trim_cut(front.detokenize(ids)) for ids in passages(prompt.tokens, doc_tokens)]
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise RuntimeFailure(f"Passages {empty} of the {name} corpus are empty once cut at "
                             f"{doc_tokens} tokens; ask for longer --doc-tokens.")
    counts = [front.count(t) for t in texts]
    record = {"source": corpus.source, "lang": corpus.lang, "attribution": corpus.attribution,
              "archive_sha256": corpus.archive_sha256, "passages": len(texts),
              "doc_tokens": doc_tokens, "tokenize_counts": counts,
              "documents": [{"name": n, "sha256": h, "tokens": k} for n, h, k in prompt.used],
              "near_duplicates_skipped": prompt.skipped_near_duplicates}
    return CorpusPassages(name, texts, record)


def _workers(url: str, api_key: str | None, timeout: float, n: int,
             take: Callable[[], list[str] | None], model: str | None,
             stop: threading.Event | None = None,
             first: threading.Event | None = None) -> tuple[list[threading.Thread],
                                                            list[EmbedReply], list[Exception]]:
    """`n` threads, each with its own connection, embedding what `take` hands out until it
    hands out None (or `stop` is set)."""
    replies: list[EmbedReply] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def work() -> None:
        front = Front(url, api_key, timeout)
        try:
            while stop is None or not stop.is_set():
                texts = take()
                if texts is None:
                    return
                rep = front.embed(texts, model)
                with lock:
                    replies.append(rep)
                if first is not None:
                    first.set()
        except Exception as exc:  # reported after the join, never swallowed
            with lock:
                errors.append(exc)
            if first is not None:
                first.set()
        finally:
            front.close()

    return [threading.Thread(target=work, daemon=True) for _ in range(n)], replies, errors


def _raise_first(errors: list[Exception], what: str) -> None:
    if errors:
        exc = errors[0]
        if isinstance(exc, (ConfigError, RuntimeFailure)):
            raise exc
        raise RuntimeFailure(f"{what}: {type(exc).__name__}: {exc}") from exc


def embed_pass(plan: EmbedPlan, groups: list[list[str]], concurrency: int) -> dict:
    """One pass over `groups` (batches of passages) by `concurrency` workers, timed from the
    first request sent to the last answer received."""
    queue: Iterator[list[str]] = iter(groups)
    lock = threading.Lock()

    def take() -> list[str] | None:
        with lock:
            return next(queue, None)

    threads, replies, errors = _workers(plan.url, plan.api_key, plan.timeout_s, concurrency,
                                        take, plan.embed_model)
    wall = run_together(threads)
    _raise_first(errors, "an embedding request failed")
    docs = sum(r.docs for r in replies)
    tokens = sum(r.prompt_tokens for r in replies)
    return {"requests": len(replies), "docs": docs, "prompt_tokens": tokens, "wall_s": wall,
            "docs_per_s": rate(docs, wall), "tokens_per_s": rate(tokens, wall),
            "tokens_per_doc": tokens / docs if docs else None,
            "request_s": [r.seconds for r in replies],
            "models": sorted({r.model for r in replies if r.model})}


class BackgroundLoad:
    """Embedding requests kept in flight by `concurrency` workers, cycling through `groups`,
    from `start()` (which returns once the first answer came back) until `stop()`."""

    def __init__(self, plan: EmbedPlan, groups: list[list[str]], concurrency: int):
        cycle = itertools.cycle(groups)
        lock = threading.Lock()

        def take() -> list[str] | None:
            with lock:
                return next(cycle)

        self.stop_event = threading.Event()
        self.first = threading.Event()
        self.threads, self.replies, self.errors = _workers(
            plan.url, plan.api_key, plan.timeout_s, concurrency, take, plan.embed_model,
            stop=self.stop_event, first=self.first)
        self.timeout = plan.timeout_s
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        if not self.first.wait(self.timeout):
            self.stop()
            raise RuntimeFailure(f"The background embedding load had no answer within "
                                 f"{self.timeout:.0f} s (--timeout).")
        if self.errors:
            self.stop()

    def stop(self, window: tuple[float, float] | None = None) -> dict:
        """Stop and join the workers; what they embedded, and of it what was answered within
        `window` (perf_counter() from, to: the chat's decode)."""
        self.stop_event.set()
        for t in self.threads:
            t.join()
        wall = time.perf_counter() - self.t0
        _raise_first(self.errors, "a background embedding request failed")
        docs = sum(r.docs for r in self.replies)
        tokens = sum(r.prompt_tokens for r in self.replies)
        inside = [r for r in self.replies if window and window[0] <= r.done_at <= window[1]]
        return {"concurrency": len(self.threads), "requests": len(self.replies), "docs": docs,
                "prompt_tokens": tokens, "wall_s": wall, "docs_per_s": rate(docs, wall),
                "tokens_per_s": rate(tokens, wall),
                "answers_during_decode": len(inside),
                "tokens_during_decode": sum(r.prompt_tokens for r in inside)}


def chat_row(reply: ChatReply, state: str, rnd: int) -> dict:
    server = reply.timings.get("predicted_per_second")
    stream = stream_decode_rate(reply.arrivals, reply.tokens)
    return {"round": rnd, "state": state, "tokens": reply.tokens, "ttft_s": reply.ttft_s,
            "total_s": reply.total_s, "server_decode_tokens_per_s": server,
            "stream_decode_tokens_per_s": stream,
            "decode_tokens_per_s": server if server is not None else stream,
            "decode_source": "timings" if server is not None else "stream",
            "timings": reply.timings, "model": reply.model}


def no_overlap(results: dict) -> list[int]:
    """Rounds whose busy chat decoded while no background embedding answer came in."""
    return [c["round"] for c in results["chat"] if c["state"] == "busy"
            and not (c.get("background") or {}).get("answers_during_decode")]


def steps(plan: EmbedPlan) -> int:
    """Progress steps of `run`: the passages, a warm-up, then each round's passes and chats."""
    return len(plan.corpora) + 1 + plan.rounds * (len(plan.corpora) * len(plan.concurrency) + 2)


def run(plan: EmbedPlan, *, progress: Callable[[str], None] = quiet) -> dict:
    """Every round of the plan against the front at `plan.url`; the raw results."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results: dict = {"schema": SCHEMA, "kind": "bench-embed", "started": started,
                     "plan": plan.to_dict(), "machine": machine(), "corpora": {},
                     "embed": [], "chat": []}
    front = Front(plan.url, plan.api_key, plan.timeout_s)
    try:
        _measure(plan, front, results, progress)
    except httpx.HTTPError as exc:
        raise RuntimeFailure(f"{front.where} did not answer ({type(exc).__name__}: {exc}); "
                             "is the front running at --url?") from exc
    finally:
        front.close()
    with contextlib.suppress(OSError):
        results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results["summary"] = embed_report.summarize(results)
    return results


def _measure(plan: EmbedPlan, front: Front, results: dict, step: Callable[[str], None]) -> None:
    """The passages, a warm-up, then the rounds, recorded into `results`."""
    results["front"] = {"url": plan.url, "models_listed": front.models()}
    groups: dict[str, list[list[str]]] = {}
    for name in plan.corpora:
        step(f"passages {name}")
        p = make_passages(front, name, plan.docs, plan.doc_tokens)
        results["corpora"][name] = p.record
        groups[name] = batches(p.texts, plan.batch)
    # Warm-up, not recorded: the first requests of a fresh server allocate and compile.
    step("warm-up")
    answered = {front.embed(groups[name][0], plan.embed_model).model for name in plan.corpora}
    results["front"]["embed_model_answered"] = sorted(m for m in answered if m)
    results["front"]["chat_model_answered"] = front.chat(min(8, plan.chat_tokens),
                                                         plan.chat_model).model
    everything = [g for name in plan.corpora for g in groups[name]]
    for rnd in range(1, plan.rounds + 1):
        for name in plan.corpora:
            for conc in plan.concurrency:
                step(f"round {rnd}: embed {name} x{conc}")
                row = embed_pass(plan, groups[name], conc)
                results["embed"].append({"round": rnd, "corpus": name, "concurrency": conc,
                                         "tokenize_tokens": sum(
                                             results["corpora"][name]["tokenize_counts"]),
                                         **row})
        step(f"round {rnd}: chat, embedding idle")
        results["chat"].append(chat_row(front.chat(plan.chat_tokens, plan.chat_model),
                                        "idle", rnd))
        step(f"round {rnd}: chat, embedding busy")
        load = BackgroundLoad(plan, everything, plan.load_concurrency)
        load.start()
        reply: ChatReply | None = None
        try:
            reply = front.chat(plan.chat_tokens, plan.chat_model)
        finally:
            background = load.stop(reply.decode_window if reply else None)
        row = chat_row(reply, "busy", rnd)
        row["background"] = background
        results["chat"].append(row)
