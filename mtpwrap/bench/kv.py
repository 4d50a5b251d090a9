"""The KV benchmark's figures: which KV types a model takes, the bits per value each one really
costs (from the KV buffer sizes llama.cpp logs at load), what `llama-perplexity` printed for a
type against the f16 reference, and the sentences the figures answer.

Admission is `mtpwrap.decide.kv.admits`, the one rule the launch and `models inspect` use; a type
the model cannot take is reported as not applicable with that rule's reason, and the run goes on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import ModelFacts
from mtpwrap.units import GiB, MiB


def applicable(facts: ModelFacts, offered: Iterable[str],
               target: kv.Target | None = None) -> list[dict]:
    """Each offered type, K and V alike: admitted, or not applicable with the reason."""
    out = []
    for t in offered:
        k, v = kv.admits(facts, t, "K", target), kv.admits(facts, t, "V", target)
        row: dict = {"kv": t, "applicable": k.admitted and v.admitted,
                     "nominal_bits_per_value": (kv.bits_per_value(t) if t in kv.TABLE
                                                else None)}
        if not row["applicable"]:
            row["reason"] = "; ".join(a.reason for a in (k, v) if not a.admitted)
        else:
            row["env"] = dict(k.env + v.env)
            notes = [a.reason for a in (k, v) if "; " in a.reason]
            if notes:
                row["note"] = "; ".join(notes)
        out.append(row)
    return out


_CACHE_KIND = re.compile(r"llama_kv_cache_iswa: creating\s+(non-SWA|SWA) KV cache")
_KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs"
    r"\), K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")


def window_cost(depth: int, n_vocab: int, chunks: int) -> tuple[int, int]:
    """(memory, disk) bytes llama-perplexity needs for the f16 reference of one window.

    From tools/perplexity/perplexity.cpp: the reference pass keeps a 16-bit log-probability row
    per position (`log_probs`, depth × vocabulary × 2 B) and the 32-bit logits of the scored half
    (`logits`, depth/2 × vocabulary × 4 B) — depth × vocabulary × 4 B in all, whatever the
    model's size; its `--kl-divergence-base` file holds the scored half's 16-bit rows of every
    chunk (chunks × depth/2 × vocabulary × 2 B)."""
    return depth * n_vocab * 4, chunks * (depth // 2) * n_vocab * 2


def window_refusal(depth: int, n_vocab: int, chunks: int, *, memory_free: int,
                   disk_free: int) -> str | None:
    """Why a window cannot be measured on this machine (None when it can); the memory is held
    to 80 % of what is available, so the run leaves the machine room to work."""
    memory, disk = window_cost(depth, n_vocab, chunks)
    what = (f"llama-perplexity's f16 reference of a {depth:,}-token window over a "
            f"{n_vocab:,}-token vocabulary needs")
    if memory > 0.8 * memory_free:
        return (f"{what} {memory / GiB:.1f} GiB of memory ({depth:,} × {n_vocab:,} × 4 B) and "
                f"{memory_free / GiB:.1f} GiB is available: measure a smaller depth, or on a "
                "machine with more memory (--no-quality still measures its speed).")
    if disk > disk_free:
        return (f"{what} {disk / GiB:.1f} GiB of disk for its --kl-divergence-base file and the "
                f"report folder has {disk_free / GiB:.1f} GiB free: give --out on a larger disk "
                "or fewer --chunks.")
    return None


def parse_kv_caches(text: str) -> list[dict]:
    """Every KV cache llama.cpp logged at load, in order, each tagged `swa` / `non-swa` when a
    sliding-window model logs two (`llama_kv_cache_iswa: creating ... KV cache`)."""
    out: list[dict] = []
    kind: str | None = None
    for line in text.splitlines():
        if m := _CACHE_KIND.search(line):
            kind = m.group(1).lower()
            continue
        if m := _KV_LINE.search(line):
            out.append({"part": kind, "total_mib": float(m.group(1)), "cells": int(m.group(2)),
                        "layers": int(m.group(3)), "streams": int(m.group(5)),
                        "k_type": m.group(6), "k_mib": float(m.group(7)),
                        "v_type": m.group(8), "v_mib": float(m.group(9))})
            kind = None
    return out


def _layers_of(facts: ModelFacts, part: str | None, n: int) -> list[int]:
    layers = list(facts.kv_layers)
    if part == "swa":
        layers = [il for il in layers if il in facts.swa_layers]
    elif part == "non-swa":
        layers = [il for il in layers if il not in facts.swa_layers]
    return layers[:n]


def effective_bits(facts: ModelFacts, logged: dict | list[dict]) -> dict:
    """Bits per stored value of K and V: the MiB llama.cpp logged for each cache (one, or a
    sliding-window model's two) ÷ (cells × streams × the values per token of its layers).
    The logged MiB are rounded to 0.01, so a small cache reads a little off its type's size."""
    caches: list[dict] = []
    for c in [logged] if isinstance(logged, dict) else logged:
        if any(c.get("part") == seen.get("part") for seen in caches):
            break  # a second context (a draft or MTP one, or a re-created cache) follows
        caches.append(c)
    k_bits = v_bits = 0.0
    k_vals = v_vals = 0
    for c in caches:
        cells = int(c["cells"]) * int(c.get("streams") or 1)
        layers = _layers_of(facts, c.get("part"), int(c["layers"]))
        k_vals += cells * sum(facts.kv_row_values(il)[0] for il in layers)
        v_vals += cells * sum(facts.kv_row_values(il)[1] for il in layers)
        k_bits += c["k_mib"] * MiB * 8
        v_bits += c["v_mib"] * MiB * 8
    first = caches[0] if caches else {}
    return {"k_type": first.get("k_type"), "v_type": first.get("v_type"),
            "k_bits_per_value": k_bits / k_vals if k_vals else None,
            "v_bits_per_value": v_bits / v_vals if v_vals else None}


# --------------------------------------------------------------------------- llama-perplexity

_NUM = r"(-?[\d.]+(?:e[-+]?\d+)?|nan|inf|-nan)"
_PM = _NUM + r"\s*±\s*" + _NUM
_FIELDS: dict[str, re.Pattern[str]] = {
    "ppl": re.compile(r"^Mean PPL\(Q\)\s*:\s*" + _PM, re.M),
    "ppl_base": re.compile(r"^Mean PPL\(base\)\s*:\s*" + _PM, re.M),
    "ln_ppl_ratio": re.compile(r"^Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _PM, re.M),
    "ppl_ratio": re.compile(r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _PM, re.M),
    "ppl_diff": re.compile(r"^Mean PPL\(Q\)-PPL\(base\)\s*:\s*" + _PM, re.M),
    "kld_mean": re.compile(r"^Mean\s+KLD:\s*" + _PM, re.M),
    "same_top_p_pct": re.compile(r"^Same top p:\s*" + _PM + r"\s*%", re.M),
}
_SINGLE: dict[str, re.Pattern[str]] = {
    "kld_max": re.compile(r"^Maximum KLD:\s*" + _NUM, re.M),
    "kld_p99_9": re.compile(r"^99\.9%\s+KLD:\s*" + _NUM, re.M),
    "kld_p99": re.compile(r"^99\.0%\s+KLD:\s*" + _NUM, re.M),
    "kld_p95": re.compile(r"^95\.0%\s+KLD:\s*" + _NUM, re.M),
    "kld_median": re.compile(r"^Median\s+KLD:\s*" + _NUM, re.M),
    "dp_rms_pct": re.compile(r"^RMS Δp\s*:\s*" + _NUM, re.M),
}
_OVER = re.compile(r"(?:computing|calculating perplexity) over (\d+) chunks, n_ctx=(\d+), "
                   r"batch_size=(\d+), n_seq=(\d+)")
_PASS = re.compile(r"([\d.]+) seconds per pass")
_FINAL = re.compile(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM)
_CHUNK = re.compile(r"^\s*(\d+)\s+" + _PM + r"\s+" + _PM + r"\s+" + _PM + r"\s+" + _PM
                    + r"\s*%\s+" + _PM + r"\s*%\s*$", re.M)


def parse_perplexity(text: str) -> dict:
    """What one `llama-perplexity` run printed (tools/perplexity/perplexity.cpp): with
    `--kl-divergence`, the PPL, KLD and top-token statistics against the base file; either
    way, the chunks, window, sequences per pass and seconds of the first pass (prefill).
    A figure the output lacks is left out, so a failed or cut run shows as missing figures."""
    out: dict = {}
    for key, pat in _FIELDS.items():
        if m := pat.search(text):
            out[key], out[key + "_unc"] = float(m.group(1)), float(m.group(2))
    for key, pat in _SINGLE.items():
        if m := pat.search(text):
            out[key] = float(m.group(1))
    if m := _OVER.search(text):
        out.update(chunks=int(m.group(1)), window=int(m.group(2)), batch=int(m.group(3)),
                   seqs_per_pass=int(m.group(4)))
    if m := _PASS.search(text):
        out["seconds_first_pass"] = float(m.group(1))
        if "window" in out:
            tokens = out["window"] * min(out["seqs_per_pass"], out["chunks"])
            out["prefill_tokens_per_s"] = tokens / out["seconds_first_pass"]
    if m := _FINAL.search(text):
        out["final_ppl"], out["final_ppl_unc"] = float(m.group(1)), float(m.group(2))
    chunks = [{"chunk": int(m.group(1)), "ppl": float(m.group(2)), "kld": float(m.group(6)),
               "same_top_p_pct": float(m.group(10))} for m in _CHUNK.finditer(text)]
    if chunks:
        out["per_chunk"] = chunks
    out["kv_caches"] = parse_kv_caches(text)
    return out


# --------------------------------------------------------------------------- the answers


def _fmt(v: float) -> str:
    return f"{v:.4f}" if abs(v) < 1 else f"{v:.3g}"


def hypotheses(rows: list[dict]) -> dict[str, str]:
    """One sentence per question, computed from the measured rows (each: kv, lang, depth,
    kld_mean, kld_mean_unc, bits): does Korean lose less than English at the same bits per
    value; is any 4-bit type within q8_0's loss; does loss grow with depth."""
    got = [r for r in rows if r.get("kld_mean") is not None and r["kv"] != "f16"]
    by = {(r["kv"], r["lang"], r["depth"]): r for r in got}
    return {"korean_vs_english": _lang_sentence(by),
            "four_bit_vs_q8_0": _four_bit_sentence(by),
            "depth": _depth_sentence(by)}


def _lang_sentence(by: dict) -> str:
    pairs = sorted({(t, d) for t, lang, d in by if lang == "ko" and (t, "en", d) in by})
    if not pairs:
        return "Korean vs English: not measured (no type and depth with both languages)."
    less = [(t, d) for t, d in pairs if by[(t, "ko", d)]["kld_mean"] < by[(t, "en", d)]["kld_mean"]]
    detail = "; ".join(f"{t} at {d}: {_fmt(by[(t, 'ko', d)]['kld_mean'])} vs "
                       f"{_fmt(by[(t, 'en', d)]['kld_mean'])}" for t, d in pairs)
    verdict = ("Yes" if len(less) == len(pairs) else "No" if not less else "Not consistently")
    return (f"{verdict}: Korean lost less than English at the same type (same bits per value) "
            f"in {len(less)} of {len(pairs)} (type, depth) pairs; mean KLD Korean vs English: "
            f"{detail}.")


def _four_bit_sentence(by: dict) -> str:
    four = sorted({t for t, _, _ in by if t in kv.TABLE and 4.0 <= kv.TABLE[t].bits < 5.0})
    cells = sorted({(lang, d) for t, lang, d in by if t == "q8_0"})
    if not four or not cells:
        return "4-bit vs q8_0: not measured (no 4-bit type or no q8_0 figures)."
    parts, within = [], []
    for t in four:
        for lang, d in cells:
            a, q = by.get((t, lang, d)), by[("q8_0", lang, d)]
            if a is None:
                continue
            ok = a["kld_mean"] - a.get("kld_mean_unc", 0.0) <= q["kld_mean"] + q.get(
                "kld_mean_unc", 0.0)
            if ok:
                within.append(f"{t} ({lang}, {d})")
            parts.append(f"{t} {lang} {d}: {_fmt(a['kld_mean'])} vs {_fmt(q['kld_mean'])} "
                         f"({a['kld_mean'] / q['kld_mean']:.1f}x)" if q["kld_mean"] > 0 else
                         f"{t} {lang} {d}: {_fmt(a['kld_mean'])} vs {_fmt(q['kld_mean'])}")
    head = (f"Yes: within q8_0's loss (mean KLD, within the two uncertainties): "
            f"{', '.join(within)}" if within else
            "No: no 4-bit type came within q8_0's loss (mean KLD, within the two uncertainties)")
    return f"{head}; mean KLD 4-bit vs q8_0: {'; '.join(parts)}."


def _depth_sentence(by: dict) -> str:
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (t, lang, d), r in by.items():
        series.setdefault((t, lang), []).append((d, r["kld_mean"]))
    series = {k: sorted(v) for k, v in series.items() if len({d for d, _ in v}) >= 2}
    if not series:
        return "Loss by depth: not measured (fewer than two depths per type and language)."
    grew = [k for k, v in series.items() if v[-1][1] > v[0][1]]
    detail = "; ".join(f"{t} {lang}: " + " → ".join(f"{_fmt(x)} ({d})" for d, x in v)
                       for (t, lang), v in sorted(series.items()))
    verdict = "Yes" if len(grew) == len(series) else "No" if not grew else "Not consistently"
    return (f"{verdict}: loss grew from the shallowest to the deepest window in {len(grew)} of "
            f"{len(series)} (type, language) series; mean KLD by window: {detail}.")


def kld_order(rows: list[dict], depth: int) -> list[tuple[str, float]]:
    """(type, mean KLD over the languages) at `depth`, lowest first; f16 (the reference) is 0."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        if r["depth"] == depth and r.get("kld_mean") is not None:
            acc.setdefault(r["kv"], []).append(0.0 if r["kv"] == "f16" else r["kld_mean"])
    return sorted(((t, sum(v) / len(v)) for t, v in acc.items()), key=lambda x: (x[1], x[0]))
