"""Find the llama-server binary and the model a benchmark runs, and parse list options."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtpwrap.bench.corpora import DOMAINS
from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.decide.vocab import SPELLINGS
from mtpwrap.errors import ConfigError
from mtpwrap.models import known as models
from mtpwrap.supervision.inputs import find_server

if TYPE_CHECKING:
    from mtpwrap.bench.kv_run import KvPlan


def server_binary(explicit: str | Path | None) -> Path:
    """--binary, `MTPWRAP_BINARY`, or the installed build's llama-server."""
    binary, _caps, _manifest = find_server(explicit)
    assert binary is not None
    return binary


def model_path(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit).expanduser()
        if p.is_file():
            return p
        return Path(models.resolve_model(explicit))
    return Path(models.ensure_demo_model())  # honours MTPWRAP_DEMO_MODEL (models.known)


def report_dir(out_dir: Path | None, prefix: str) -> Path:
    """--out, else ./bench-results/ and `prefix` with the time now."""
    return out_dir or Path("bench-results") / (prefix + _dt.datetime.now().strftime(
        "%Y%m%d-%H%M%S"))


def int_list(value: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {value!r}.") from None
    if not out or any(v < 1 for v in out):
        raise ConfigError(f"{what} must list positive integers, got {value!r}.")
    return out


def float_list(value: str, what: str) -> list[float]:
    try:
        out = [float(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated numbers, got {value!r}.") from None
    if not out or any(not 0.0 <= v <= 1.0 for v in out):
        raise ConfigError(f"{what} must list numbers between 0 and 1, got {value!r}.")
    return out


def model_context(model: Path) -> int | None:
    """The training context from the GGUF header (contexts above it are clipped)."""
    try:
        return read_facts(Path(model)).n_ctx_train or None
    except ConfigError:
        return None


@dataclass(frozen=True)
class KvBuild:
    """What `bench kv` runs: llama-perplexity and llama-server of one build, the KV types it
    offers and where its cache lives."""

    server: Path
    perplexity: Path
    offered: list[str] | None
    target: kv.Target


def kv_build(explicit: str | Path | None) -> KvBuild:
    """The build's llama-server (--binary, MTPWRAP_BINARY or the installed build) and the
    llama-perplexity built with it: the manifest's, else the one beside the server."""
    binary, caps, manifest = find_server(explicit)
    assert binary is not None
    ppl = None
    if manifest is not None and "llama-perplexity" in manifest.binaries:
        ppl = Path(manifest.binary("llama-perplexity"))
    if ppl is None or not ppl.is_file():
        ppl = Path(binary).with_name("llama-perplexity")
    if not ppl.is_file():
        raise ConfigError(f"No llama-perplexity beside {binary} nor in its build manifest; "
                          "`bench kv` needs the one built from the same source.",
                          hint="Run `mtpwrap build` (it builds llama-perplexity too).")
    flag = caps.first_of(SPELLINGS["cache_k"]) if caps is not None else None
    allowed = caps.allowed(flag) if caps is not None and flag else None
    variant = getattr(manifest, "variant", "") or ""
    options = getattr(manifest, "cmake_options", None) or {}
    fa_all = options.get("GGML_CUDA_FA_ALL_QUANTS")
    target = kv.Target(backend="cuda" if variant.startswith("cuda") else "cpu",
                       fa_all_quants=None if fa_all is None else str(fa_all).upper() == "ON")
    return KvBuild(server=Path(binary), perplexity=ppl,
                   offered=list(allowed) if allowed is not None else None, target=target)


def check_kv_plan(plan: KvPlan) -> None:
    """One corpus per language, every corpus known, depths llama-perplexity can run."""
    langs: dict[str, str] = {}
    for name in plan.corpora:
        lang = {"ko": "ko", "en": "en"}.get(name) or (DOMAINS[name].lang if name in DOMAINS
                                                      else None)
        if lang is None:
            raise ConfigError(f"--corpora: unknown corpus {name!r}; expected ko, en or one of "
                              f"{', '.join(DOMAINS)}.")
        if lang in langs:
            raise ConfigError(f"--corpora: {langs[lang]} and {name} are both {lang}; give one "
                              "corpus per language (the answers compare languages).")
        langs[lang] = name
    if not plan.corpora:
        raise ConfigError("--corpora must name at least one corpus.")
    limit = model_context(plan.model)
    too_long = [d for d in plan.depths if limit and d > limit]
    if too_long:
        raise ConfigError(f"--depths {', '.join(map(str, too_long))}: above the model's "
                          f"trained context of {limit} tokens.")
    if any(d < 64 for d in plan.depths):
        raise ConfigError("--depths must be at least 64 tokens each.")
