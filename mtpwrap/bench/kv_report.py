"""The KV benchmark's files: report.json (every raw figure), report.md (tables, the answers,
provenance) and PNG plots (KL divergence and speed vs depth), matplotlib imported only here."""

from __future__ import annotations

import json
from pathlib import Path

from mtpwrap.bench import corpora
from mtpwrap.errors import ConfigError, MissingExtra, require_extra

LANG_NAMES = {"ko": "Korean", "en": "English"}


def _f(v: object, fmt: str = "{:.4f}") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "–"
    out = fmt.format(v)
    return out[1:] if out.startswith("-") and not out.strip("-0.") else out  # "-0.0000"


def table_rows(results: dict) -> list[list[str]]:
    """One line per (type, corpus, depth): the figures the table and the markdown show."""
    speed = {(s["kv"], s.get("corpus"), s.get("depth")): s for s in results["speed"]}
    out = []
    measured = {(r["kv"], r["corpus"], r["depth"]) for r in results["rows"]}
    speed_only = [{"kv": t, "corpus": c, "depth": d} for (t, c, d) in speed
                  if (t, c, d) not in measured and c is not None]
    for r in results["rows"] + speed_only:
        s = speed.get((r["kv"], r["corpus"], r["depth"]), {})
        bits = r.get("k_bits_per_value")
        out.append([r["kv"], r["corpus"], str(r["depth"]), _f(r.get("kld_mean")),
                    _f(r.get("kld_p99")), _f(r.get("same_top_p_pct"), "{:.2f}"),
                    _f(r.get("ppl_ratio")), _f(bits, "{:.3f}"),
                    _f(r.get("nominal_bits_per_value"), "{:.3f}"),
                    _f(r.get("prefill_tokens_per_s"), "{:.0f}"),
                    _f(s.get("prefill_tokens_per_s"), "{:.0f}"),
                    _f(s.get("decode_tokens_per_s"), "{:.1f}"),
                    r.get("error", "")[:80]])
    return out


COLUMNS = ["kv", "corpus", "depth", "KLD", "KLD p99", "top1 %", "PPL ratio", "bpv", "bpv type",
           "pp t/s", "srv pp t/s", "tg t/s", "error"]
LEGEND = ("KLD: mean KL divergence of the next-token distributions from f16's; KLD p99: its "
          "99th percentile; top1 %: tokens whose most likely next token is f16's; PPL ratio: "
          "PPL(type)/PPL(f16); bpv: bits per K value from the KV buffer llama.cpp logged; bpv "
          "type: the type's nominal size; pp t/s: llama-perplexity's first pass (prefill of "
          "whole windows); srv pp / tg t/s: llama-server prefill of `depth` prompt tokens and "
          "decode after them.")


def markdown(results: dict, files: dict[str, Path]) -> str:
    p = results["plan"]
    lines = ["# KV cache quality against f16", "",
             f"Model `{Path(p['model']).name}`, llama-perplexity `{p['perplexity']}`; windows "
             f"{', '.join(map(str, p['depths']))} tokens, chunks {p['chunks']}, K and V of "
             f"the same type, flash attention on; started {results['started']}, finished "
             f"{results.get('finished', '–')}.", "",
             "Each window is scored on its second half (positions depth/2 … depth−1) against "
             "the f16 run's next-token distributions (`--kl-divergence-base`). PPL ratio is "
             "against the base file's stored 16-bit log-probabilities, so f16's own row shows "
             "the floor that storage leaves.", "", LEGEND, "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    na = [t for t in results["types"] if not t["applicable"]]
    if na:
        lines += ["", "## Not applicable", ""]
        lines += [f"- **{t['kv']}**: {t['reason']}" for t in na]
    lines += ["", "## What the figures say", ""]
    lines += [f"- {s}" for s in results["hypotheses"].values()]
    lines += ["", "## Text", ""]
    for name, c in results["corpora"].items():
        docs = c.get("documents") or []
        lines.append(f"- {name} ({LANG_NAMES.get(c['lang'], c['lang'])}): "
                     f"{c['provenance']['source']}, {len(docs)} whole documents (at least "
                     f"{sum(d['tokens'] for d in docs)} tokens of this model); each one's name, "
                     "sha256 and tokens are in report.json")
        for d, why in (c.get("cannot_fill") or {}).items():
            lines.append(f"  - depth {d}: {why}")
    notes = {c["provenance"].get("attribution") for c in results["corpora"].values()} - {None}
    if any((c["provenance"].get("source") or "").startswith("card-legal")
           for c in results["corpora"].values()):
        notes.add(corpora.KOREAN_LEGAL_NOTE)
    lines += [""] + [f"_{n}_" for n in sorted(notes)]
    pngs = [f for k, f in files.items() if k.startswith("png_")]
    if pngs:
        lines += [""] + [f"![{f.stem}]({f.name})" for f in pngs]
    return "\n".join(lines) + "\n"


def plots(results: dict, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, Path] = {}
    corp = list(results["corpora"])
    for key, label, src, fname in (
            ("kld_mean", "mean KLD vs f16", results["rows"], "kld_vs_depth.png"),
            ("decode_tokens_per_s", "decode tokens/s", results["speed"], "speed_vs_depth.png")):
        types = list(dict.fromkeys(r["kv"] for r in src if r.get(key) is not None))
        if not types:
            continue
        fig, axes = plt.subplots(1, len(corp), figsize=(6 * len(corp), 4.5), squeeze=False,
                                 sharey=True)
        for j, name in enumerate(corp):
            ax = axes[0][j]
            for t in types:
                if key == "kld_mean" and t == "f16":
                    continue  # the reference against itself: zero
                pts = sorted((r["depth"], r[key]) for r in src
                             if r["kv"] == t and r.get("corpus") == name
                             and r.get(key) is not None)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=t)
            ax.set_xscale("log", base=2)
            if key == "kld_mean":
                ax.set_yscale("log")
            ax.set_xlabel("window (tokens); scored on its second half")
            ax.set_ylabel(label)
            lang = results["corpora"][name]["lang"]
            ax.set_title(f"{name} ({LANG_NAMES.get(lang, lang)})")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["png_" + key] = out_dir / fname
        fig.savefig(files["png_" + key], dpi=110)
        plt.close(fig)
    return files


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """report.json, report.md and the plots in `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "report.json", "md": out_dir / "report.md"}
    try:
        require_extra("matplotlib", "bench", "the plots")
        files.update(plots(results, out_dir))
    except MissingExtra as exc:  # a serving-only install still gets the figures
        results["plots"] = f"skipped: {exc.message}"
    files["json"].write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str))
    files["md"].write_text(markdown(results, files), encoding="utf-8")
    return files


def load(path: Path) -> dict:
    """A report.json written by `write` (for `bench kv --from`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--from {path}: cannot read a KV benchmark report ({exc}).") from None
    if not isinstance(data, dict) or data.get("kind") != "kv-quality" or "rows" not in data:
        raise ConfigError(f"--from {path}: not a `mtpwrap bench kv` report.json "
                          "(no kind: kv-quality).")
    return data
