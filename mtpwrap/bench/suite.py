"""One benchmark run: the plan, the matrix walk, and the raw results the report is made of."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx

from mtpwrap import hashing, proc
from mtpwrap.bench import corpora, stats, tokenclass
from mtpwrap.bench.runner import (
    BenchConfig,
    Client,
    StreamResult,
    bursts,
    launch_config,
    load_test,
    parse_kv_log,
    quiet,
    rejection_points,
)
from mtpwrap.build import manifest as build_manifest
from mtpwrap.decide import hardware, profiles
from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.errors import ConfigError, RuntimeFailure

SCHEMA = 1


@dataclass
class SuitePlan:
    configs: list[BenchConfig]
    contexts: list[int]
    langs: list[str] = field(default_factory=lambda: ["ko", "en"])
    n_predict: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1, 2])
    load_context: int = 256
    load_predict: int = 32
    quality_tokens: int = 32
    #: tokens within this many seconds of the previous one count as one verification step;
    #: None: each cell's own (`Counters.step_gap`, a fifth of the server's mean step there)
    gap_s: float | None = None
    binary: Path | None = None
    model: Path | None = None
    url: str | None = None  # a running server instead of launching the matrix
    api_key: str | None = None
    threads: int | None = None
    profile: str | None = None  # the profile every cell derives from (default: this machine's)
    server_extra: list[str] = field(default_factory=list)  # e.g. -ngl 99 on a GPU
    launch_timeout: float = 300.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["binary"] = str(self.binary) if self.binary else None
        d["model"] = str(self.model) if self.model else None
        d.pop("api_key")
        return d


def hardware_snapshot() -> dict:
    snap: dict = {"platform": platform.platform(), "machine": platform.machine(),
                  "python": platform.python_version(), "cpu_count": os.cpu_count(),
                  "cpu_model": hardware.cpu_model()}
    with contextlib.suppress(Exception):  # psutil missing is not worth failing a benchmark over
        import psutil

        snap["memory_bytes"] = psutil.virtual_memory().total
    try:
        snap["nvml"] = hardware.snapshot().to_dict()
    except Exception as exc:  # NVML missing or broken: the rest of the snapshot stands
        snap["nvml_error"] = f"{type(exc).__name__}: {exc}"
    snap["gpus"] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(proc.ProcError):
            out = proc.run([smi, "--query-gpu=name,memory.total,driver_version,compute_cap",
                            "--format=csv,noheader"], timeout=20)
            snap["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return snap


def build_provenance(binary: Path | None) -> dict:
    prov: dict = {"binary": str(binary) if binary else None}
    try:
        manifest = build_manifest.load_manifest()
        if manifest is not None and (binary is None
                                     or Path(manifest.binary("llama-server")) == Path(binary)):
            prov["manifest"] = manifest.to_dict()
        elif binary is not None:
            # A build from the shared cache keeps its manifest beside bin/.
            side = Path(binary).resolve().parent.parent / "manifest.json"
            if side.is_file():
                import json

                prov["manifest"] = json.loads(side.read_text())
    except Exception as exc:  # no build module or no manifest: record why, keep going
        prov["manifest_error"] = f"{type(exc).__name__}: {exc}"
    if binary:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{Path(binary).parent}:{env.get('LD_LIBRARY_PATH', '')}"
        try:
            prov["version"] = proc.version(binary, timeout=30, env=env).splitlines()[-2:]
        except proc.ProcError as exc:
            prov["version"] = [f"unavailable: {exc}"]
    return prov


def profile_provenance(name: str | None) -> dict | None:
    if not name:
        return None
    try:
        return dict(profiles.load_profile(name).to_dict())
    except Exception as exc:
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"}


def _cell(cfg: BenchConfig, lang: str, ctx: int, prompt: corpora.Prompt, res: StreamResult,
          counters: stats.Counters, gap_s: float | None) -> dict:
    t = res.timings
    if gap_s is None:
        gap_s = counters.step_gap()
    depth = cfg.depth
    if counters.per_pos:
        depth = len(counters.per_pos)  # the server's own k: one counter per draft position
    # A running server does not say in /props whether it speculates; its counters do.
    speculative = cfg.speculative or counters.steps > 0
    spec = stats.spec_stats(counters, depth) if speculative else None
    sizes = bursts(res.arrivals[1:], gap_s, cap=depth + 1 if speculative else 1)
    inferred_accepted = sum(g - 1 for g in sizes)
    decode_wall = (res.arrivals[-1] - res.arrivals[0]) if res.n > 1 else None
    return {
        "config": cfg.name,
        "lang": lang,
        "context": ctx,
        "prompt_tokens": prompt.n_tokens,
        "prompt_documents": [{"name": n, "sha256": h, "tokens": k} for n, h, k in prompt.used],
        "generated_tokens": res.n,
        "prefill_tokens_per_s": t.get("prompt_per_second"),
        "decode_tokens_per_s": t.get("predicted_per_second"),
        "client_decode_tokens_per_s": (res.n - 1) / decode_wall if decode_wall else None,
        "ttft_s": res.ttft,
        "total_s": res.total_s,
        "timings": t,
        "counters": counters.to_dict(),
        "spec": spec.to_dict() if spec else None,
        "stream": {
            "gap_s": gap_s,
            "burst_sizes": sizes,
            "inferred_steps": len(sizes),
            "inferred_accepted": inferred_accepted,
            "held_back_tokens": sum(res.held),
            "inter_token_gaps_s": [b - a for a, b in pairwise(res.arrivals)],
        },
        "token_classes": rejection_points(res, depth, gap_s) if speculative else None,
        "reconcile": {
            "streamed_eq_timings_predicted_n": res.n == t.get("predicted_n"),
            "timings_predicted_n_eq_counter": t.get("predicted_n") == counters.predicted_tokens,
            "timings_draft_n_eq_counter": t.get("draft_n", 0) == counters.drafted,
            "timings_draft_accepted_eq_counter": t.get("draft_n_accepted", 0) == counters.accepted,
            "prompt_n_eq_counter": t.get("prompt_n") == counters.prompt_tokens,
        },
    }


def run(plan: SuitePlan, workdir: Path, *,
        progress: Callable[[str], None] = quiet) -> dict:
    """Run every cell of the plan and return the raw results (see report.py for the files)."""
    if not plan.configs:
        raise ConfigError("The benchmark plan has no configurations.")
    if plan.url is None and (plan.binary is None or plan.model is None):
        raise ConfigError("Launching a benchmark matrix needs a llama-server binary and a model.")
    workdir.mkdir(parents=True, exist_ok=True)
    corp = {lang: corpora.load(lang) for lang in plan.langs}
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results: dict = {
        "schema": SCHEMA,
        "started": started,
        "plan": plan.to_dict(),
        "provenance": {
            "build": build_provenance(plan.binary),
            "hardware": hardware_snapshot(),
            "profile": profile_provenance(plan.profile),
            "model": model_provenance(plan.model),
            "corpora": {lang: c.provenance() for lang, c in corp.items()},
            "token_classes": tokenclass.DESCRIPTIONS,
        },
        "cells": [],
        "load": [],
        "quality": [],
        "kv": {},
        "servers": {},
    }
    need_ctx = max(plan.contexts + [plan.load_context]) + max(plan.n_predict, plan.load_predict)
    parallel = max(plan.concurrency + [1])
    # Without a unified KV each slot gets n_ctx / slots, so every slot must fit the longest.
    ctx_size = (need_ctx + 64 + 255) // 256 * 256 * parallel
    base = None
    if not plan.url:
        from mtpwrap.bench.runner import default_profile

        # every cell is this profile with the cell's overrides: a launch `up` could run
        base = profiles.load_profile(plan.profile) if plan.profile else default_profile()
    for cfg in plan.configs:
        log_path = workdir / f"server-{cfg.name}.log"
        stop: Callable[[], int | None]
        if plan.url:
            client, stop = Client(plan.url, plan.api_key), (lambda: None)
        else:
            assert plan.binary and plan.model
            srv = launch_config(cfg, binary=plan.binary, model=plan.model,
                                ctx_size=ctx_size, parallel=parallel, log_path=log_path,
                                threads=plan.threads, extra=plan.server_extra,
                                timeout=plan.launch_timeout, profile=base)
            client, stop = Client.of(srv, plan.api_key), srv.stop
        try:
            _run_config(plan, cfg, client, corp, results, progress)
        except httpx.HTTPError as exc:
            raise RuntimeFailure(
                f"llama-server for configuration {cfg.name!r} stopped answering ({exc});"
                f" see {log_path if log_path.exists() else client.where}."
            ) from exc
        finally:
            client.close()
            rc = stop()
            results["servers"].setdefault(cfg.name, {})["exit_code"] = rc
        if log_path.exists():
            kv = parse_kv_log(log_path.read_text(errors="replace"))
            if kv:
                results["kv"][cfg.name] = kv
    results["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return results


def _run_config(plan: SuitePlan, cfg: BenchConfig, client: Client,
                corp: dict[str, corpora.Corpus], results: dict,
                progress: Callable[[str], None]) -> None:
    props = client.props()
    n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0)
    results["servers"][cfg.name] = {"base_url": client.base_url, "socket": client.socket,
                                    "n_ctx": n_ctx, "total_slots": props.get("total_slots")}
    for lang in plan.langs:
        for ctx in plan.contexts:
            if n_ctx and ctx + plan.n_predict > n_ctx:
                results["cells"].append({"config": cfg.name, "lang": lang,
                                         "context": ctx, "skipped":
                                         f"server context {n_ctx} too small"})
                continue
            progress(f"{cfg.name} {lang} {ctx}")
            try:
                prompt = corpora.build_prompt(corp[lang], ctx, client.tokenize)
            except corpora.CorpusTooSmall as exc:
                results["cells"].append({"config": cfg.name, "lang": lang, "context": ctx,
                                         "skipped": str(exc)})
                continue
            before = client.metrics()
            res = client.complete(prompt.tokens, plan.n_predict)
            after = client.metrics()
            results["cells"].append(
                _cell(cfg, lang, ctx, prompt, res, after - before, plan.gap_s))
    for lang in plan.langs:
        prompt = corpora.build_prompt(corp[lang], plan.load_context, client.tokenize)
        res = client.complete(prompt.tokens, plan.quality_tokens, n_probs=1)
        results["quality"].append({"config": cfg.name, "kv": cfg.kv, "lang": lang,
                                   "speculative": cfg.speculative,
                                   "token_ids": res.token_ids, "logprobs": res.probs})
    load_prompts = [corpora.build_prompt(corp[lang], plan.load_context,
                                         client.tokenize).tokens for lang in plan.langs]
    for n in plan.concurrency:
        progress(f"{cfg.name} load x{n}")
        rec = load_test(client.base_url, plan.api_key, load_prompts, n, plan.load_predict,
                        socket=client.socket)
        rec["config"] = cfg.name
        results["load"].append(rec)


def total_steps(plan: SuitePlan) -> int:
    return len(plan.configs) * (len(plan.langs) * len(plan.contexts) + len(plan.concurrency))


def model_provenance(model: Path | None) -> dict | None:
    if model is None:
        return None
    p = Path(model)
    if not p.exists():
        return {"path": str(p), "exists": False}
    return {"path": str(p), "bytes": p.stat().st_size, "sha256": hashing.sha256_file(p),
            "kv_geometry": kv_geometry(p)}


def kv_geometry(model: Path) -> dict | None:
    """KV heads and head sizes from the GGUF header, to turn logged KV MiB into bytes/value."""
    try:
        facts = read_facts(Path(model))
    except ConfigError:  # a file the reader cannot read: bytes/value is left out
        return None
    heads = [facts.n_head_kv[i] for i in facts.kv_layers] or facts.n_head_kv
    return {"arch": facts.architecture, "n_head_kv": max(heads),
            "key_length": facts.head_dim_k, "value_length": facts.head_dim_v}
