"""Drive llama-server over HTTP for the benchmark, or launch one configuration of it.

The bench is a client: every figure comes from a real server's HTTP API (`/completion` streamed
for timing, `/tokenize`, `/metrics`, `/props`). `launch_config` starts one cell of the matrix: the
benchmark's profile with the cell's overrides, resolved and rendered as `up` would.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from mtpwrap import upstream
from mtpwrap.bench import kv, stats, tokenclass
from mtpwrap.build import trial
from mtpwrap.build.probe import probe
from mtpwrap.decide import profiles, resolve
from mtpwrap.decide.vocab import KV_TYPES, SPEC_KINDS
from mtpwrap.errors import ConfigError, RuntimeFailure
from mtpwrap.supervision.inputs import load_snapshot

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.launch import LaunchConfig
    from mtpwrap.decide.profile_types import Profile
    from mtpwrap.proc import ServerProcess

#: the n-gram lookup length of ngram cells (short: the bench's prompts repeat little)
NGRAM_LOOKUP = 3


@dataclass
class BenchConfig:
    """One cell of the matrix: the knobs the benchmark varies, applied to a profile as overrides
    (see `cell_profile`), so each cell is a launch `up` could run."""

    name: str
    spec: str = "none"  # none | draft | ngram | mtp
    depth: int = 3  # draft tokens per step (ngram: the m-gram length)
    p_min: float | None = None  # minimum draft probability (draft/mtp kinds)
    kv: str | None = "f16"  # -ctk/-ctv; None: the profile's own
    draft_model: str | None = None  # draft kind: the drafter GGUF (default: the model itself)

    def __post_init__(self) -> None:
        if self.spec not in SPEC_KINDS:
            raise ConfigError(
                f"Unknown speculation kind {self.spec!r} in configuration {self.name!r};"
                f" expected one of {', '.join(SPEC_KINDS)}."
            )
        if self.kv is not None and self.kv not in KV_TYPES:
            raise ConfigError(
                f"Unknown KV cache type {self.kv!r} in configuration {self.name!r};"
                f" expected one of {', '.join(KV_TYPES)}."
            )
        if self.spec != "none" and self.depth < 1:
            raise ConfigError(f"Draft depth must be >= 1 in configuration {self.name!r}.")

    @property
    def speculative(self) -> bool:
        return self.spec != "none"

    def to_dict(self) -> dict:
        return asdict(self)

    def overrides(self, model: str | Path) -> dict[str, Any]:
        """This cell as profile keys."""
        spec: dict[str, Any] = {"kind": self.spec}
        if self.spec != "none":
            spec["depth"] = self.depth
            if self.p_min is not None and self.spec != "ngram":
                spec["p_min"] = self.p_min
            if self.spec == "draft":
                spec["draft_model"] = str(self.draft_model or model)
            if self.spec == "ngram":
                spec["ngram_n"] = NGRAM_LOOKUP
        out: dict[str, Any] = {"spec": spec}
        if self.kv is not None:
            out["kv"] = {"k": [self.kv], "v": [self.kv]}
        return out


def cell_profile(cfg: BenchConfig, base: Profile, *, drafter: str | Path,
                 **keys: Any) -> Profile:
    """`base` with the cell's knobs and any other profile `keys` (model, context, slots,
    threads, ...) replaced; None values leave the profile's own. `drafter`: the draft model of
    a draft cell that names none (the target itself)."""
    changes = {**cfg.overrides(drafter), **{k: v for k, v in keys.items() if v is not None}}
    return profiles.with_overrides(base, changes, where=f"benchmark configuration {cfg.name!r}")


def default_profile() -> Profile:
    """The profile a benchmark derives its cells from when none is named: the one `up` would
    choose on this machine."""
    return profiles.select_profile(load_snapshot(None))[0]


def resolve_profile(prof: Profile, *, binary: Path, model: Path,
                    caps: Capabilities | None = None) -> tuple[LaunchConfig, Capabilities]:
    """A profile's launch on this binary, resolved as `up` resolves it (no hardware check, no
    memory plan: a measurement, not a service)."""
    caps = caps or probe(binary)
    r = resolve.resolve(prof, snapshot=None, caps=caps, model=model, binary=binary, plan=False)
    return r.launch, caps


def cell_launch(cfg: BenchConfig, *, binary: Path, model: Path, ctx_size: int | None,
                parallel: int | None = 1, threads: int | None = None,
                profile: Profile | None = None, caps: Capabilities | None = None
                ) -> tuple[LaunchConfig, Capabilities]:
    """The launch of one cell, with what the benchmark reads besides the API: flash attention
    on in every cell (so cells compare), no warm-up, and log verbosity 4 (where llama.cpp logs
    the KV cache it allocated)."""
    prof = cell_profile(cfg, profile or default_profile(), drafter=model, context=ctx_size,
                        slots=parallel, threads=threads, flash_attn="on", no_warmup=True)
    cl, caps = resolve_profile(prof, binary=binary, model=model, caps=caps)
    cl = cl.replace(verbosity=4, why={"verbosity": "the benchmark reads the KV allocation from "
                                                   "the log"})
    return cl, caps


def launch_config(cfg: BenchConfig, *, binary: Path, model: Path, ctx_size: int | None,
                  parallel: int | None = 1, log_path: Path | None = None,
                  threads: int | None = None, extra: list[str] | None = None,
                  timeout: float = 300.0, profile: Profile | None = None,
                  tcp: bool = False) -> ServerProcess:
    """Start llama-server for `cfg` and wait until /health says ok; `Client.of` reaches it
    (its own UNIX socket when the binary binds one; `tcp`: loopback TCP all the same, for a
    server another program is given by URL).

    `stop()` sends SIGTERM, waits, then SIGKILLs the process group; it is idempotent. A server
    that exits or does not become healthy is stopped and reported with its log's last line.
    """
    cl, caps = cell_launch(cfg, binary=binary, model=model, ctx_size=ctx_size,
                           parallel=parallel, threads=threads, profile=profile)
    return start_launch(cl, caps, binary=binary, log_path=log_path, extra=extra,
                        timeout=timeout, tcp=tcp,
                        what=f"llama-server for configuration {cfg.name!r}")


def start_launch(cl: LaunchConfig, caps: Capabilities, *, binary: Path,
                 log_path: Path | None = None, extra: list[str] | None = None,
                 timeout: float = 300.0, what: str = "llama-server", tcp: bool = False
                 ) -> ServerProcess:
    """Render `cl` for this binary and start it where every temporary server listens
    (`mtpwrap.build.trial`); its own process group; ready at /health."""
    # The build ships its shared libraries next to the binary; the launch's own environment
    # (e.g. the fork's switch for a tbq3_0 V cache) is added by trial.start.
    env = {"LD_LIBRARY_PATH": f"{Path(binary).parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    return trial.start(cl, caps, binary=binary, extra=extra or [], env=env, tcp=tcp,
                       log_path=Path(log_path) if log_path else None, timeout=timeout,
                       what=what)


# --------------------------------------------------------------------------------------------
# HTTP client


@dataclass
class StreamResult:
    pieces: list[str]  # text of each streamed chunk, one per generated token
    token_ids: list[int]
    arrivals: list[float]  # seconds since the request was sent, per chunk
    ttft: float | None
    total_s: float
    timings: dict
    probs: list[float | None] = field(default_factory=list)  # log-probability per token
    held: list[bool] = field(default_factory=list)  # True: text held back, sent with the next

    @property
    def n(self) -> int:
        return len(self.pieces)


def quiet(what: str) -> None:
    """The progress callback that shows nothing: a run's default."""


def events(r: httpx.Response, check: Callable[[httpx.Response], object]) -> Iterator[dict]:
    """The JSON chunks of a streamed answer, up to `data: [DONE]`; an answer with an error
    status is read in full and handed to `check`, which raises."""
    if r.status_code >= 400:
        r.read()
        check(r)
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


class Client:
    """A running llama-server or mtpwrap front end."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, *,
                 socket: str | None = None):
        self.base_url = base_url.rstrip("/")
        #: the UNIX socket it listens on (None: TCP at base_url)
        self.socket = socket
        #: where it is, in messages
        self.where = f"unix:{socket}" if socket else self.base_url
        # No keep-alive: llama-server closes a connection after each streamed answer without
        # saying so, and a pooled connection closed under us reads as "server disconnected".
        self.http = upstream.client(socket, base_url=self.base_url, api_key=api_key,
                                    timeout=httpx.Timeout(timeout, connect=10.0),
                                    keepalive=False)

    @classmethod
    def of(cls, srv: ServerProcess, api_key: str | None = None) -> Client:
        """A client to a server `launch_config` or `start_launch` started."""
        return cls(srv.base_url, api_key, socket=srv.socket)

    def close(self) -> None:
        self.http.close()

    def _check(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code == 401:
            raise ConfigError(f"{self.where} refused {what} (401); pass the right --api-key.")
        if r.status_code == 501 and what == "/metrics":
            raise ConfigError(
                f"{self.where} serves no /metrics; start llama-server with --metrics."
            )
        if r.status_code >= 400:
            raise RuntimeFailure(f"{self.where} {what} answered {r.status_code}: {r.text[:200]}")
        return r

    def props(self) -> dict:
        try:
            r = self.http.get("/props")
        except httpx.HTTPError as exc:
            raise RuntimeFailure(f"Cannot reach {self.where}: {exc}.") from exc
        return dict(self._check(r, "/props").json())

    def tokenize(self, text: str) -> list[int]:
        r = self._check(self.http.post("/tokenize", json={"content": text}), "/tokenize")
        return [int(t) for t in r.json()["tokens"]]

    def metrics(self) -> stats.Counters:
        r = self._check(self.http.get("/metrics"), "/metrics")
        return stats.Counters.from_metrics(stats.parse_metrics(r.text))

    def complete(self, prompt: list[int], n_predict: int, *, n_probs: int = 0) -> StreamResult:
        """One greedy streamed completion; timing is taken per chunk as it arrives."""
        body = {"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0.0,
                "top_k": 1, "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "n_probs": n_probs}
        pieces: list[str] = []
        ids: list[int] = []
        arrivals: list[float] = []
        probs: list[float | None] = []
        held: list[bool] = []
        timings: dict = {}
        t0 = time.perf_counter()
        with self.http.stream("POST", "/completion", json=body) as r:
            for chunk in events(r, lambda resp: self._check(resp, "/completion")):
                now = time.perf_counter() - t0
                content = chunk.get("content", "") or ""
                toks = chunk.get("tokens") or []
                done = chunk.get("tokens_predicted")
                # llama-server holds back a token that ends inside a multi-byte character and
                # sends it with the next one; `tokens_predicted` counts them all. Held-back
                # tokens get an empty piece and id -1 (their ids are not sent).
                m = int(done) - len(pieces) if done is not None else max(len(toks),
                                                                         1 if content else 0)
                for j in range(m):
                    last = j == m - 1
                    pieces.append(content if last else "")
                    ids.append(int(toks[-1]) if last and toks else -1)
                    arrivals.append(now)
                    held.append(not last)
                cps = chunk.get("completion_probabilities") or []
                for j in range(m):
                    last = j == m - 1
                    probs.append(cps[-1].get("logprob") if last and cps else None)
                if chunk.get("stop"):
                    timings = chunk.get("timings", {}) or {}
        total = time.perf_counter() - t0
        return StreamResult(pieces, ids, arrivals, arrivals[0] if arrivals else None, total,
                            timings, probs, held)


# --------------------------------------------------------------------------------------------
# Stream timing: which tokens came out of one verification step


def bursts(arrivals: list[float], gap_s: float, cap: int | None = None) -> list[int]:
    """Sizes of runs of tokens whose arrivals are within `gap_s` of the previous token.

    llama-server emits all tokens of one verification step (the accepted drafts plus the
    target's own token) back to back, while consecutive steps are a full forward pass apart.
    `cap` is the most tokens one step can emit (depth + 1). A token whose text ends inside a
    multi-byte character is held back and sent with the next step's first token, so a run
    longer than `cap` hands its surplus back to the run before it, as far as that one has room.
    Held-back tokens from steps that emitted nothing else stay invisible: the report measures
    that error against the server's counters.
    """
    if not arrivals:
        return []
    sizes = [1]
    for prev, cur in zip(arrivals, arrivals[1:], strict=False):
        if cur - prev <= gap_s:
            sizes[-1] += 1
        else:
            sizes.append(1)
    if cap:
        # Only the run just before can have held a token back, and only as far as it had room.
        for i in range(len(sizes) - 1, 0, -1):
            move = min(sizes[i] - cap, cap - sizes[i - 1])
            if move > 0:
                sizes[i - 1] += move
                sizes[i] -= move
    return sizes


def rejection_points(result: StreamResult, depth: int, gap_s: float) -> dict[str, dict]:
    """Per token class: tokens at drafted positions and rejections, inferred from bursts.

    The first token (from prefill) is skipped. In a burst of g tokens, the first g-1 were
    accepted drafts; if g-1 < depth the last one is the target's correction of a rejected draft
    (a rejection at that token's class); if g-1 == depth it is the bonus token and not counted.
    The request's last burst is skipped: the token limit, not a rejection, may have cut it.
    """
    classes = tokenclass.classify_pieces(result.pieces)
    per: dict[str, dict] = {c: {"drafted_positions": 0, "rejections": 0}
                            for c in tokenclass.CLASSES}
    sizes = bursts(result.arrivals[1:], gap_s, cap=depth + 1)
    i = 1
    for n, g in enumerate(sizes):
        if n == len(sizes) - 1:
            break
        for j in range(g - 1):
            per[classes[i + j]]["drafted_positions"] += 1
        last = classes[i + g - 1]
        if g - 1 < depth:
            per[last]["drafted_positions"] += 1
            per[last]["rejections"] += 1
        i += g
    return per


# --------------------------------------------------------------------------------------------
# Load


def run_together(threads: list[threading.Thread]) -> float:
    """Start every thread, wait for them all: the wall time in seconds (`time.perf_counter`)."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def load_test(base_url: str, api_key: str | None, prompts: list[list[int]], concurrency: int,
              n_predict: int, *, socket: str | None = None) -> dict:
    """`concurrency` simultaneous streams; time to first token and inter-token gaps."""
    results: list[StreamResult | Exception] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        c = Client(base_url, api_key, socket=socket)
        try:
            res: StreamResult | Exception = c.complete(prompts[i % len(prompts)], n_predict)
        except Exception as exc:  # reported, never swallowed
            res = exc
        finally:
            c.close()
        with lock:
            results.append(res)

    wall = run_together([threading.Thread(target=worker, args=(i,))
                         for i in range(concurrency)])
    errors = [str(r) for r in results if isinstance(r, Exception)]
    ok = [r for r in results if isinstance(r, StreamResult)]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    n_tok = sum(r.n for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": errors,
        "ttft_p50_s": stats.percentile(ttfts, 0.5),
        "ttft_p99_s": stats.percentile(ttfts, 0.99),
        "itl_p50_s": stats.percentile(gaps, 0.5),
        "itl_p99_s": stats.percentile(gaps, 0.99),
        "itl_max_s": max(gaps) if gaps else None,
        "aggregate_tokens_per_s": n_tok / wall if wall > 0 else None,
    }


def parse_kv_log(text: str) -> dict | None:
    """The KV allocation llama.cpp logged: `llama_kv_cache: size = … (N cells, L layers …)`;
    cells are per stream."""
    caches = kv.parse_kv_caches(text)
    if not caches:
        return None
    # The target model's cache is logged first; a draft model's (or MTP context's) follows.
    first = {k: v for k, v in caches[0].items() if k != "part"}
    return {"contexts_logged": len(caches), **first}
