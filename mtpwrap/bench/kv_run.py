"""`mtpwrap bench kv`: the quality of each KV cache type against f16, measured the way llama.cpp
measures it, on Korean and English text, at several depths.

For each corpus and window (depth): `llama-perplexity` of the same build first writes the f16
reference (`--kl-divergence-base`), then runs every admitted type, K and V alike, against it
(`--kl-divergence`): mean and 99th-percentile KL divergence of the next-token distributions,
top-1 agreement and the perplexity ratio, scored on the second half of each window (positions
depth/2 … depth-1). The KV buffers it logs at load give the bits per value each type really
costs. Then, optionally, one llama-server per type fills its context with `depth` real prompt
tokens and decodes a few, for prefill and decode speed at that fill.

The text of a run is whole documents of one corpus, each once, counted in the model's own
tokens (llama-server's `/tokenize`); the report names each document and its sha256.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtpwrap import proc
from mtpwrap.bench import corpora, kv
from mtpwrap.bench.runner import BenchConfig, Client, launch_config, quiet
from mtpwrap.decide import kv as kv_rule
from mtpwrap.decide.gguf_facts import ModelFacts, read_facts
from mtpwrap.errors import RuntimeFailure

SCHEMA = 1
Progress = Callable[[str], None]


@dataclass
class KvPlan:
    perplexity: Path             #: llama-perplexity of the build
    server: Path                 #: llama-server of the same build (tokenizer, speed)
    model: Path
    types: list[str]             #: the types asked for (f16 is the reference)
    offered: list[str] | None    #: what the build offers for -ctk (None: not known)
    corpora: list[str]           #: corpus names (corpora.load), one per language
    depths: list[int]            #: windows, in tokens
    #: windows scored per depth: one number for all, or one per depth
    chunks: list[int] = field(default_factory=lambda: [2])
    threads: int | None = None
    speed: bool = True           #: also measure prefill/decode speed by filled depth
    quality: bool = True         #: the llama-perplexity runs (off: speed only)
    n_predict: int = 32          #: tokens decoded per speed cell
    target: kv_rule.Target = field(default_factory=kv_rule.Target)
    timeout_s: float = 6 * 3600.0

    def chunks_at(self, depth: int) -> int:
        if len(self.chunks) == 1:
            return self.chunks[0]
        return self.chunks[self.depths.index(depth)]

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("perplexity", "server", "model"):
            d[k] = str(d[k])
        return d


def admitted(plan: KvPlan, facts: ModelFacts) -> list[dict]:
    """Each type asked: applicable (offered by the build and admitted by the model), or not
    applicable with the reason."""
    types = list(dict.fromkeys(["f16", *plan.types]))
    rows = []
    for row in kv.applicable(facts, types, plan.target):
        if plan.offered is not None and row["kv"] not in plan.offered:
            offer = f"this build does not offer it (-ctk allows {', '.join(plan.offered)})"
            row = {**row, "applicable": False,
                   "reason": f"{row['reason']}; {offer}" if "reason" in row else offer}
        rows.append(row)
    return rows


def _env(binary: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = proc.child_env(extra)
    env["LD_LIBRARY_PATH"] = f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    return env


def perplexity_argv(plan: KvPlan, t: str, *, depth: int, base: Path,
                    text: Path | None) -> list[str]:
    argv = [str(plan.perplexity), "-m", str(plan.model), "-c", str(depth),
            "--chunks", str(plan.chunks_at(depth)), "-ctk", t, "-ctv", t, "-fa", "on", "-lv", "4",
            "--kl-divergence-base", str(base),
            # one window per pass: the fork's CPU tbq4_0 path aborts on a pass of several
            # (GGML_ASSERT(ggml_is_contiguous(a)), measured on its CPU build)
            "-b", str(min(depth, 2048))]
    if text is not None:   # the reference pass reads and tokenizes the text
        argv += ["-f", str(text)]
    else:                  # the others read its tokens from the base file
        argv += ["--kl-divergence"]
    if plan.threads:
        argv += ["-t", str(plan.threads)]
    return argv


def _ppl_run(plan: KvPlan, argv: list[str], log: Path, env: dict[str, str]) -> dict:
    try:
        done = proc.run(argv, timeout=plan.timeout_s, env=env, merge_stderr=True,
                        what=f"llama-perplexity {log.stem}")
    except proc.CommandTimedOut as exc:
        return {"error": str(exc)}
    log.write_text(done.stdout)
    got = kv.parse_perplexity(done.stdout)
    got["log"] = str(log)
    if done.returncode != 0:
        got["error"] = (f"llama-perplexity ended with {proc.describe_returncode(done.returncode)}"
                        f": {done.last_line()}")
    return got


def unmeasurable(plan: KvPlan, facts: ModelFacts, workdir: Path) -> dict[int, str]:
    """The quality depths this machine's memory or the report folder's disk cannot hold, each
    with the sentence saying so (a 262K window of a 150K-token vocabulary needs ~150 GiB)."""
    if not plan.quality:
        return {}
    import psutil

    memory_free = psutil.virtual_memory().available
    disk_free = shutil.disk_usage(workdir).free
    out: dict[int, str] = {}
    for d in plan.depths:
        why = kv.window_refusal(d, facts.n_vocab, plan.chunks_at(d), memory_free=memory_free,
                                disk_free=disk_free)
        if why is not None:
            out[d] = why
    return out


def prepare_texts(plan: KvPlan, workdir: Path, progress: Progress,
                  skip: dict[int, str] | None = None) -> dict[str, dict]:
    """Per corpus: a text file of whole documents that fills the largest window `chunks` times
    (llama-perplexity needs at least two windows), the speed prompts (token ids, exactly
    `depth` long), and the depths the corpus cannot fill or the machine cannot measure (SKIP),
    each with the sentence saying so."""
    out: dict[str, dict] = {}
    log = workdir / "server-tokenize.log"
    srv = launch_config(BenchConfig("tokenize", kv="f16"), binary=plan.server,
                        model=plan.model, ctx_size=512, threads=plan.threads, log_path=log)
    client = Client.of(srv)
    try:
        for name in plan.corpora:
            progress(f"tokenizing {name}")
            corp = corpora.load(name)
            entry: dict = {"lang": corp.lang, "provenance": corp.provenance(),
                           "cannot_fill": dict(skip or {}), "prompts": {}}
            fill = sorted(d for d in plan.depths if d not in (skip or {}))
            prompt = None
            while fill:
                need = max(max(plan.chunks_at(d), 2) * d for d in fill) + 64
                try:
                    prompt = corpora.build_prompt(corp, need, client.tokenize)
                    break
                except corpora.CorpusTooSmall as exc:
                    entry["cannot_fill"][fill.pop()] = str(exc)
            if prompt is not None:
                texts = {d.name: d.text for d in corp.documents}
                path = workdir / f"text-{name}.txt"
                path.write_text(corpora.SEPARATOR.join(texts[n] for n, _, _ in prompt.used))
                entry["text"] = str(path)
                entry["documents"] = [{"name": n, "sha256": h, "tokens": k}
                                      for n, h, k in prompt.used]
                if plan.speed:
                    entry["prompts"] = {d: corpora.build_prompt(corp, d, client.tokenize).tokens
                                        for d in fill}
            entry["depths"] = fill
            out[name] = entry
    finally:
        client.close()
        srv.stop()
    return out


def _quality(plan: KvPlan, facts: ModelFacts, types: list[dict], texts: dict[str, dict],
             workdir: Path, results: dict, progress: Progress) -> None:
    for name, entry in texts.items():
        for depth in entry["depths"]:
            base = workdir / f"base-{name}-{depth}.kld"
            progress(f"{name} {depth}: f16 reference")
            ref = _ppl_run(plan, perplexity_argv(plan, "f16", depth=depth, base=base,
                                                 text=Path(entry["text"])),
                           workdir / f"ppl-{name}-{depth}-base.log", _env(plan.perplexity))
            results["references"].append({"corpus": name, "lang": entry["lang"],
                                          "depth": depth, **ref})
            try:
                for row in types:
                    if not row["applicable"]:
                        continue
                    if "error" in ref:
                        results["rows"].append(_row(row, name, entry, depth, facts,
                                                    {"error": "no f16 reference: "
                                                     + ref["error"]}))
                        continue
                    progress(f"{name} {depth}: {row['kv']}")
                    got = _ppl_run(plan, perplexity_argv(plan, row["kv"], depth=depth,
                                                         base=base, text=None),
                                   workdir / f"ppl-{name}-{depth}-{row['kv']}.log",
                                   _env(plan.perplexity, row.get("env")))
                    results["rows"].append(_row(row, name, entry, depth, facts, got))
            finally:
                base.unlink(missing_ok=True)  # (depth/2 × vocabulary) 16-bit values per chunk


def _row(row: dict, name: str, entry: dict, depth: int, facts: ModelFacts, got: dict) -> dict:
    out = {"kv": row["kv"], "corpus": name, "lang": entry["lang"], "depth": depth,
           "scored_positions": [depth // 2, depth - 1],
           "nominal_bits_per_value": row.get("nominal_bits_per_value"), **got}
    if got.get("kv_caches"):
        out.update(kv.effective_bits(facts, got["kv_caches"]))
    return out


def _speed(plan: KvPlan, types: list[dict], texts: dict[str, dict], workdir: Path,
           results: dict, progress: Progress) -> None:
    depths = sorted({d for e in texts.values() for d in e["prompts"]})
    if not depths:
        return
    ctx = (max(depths) + plan.n_predict + 64 + 255) // 256 * 256
    for row in types:
        if not row["applicable"]:
            continue
        t = row["kv"]
        log = workdir / f"server-speed-{t}.log"
        try:
            srv = launch_config(BenchConfig(f"kv-{t}", kv=t), binary=plan.server,
                                model=plan.model, ctx_size=ctx, threads=plan.threads,
                                log_path=log)
        except RuntimeFailure as exc:
            results["speed"].append({"kv": t, "error": str(exc)})
            continue
        client = Client.of(srv)
        try:
            # one short request first, not counted: the server starts without a warm-up, and
            # the first request would carry it
            warm: list[int] = next(iter(next(iter(texts.values()))["prompts"].values()), [])
            if warm:
                client.complete(warm[:64], 4)
            for name, entry in texts.items():
                for depth, tokens in sorted(entry["prompts"].items()):
                    progress(f"speed {t} {name} {depth}")
                    res = client.complete(tokens, plan.n_predict)
                    tm = res.timings
                    results["speed"].append({
                        "kv": t, "corpus": name, "lang": entry["lang"], "depth": depth,
                        "filled_tokens": tm.get("prompt_n"), "decoded_tokens": tm.get(
                            "predicted_n"),
                        "prefill_tokens_per_s": tm.get("prompt_per_second"),
                        "decode_tokens_per_s": tm.get("predicted_per_second")})
        finally:
            client.close()
            srv.stop()


def steps(plan: KvPlan, n_types: int) -> int:
    cells = len(plan.corpora) * len(plan.depths)
    return (len(plan.corpora) + (cells * (1 + n_types) if plan.quality else 0)
            + (cells * n_types if plan.speed else 0))


def run(plan: KvPlan, workdir: Path, *, progress: Progress = quiet) -> dict:
    """Measure every admitted type of the plan; the raw results the report is made of."""
    from mtpwrap.bench.suite import build_provenance, hardware_snapshot, model_provenance

    workdir.mkdir(parents=True, exist_ok=True)
    facts = read_facts(plan.model)
    types = admitted(plan, facts)
    results: dict = {
        "schema": SCHEMA, "kind": "kv-quality",
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "plan": plan.to_dict(), "types": types, "references": [], "rows": [], "speed": [],
        "provenance": {"build": build_provenance(plan.server), "hardware": hardware_snapshot(),
                       "model": model_provenance(plan.model),
                       "perplexity": {"path": str(plan.perplexity)}},
    }
    texts = prepare_texts(plan, workdir, progress, unmeasurable(plan, facts, workdir))
    results["corpora"] = {n: {k: v for k, v in e.items() if k != "prompts"}
                          for n, e in texts.items()}
    if plan.quality:
        _quality(plan, facts, types, texts, workdir, results, progress)
    if plan.speed:
        _speed(plan, types, texts, workdir, results, progress)
    results["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results["hypotheses"] = kv.hypotheses(results["rows"])
    return results
