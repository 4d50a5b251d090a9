"""The benchmark report: one JSON with every raw figure, a Markdown summary that defines each
number, and PNG plots (matplotlib, Agg backend, imported only here)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from mtpwrap.bench import stats, tokenclass
from mtpwrap.errors import MissingExtra, require_extra
from mtpwrap.units import MiB

LANG_NAMES = {"ko": "Korean", "en": "English", "ruling": "Korean rulings",
              "statute": "Korean statutes", "interpretation": "Korean FSC interpretations",
              "licence": "English licences"}

DEFINITIONS = {
    "prefill t/s": "prompt tokens ÷ prompt time, from the server's `timings` (prompt_n, "
                   "prompt_ms); prompt caching is off, so every prompt token is computed.",
    "decode t/s": "generated tokens ÷ generation time, from `timings.predicted_per_second`.",
    "speedup (measured)": "decode t/s of the cell ÷ decode t/s of the baseline configuration "
                          "at the same language and context.",
    "drafted / accepted / steps": "llama-server's counters `spec_decode_num_draft_tokens_total`, "
                                  "`spec_decode_num_accepted_tokens_total`, "
                                  "`spec_decode_num_drafts_total` (verification steps), "
                                  "differenced around each request.",
    "acceptance rate": "llama.cpp's number: accepted ÷ drafted.",
    "per-position acceptance": "`spec_decode_num_accepted_tokens_per_pos_total{position=i}` ÷ "
                               "steps: the share of verification steps whose draft token i was "
                               "accepted (position 0 first). A step whose draft stopped short "
                               "of position i (p_min, or the request's token limit) counts as "
                               "not accepted there.",
    "mean accepted length": "tokens emitted per verification step = 1 + accepted ÷ steps (the "
                            "target model's own token plus the accepted drafts).",
    "α": "the per-position acceptance the recipe's formula needs: the α in [0,1] with "
         "1 + α + … + α^k = mean accepted length, k = draft depth. Not the acceptance rate.",
    "speedup (formula)": "1 + α + … + α^k: the speedup if drafting and verification cost "
                         "nothing. It sits above the measured speedup by the drafting cost.",
    "rejection rate by class": "rejections ÷ tokens at drafted positions, per token class of the "
                               "token the target model emitted; inferred from stream timing "
                               "(see the method section).",
    "KV bytes per value": "the K (or V) buffer llama.cpp logged ÷ (cells × streams × layers × "
                          "KV heads × head size).",
    "TTFT / ITL": "time to first streamed token and inter-token latency (gap between streamed "
                  "tokens) at each concurrency level, p50/p99 over all requests.",
    "quality agreement": "leading generated tokens (temperature 0) identical to the baseline "
                         "configuration's; log-probability drift = mean |Δ logprob| over them.",
}


def summarize(results: dict) -> dict:
    cells = [c for c in results["cells"] if "skipped" not in c]
    base_name = next((c["name"] for c in results["plan"]["configs"]
                      if c["spec"] == "none" and c["kv"] == "f16"), None)
    base = {(c["lang"], c["context"]): c for c in cells if c["config"] == base_name}
    configs = {c["name"]: c for c in results["plan"]["configs"]}
    speed = []
    for c in cells:
        b = base.get((c["lang"], c["context"]))
        measured = (c["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                    if b and b.get("decode_tokens_per_s") and c.get("decode_tokens_per_s")
                    else None)
        speed.append({"config": c["config"], "lang": c["lang"], "context": c["context"],
                      "prefill_tokens_per_s": c["prefill_tokens_per_s"],
                      "decode_tokens_per_s": c["decode_tokens_per_s"],
                      "measured_speedup": measured,
                      "formula_speedup": (c["spec"] or {}).get("predicted_speedup")})
    # Speculation pooled per configuration and language (counters add up across requests).
    spec: list[dict] = []
    classes: list[dict] = []
    timing_err: list[dict] = []
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for c in cells:
        groups[(c["config"], c["lang"])].append(c)
    for (name, lang), cs in groups.items():
        cfg = configs[name]
        total = sum((stats.Counters(**c["counters"]) for c in cs), stats.Counters())
        inferred_acc = sum(c["stream"]["inferred_accepted"] for c in cs)
        tokens = sum(c["generated_tokens"] for c in cs)
        speculative = any(c.get("spec") for c in cs)
        timing_err.append({
            "config": name, "lang": lang, "speculative": speculative,
            "true_accepted": int(total.accepted), "inferred_accepted": inferred_acc,
            "tokens": tokens,
            "error_tokens_share": abs(inferred_acc - total.accepted) / tokens if tokens else None,
        })
        if not speculative:
            continue
        depth = len(total.per_pos) or cfg["depth"]
        s = stats.spec_stats(total, depth)
        spec.append({"config": name, "lang": lang, **s.to_dict()})
        per: dict[str, dict] = {k: {"drafted_positions": 0, "rejections": 0}
                                for k in tokenclass.CLASSES}
        for c in cs:
            for k, v in (c.get("token_classes") or {}).items():
                per[k]["drafted_positions"] += v["drafted_positions"]
                per[k]["rejections"] += v["rejections"]
        for k, v in per.items():
            if v["drafted_positions"]:
                classes.append({"config": name, "lang": lang, "class": k, **v,
                                "rejection_rate": v["rejections"] / v["drafted_positions"]})
    return {"baseline": base_name, "speed": speed, "speculation": spec,
            "rejection_by_class": classes, "timing_inference": timing_err,
            "kv_bytes_per_value": _kv_bpv(results), "quality": _quality(results, base_name),
            "reconciled": all(all(c["reconcile"].values()) for c in cells)}


def _kv_bpv(results: dict) -> dict:
    geo = ((results.get("provenance") or {}).get("model") or {}).get("kv_geometry")
    out = {}
    for name, kv in (results.get("kv") or {}).items():
        rec = dict(kv)
        if geo and kv.get("cells") and kv.get("layers"):
            cells = kv["cells"] * kv.get("streams", 1)
            n_k = cells * kv["layers"] * geo["n_head_kv"] * geo["key_length"]
            n_v = cells * kv["layers"] * geo["n_head_kv"] * geo["value_length"]
            rec["k_bytes_per_value"] = kv["k_mib"] * MiB / n_k
            rec["v_bytes_per_value"] = kv["v_mib"] * MiB / n_v
        out[name] = rec
    return out


def _quality(results: dict, base_name: str | None) -> list[dict]:
    base = {q["lang"]: q for q in results.get("quality", []) if q["config"] == base_name}
    out = []
    for q in results.get("quality", []):
        b = base.get(q["lang"])
        if not b or q["config"] == base_name:
            continue
        agree = 0
        for x, y in zip(q["token_ids"], b["token_ids"], strict=False):
            if x != y:
                break
            agree += 1
        pairs = zip(q["logprobs"][:agree], b["logprobs"][:agree], strict=False)
        drift = [abs(x - y) for x, y in pairs if x is not None and y is not None]
        out.append({"config": q["config"], "lang": q["lang"], "kv": q["kv"],
                    "agree_prefix": agree, "compared": min(len(q["token_ids"]),
                                                           len(b["token_ids"])),
                    "logprob_drift_mean": sum(drift) / len(drift) if drift else None})
    return out


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """Write report.json, report.md and the PNG plots into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results["summary"] = summarize(results)
    files = {"json": out_dir / "report.json", "md": out_dir / "report.md"}
    files["json"].write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str))
    try:
        require_extra("matplotlib", "bench", "the plots")
        files.update(plots(results, out_dir))
    except MissingExtra as exc:  # a serving-only install still gets the figures
        results["summary"]["plots"] = f"skipped: {exc.message}"
    files["md"].write_text(markdown(results, files), encoding="utf-8")
    return files


def _f(v: object, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v)


def markdown(results: dict, files: dict[str, Path]) -> str:
    s = results["summary"]
    prov = results["provenance"]
    lines = ["# mtpwrap bench", "",
             f"Started {results['started']}, finished {results.get('finished', '–')}. "
             f"Model `{(prov.get('model') or {}).get('path', '–')}`; binary "
             f"`{prov['build'].get('binary')}` ({' '.join(prov['build'].get('version', []))}). "
             f"Hardware: {prov['hardware'].get('cpu_model', '?')}, "
             f"{prov['hardware'].get('cpu_count')} CPUs, GPUs: "
             f"{', '.join(prov['hardware'].get('gpus') or []) or 'none'}.", "",
             "Corpora: " + "; ".join(
                 f"{LANG_NAMES.get(k, k)} — {v['source']}, {len(v['documents'])} documents"
                 + (f", archive sha256 `{v['archive_sha256'][:16]}…`" if v.get("archive_sha256")
                    else "") for k, v in prov["corpora"].items()) + ".",
             "", *[v["attribution"] for v in prov["corpora"].values() if v.get("attribution")],
             "",
             f"Counts reconcile with llama-server's own counters: "
             f"**{'yes' if s['reconciled'] else 'NO'}**.", ""]
    lines += ["## Speed", "", "| config | context | " + " | ".join(
        f"{LANG_NAMES[g]} prefill t/s | {LANG_NAMES[g]} decode t/s | {LANG_NAMES[g]} speedup"
        for g in _langs(results)) + " |",
        "|---|---:|" + "---:|" * 3 * len(_langs(results))]
    by = {(r["config"], r["context"], r["lang"]): r for r in s["speed"]}
    for cfg in results["plan"]["configs"]:
        for ctx in results["plan"]["contexts"]:
            row = [cfg["name"], str(ctx)]
            for g in _langs(results):
                r = by.get((cfg["name"], ctx, g), {})
                row += [_f(r.get("prefill_tokens_per_s"), "{:.0f}"),
                        _f(r.get("decode_tokens_per_s"), "{:.1f}"),
                        _f(r.get("measured_speedup"))]
            lines.append("| " + " | ".join(row) + " |")
    if s["speculation"]:
        lines += ["", "## Speculation (pooled over contexts)", "",
                  "| config | language | k | drafted | accepted | steps | acceptance rate | "
                  "mean accepted length | α | per-position | speedup formula | "
                  "speedup measured |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        meas = defaultdict(list)
        for r in s["speed"]:
            if r["measured_speedup"] is not None:
                meas[(r["config"], r["lang"])].append(r["measured_speedup"])
        for r in s["speculation"]:
            m = meas.get((r["config"], r["lang"]))
            lines.append("| " + " | ".join([
                r["config"], LANG_NAMES.get(r["lang"], r["lang"]), str(r["depth"]),
                str(r["drafted"]), str(r["accepted"]), str(r["steps"]),
                _f(r["acceptance_rate"], "{:.3f}"), _f(r["mean_accepted_length"]),
                _f(r["alpha"], "{:.3f}"),
                ", ".join(f"{p:.2f}" for p in r["per_position"][:8])
                + ("…" if len(r["per_position"]) > 8 else ""),
                _f(r["predicted_speedup"]), _f(sum(m) / len(m) if m else None)]) + " |")
    if s["rejection_by_class"]:
        lines += ["", "## Where rejections concentrate", "",
                  "| config | language | class | tokens at drafted positions | rejections | "
                  "rejection rate |", "|---|---|---|---:|---:|---:|"]
        for r in s["rejection_by_class"]:
            lines.append(f"| {r['config']} | {LANG_NAMES.get(r['lang'], r['lang'])} | "
                         f"{r['class']} | {r['drafted_positions']} | {r['rejections']} | "
                         f"{r['rejection_rate']:.3f} |")
    errs = [e for e in s["timing_inference"]]
    worst = max((e["error_tokens_share"] or 0.0 for e in errs), default=0.0)
    lines += ["", "### Method and its error", "",
              "llama-server reports acceptance only in totals, not per token. Each verification "
              "step streams its accepted drafts and the target's own token back to back, while "
              "steps are a forward pass apart; a token arriving within "
              f"{_gap(results)} of the previous one is "
              "taken as part of its step. In a step of g tokens the first g−1 are accepted "
              "drafts; if g−1 is below the draft depth the last token is where a draft was "
              "rejected. A token whose text ends inside a multi-byte character (common in Korean "
              "with byte-level vocabularies) is held back by the server and sent with the next "
              "step, so a run longer than depth + 1 hands its surplus back to the run before it "
              "as far as that run has room; a held-back token from a step that emitted nothing "
              "else stays invisible, which is the main error for Korean text on byte-level "
              "vocabularies (see the table). The request's last run is not counted (the token "
              "limit may have cut it). For drafters that sometimes propose nothing (ngram), a "
              "plain step also looks like a rejection, so their rates are upper bounds.", "",
              "Error, measured on this run against the server's counters (accepted drafts "
              "inferred from timing vs `spec_decode_num_accepted_tokens_total`; for "
              "configurations without speculation the truth is 0):", "",
              "| config | language | true accepted | inferred accepted | tokens | "
              "error (share of tokens) |", "|---|---|---:|---:|---:|---:|"]
    for e in errs:
        lines.append(f"| {e['config']} | {LANG_NAMES.get(e['lang'], e['lang'])} | "
                     f"{e['true_accepted']} | {e['inferred_accepted']} | {e['tokens']} | "
                     f"{_f(e['error_tokens_share'], '{:.3f}')} |")
    lines += ["", f"Largest error: {worst:.3f} of tokens."]
    if s["kv_bytes_per_value"]:
        lines += ["", "## KV cache actually allocated", "",
                  "| config | K type | V type | cells | layers | KV MiB | K bytes/value | "
                  "V bytes/value |", "|---|---|---|---:|---:|---:|---:|---:|"]
        for name, k in s["kv_bytes_per_value"].items():
            lines.append(f"| {name} | {k['k_type']} | {k['v_type']} | {k['cells']} | "
                         f"{k['layers']} | {k['total_mib']:.2f} | "
                         f"{_f(k.get('k_bytes_per_value'), '{:.4f}')} | "
                         f"{_f(k.get('v_bytes_per_value'), '{:.4f}')} |")
    if results["load"]:
        lines += ["", "## Latency under load", "",
                  "| config | concurrency | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
                  "ITL max ms | aggregate t/s | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results["load"]:
            ms = {k: (r[k] * 1000 if r[k] is not None else None)
                  for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s")}
            lines.append(f"| {r['config']} | {r['concurrency']} | {_f(ms['ttft_p50_s'], '{:.1f}')}"
                         f" | {_f(ms['ttft_p99_s'], '{:.1f}')} | {_f(ms['itl_p50_s'], '{:.2f}')} | "
                         f"{_f(ms['itl_p99_s'], '{:.2f}')} | {_f(ms['itl_max_s'], '{:.2f}')} | "
                         f"{_f(r['aggregate_tokens_per_s'], '{:.1f}')} | {len(r['errors'])} |")
    if s["quality"]:
        lines += ["", f"## Quality guard (vs {s['baseline']}, temperature 0)", "",
                  "| config | language | KV | leading tokens identical | compared | "
                  "mean abs logprob drift |", "|---|---|---|---:|---:|---:|"]
        for q in s["quality"]:
            lines.append(f"| {q['config']} | {LANG_NAMES.get(q['lang'], q['lang'])} | {q['kv']} | "
                         f"{q['agree_prefix']} | {q['compared']} | "
                         f"{_f(q['logprob_drift_mean'], '{:.4f}')} |")
    pngs = [p for k, p in files.items() if k.startswith("png_")]
    if pngs:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    lines += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    lines += ["", "Token classes: " + "; ".join(
        f"`{k}` {v}" for k, v in tokenclass.DESCRIPTIONS.items()) + ".", ""]
    return "\n".join(lines)


def _langs(results: dict) -> list[str]:
    return list(results["plan"]["langs"])


def plots(results: dict, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    langs = _langs(results)
    configs = [c["name"] for c in results["plan"]["configs"]]
    files: dict[str, Path] = {}

    fig, axes = plt.subplots(2, len(langs), figsize=(6 * len(langs), 8), squeeze=False,
                             sharey="row")
    for j, lang in enumerate(langs):
        for i, (key, label) in enumerate((("decode_tokens_per_s", "decode tokens/s"),
                                          ("prefill_tokens_per_s", "prefill tokens/s"))):
            ax = axes[i][j]
            for name in configs:
                pts = sorted((r["context"], r[key]) for r in s["speed"]
                             if r["config"] == name and r["lang"] == lang and r[key])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (prompt tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"{LANG_NAMES.get(lang, lang)}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Tokens/s vs context per configuration")
    fig.tight_layout()
    files["png_speed"] = out_dir / "speed_vs_context.png"
    fig.savefig(files["png_speed"], dpi=110)
    plt.close(fig)

    if s["speculation"]:
        spec_cfgs = sorted({r["config"] for r in s["speculation"]}, key=configs.index)
        fig, axes = plt.subplots(1, len(langs), figsize=(6 * len(langs), 4.5), squeeze=False,
                                 sharey=True)
        for j, lang in enumerate(langs):
            ax = axes[0][j]
            width = 0.8 / max(1, len(spec_cfgs))
            for n, name in enumerate(spec_cfgs):
                r = next((r for r in s["speculation"]
                          if r["config"] == name and r["lang"] == lang), None)
                if not r or not r["per_position"]:
                    continue
                xs = [p + n * width for p in range(len(r["per_position"]))]
                ax.bar(xs, r["per_position"], width=width,
                       label=f"{name} (rate {_f(r['acceptance_rate'])}, α {_f(r['alpha'])})")
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("draft position (0 = first drafted token)")
            ax.set_ylabel("share of steps with this position accepted")
            ax.set_title(f"{LANG_NAMES.get(lang, lang)}: acceptance by draft position")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["png_acceptance"] = out_dir / "acceptance_by_position.png"
        fig.savefig(files["png_acceptance"], dpi=110)
        plt.close(fig)

    if s["rejection_by_class"]:
        spec_cfgs = sorted({r["config"] for r in s["rejection_by_class"]}, key=configs.index)
        fig, axes = plt.subplots(1, len(spec_cfgs), figsize=(6 * len(spec_cfgs), 4.5),
                                 squeeze=False, sharey=True)
        present = [c for c in tokenclass.CLASSES
                   if any(r["class"] == c for r in s["rejection_by_class"])]
        for j, name in enumerate(spec_cfgs):
            ax = axes[0][j]
            width = 0.8 / max(1, len(langs))
            for n, lang in enumerate(langs):
                rates = []
                for c in present:
                    r = next((r for r in s["rejection_by_class"] if r["config"] == name
                              and r["lang"] == lang and r["class"] == c), None)
                    rates.append(r["rejection_rate"] if r else 0.0)
                ax.bar([i + n * width for i in range(len(present))], rates, width=width,
                       label=LANG_NAMES.get(lang, lang))
            ax.set_xticks([i + width * (len(langs) - 1) / 2 for i in range(len(present))])
            ax.set_xticklabels(present, rotation=30, ha="right")
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("rejection rate (inferred from stream timing)")
            ax.set_title(f"{name}: rejections by token class")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["png_rejection"] = out_dir / "rejection_by_class.png"
        fig.savefig(files["png_rejection"], dpi=110)
        plt.close(fig)
    return files


def _gap(results: dict) -> str:
    """The step gap the report used: the one given, or each cell's own."""
    given = results["plan"]["gap_s"]
    if given is not None:
        return f"{given * 1000:.1f} ms"
    used = [c["stream"]["gap_s"] for c in results["cells"] if "stream" in c]
    span = f"; {min(used) * 1000:.1f}–{max(used) * 1000:.1f} ms in this run" if used else ""
    return f"a fifth of the server's own mean step in that cell (from its counters{span})"
