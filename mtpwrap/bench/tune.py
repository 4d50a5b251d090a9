"""`mtpwrap tune`: sweep draft depth × minimum draft probability on a short workload, fit α and
the per-step draft cost, and recommend the setting with the best *measured* decode tokens/s.

Cost model (all times in units of one baseline decode step, measured in the same session):
a verification step at depth k costs r(k) = a + c·k, where c is the cost of drafting one token
and a the verification overhead. r is measured as mean accepted length ÷ measured speedup, and
(a, c) are fitted by least squares over the sweep. The model then predicts
speedup(k) = (1 + α + … + α^k) ÷ (a + c·k); the report puts it next to the measured speedup.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mtpwrap import paths
from mtpwrap.bench import corpora, stats
from mtpwrap.bench.runner import (
    BenchConfig,
    Client,
    cell_profile,
    quiet,
    resolve_profile,
    start_launch,
)
from mtpwrap.build import spec_probe
from mtpwrap.decide import acceptance, profiles
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.profile_types import Profile


@dataclass
class TunePlan:
    binary: Path
    model: Path
    profile: Profile  #: every setting is this profile with its spec (and kv, threads) replaced
    kind: str = "draft"
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 5])
    p_mins: list[float] = field(default_factory=lambda: [0.0, 0.75])
    context: int = 512
    n_predict: int = 64
    langs: list[str] = field(default_factory=lambda: ["ko", "en"])
    kv: str | None = None  #: None: the profile's own KV types
    draft_model: Path | None = None
    threads: int | None = None

    def configs(self) -> list[BenchConfig]:
        if self.kind == "none":
            raise ConfigError("Tuning needs a speculation kind (draft, ngram or mtp), not 'none'.")
        out = [BenchConfig("baseline", spec="none", kv=self.kv)]
        # ngram drafting has no probability, so p_min does not apply to it.
        p_mins: list[float | None] = list(self.p_mins) if self.kind != "ngram" else [None]
        for k in self.depths:
            for p in p_mins:
                name = f"{self.kind}-k{k}" + (f"-p{p:g}" if p is not None else "")
                out.append(BenchConfig(name, spec=self.kind, depth=k, p_min=p, kv=self.kv,
                                       draft_model=str(self.draft_model)
                                       if self.draft_model else None))
        return out


def _measure(client: Client, prompts: list[list[int]], n_predict: int) -> dict:
    before = client.metrics()
    gen_s = 0.0
    n = 0
    for p in prompts:
        res = client.complete(p, n_predict)
        gen_s += float(res.timings.get("predicted_ms", 0.0)) / 1000.0
        n += int(res.timings.get("predicted_n", res.n))
    after = client.metrics()
    return {"tokens": n, "seconds": gen_s, "tokens_per_s": n / gen_s if gen_s else None,
            "counters": (after - before).to_dict()}


def setting_profile(plan: TunePlan, cfg: BenchConfig) -> Profile:
    """The profile one setting runs: what `tune --write` saves for the best one, so `up` runs
    exactly what was measured."""
    return cell_profile(cfg, plan.profile, drafter=plan.model, threads=plan.threads,
                        model=str(plan.model))


def run(plan: TunePlan, workdir: Path,
        progress: Callable[[str], None] = quiet) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    corp = [corpora.load(lang) for lang in plan.langs]
    caps: Capabilities | None = None
    points: list[dict] = []
    for cfg in plan.configs():
        progress(cfg.name)
        cl, caps = resolve_profile(setting_profile(plan, cfg), binary=plan.binary,
                                   model=plan.model, caps=caps)
        need = plan.context + plan.n_predict + 64
        if 0 < cl.context < need * cl.slots:
            raise ConfigError(f"profile {plan.profile.name}: context {cl.context} over "
                              f"{cl.slots} slot(s) is too small for --context "
                              f"{plan.context} plus {plan.n_predict} tokens; lower --context.")
        srv = start_launch(cl, caps, binary=plan.binary, log_path=workdir / f"{cfg.name}.log",
                           what=f"llama-server for setting {cfg.name!r}")
        client = Client.of(srv)
        try:
            prompts = [corpora.build_prompt(c, plan.context, client.tokenize).tokens
                       for c in corp]
            m = _measure(client, prompts, plan.n_predict)
        finally:
            client.close()
            srv.stop()
        m["config"] = cfg.to_dict()
        m["argv"] = srv.argv
        points.append(m)
    return analyse(points)


def analyse(points: list[dict]) -> dict:
    """Fit α per point and (a, c) over the sweep; pick the best measured tokens/s."""
    base = next((p for p in points if p["config"]["spec"] == "none"), None)
    if base is None or not base.get("tokens_per_s"):
        raise ConfigError("The sweep has no baseline measurement to compare speedups against.")
    rows: list[dict] = []
    fit_pts: list[tuple[int, float]] = []
    for p in points:
        cfg = p["config"]
        row = {"name": cfg["name"], "kind": cfg["spec"], "depth": cfg["depth"],
               "p_min": cfg["p_min"], "tokens_per_s": p["tokens_per_s"],
               "measured_speedup": (p["tokens_per_s"] or 0.0) / base["tokens_per_s"],
               "argv": p.get("argv")}
        if cfg["spec"] != "none":
            c = stats.Counters(**p["counters"])
            k = len(c.per_pos) or cfg["depth"]
            s = stats.spec_stats(c, k)
            row.update({"k": k, "alpha": s.alpha, "acceptance_rate": s.acceptance_rate,
                        "mean_accepted_length": s.mean_accepted_length,
                        "formula_speedup": s.predicted_speedup})
            if s.mean_accepted_length and row["measured_speedup"] > 0:
                row["step_cost"] = s.mean_accepted_length / row["measured_speedup"]
                fit_pts.append((k, row["step_cost"]))
        rows.append(row)
    overhead, per_draft = stats.fit_step_cost(fit_pts)
    for row in rows:
        if row.get("alpha") is not None:
            row["modelled_speedup"] = acceptance.modelled_speedup(row["alpha"], row["k"],
                                                                  overhead, per_draft)
    best = max(rows, key=lambda r: r["tokens_per_s"] or 0.0)
    return {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "baseline_tokens_per_s": base["tokens_per_s"], "fit": {"a": overhead, "c": per_draft},
            "rows": rows, "best": best, "raw": points}


def run_per_class(plan: TunePlan, workdir: Path, per_class: int = 2,
                  progress: Callable[[str], None] = quiet) -> dict:
    """Per request class (Korean statutes, English licences, code), decode tokens/s at each
    draft depth (0 = off) on ONE server: the profile at the deepest depth, each request asking
    for its own `speculative.n_max` (the patched build honours it; another is refused). The
    best depth per class becomes the profile's `spec.policy` with --write."""
    if plan.kind == "ngram":
        raise ConfigError("--per-class tunes draft or mtp speculation; n-gram drafting has no "
                          "depth a request can ask for beyond its match.")
    workdir.mkdir(parents=True, exist_ok=True)
    depths = sorted({0, *plan.depths})
    cfg = _deepest(plan)
    cl, caps = resolve_profile(setting_profile(plan, cfg), binary=plan.binary,
                               model=plan.model)
    work = corpora.class_workload(per_class)
    table: dict[str, dict[str, float | None]] = {}
    srv = start_launch(cl, caps, binary=plan.binary, log_path=workdir / "per-class.log",
                       what="llama-server for the per-class sweep")
    http = srv.client(timeout=600.0, keepalive=False)
    try:
        default = spec_probe.draft_counts(http, {})[0]
        zero = spec_probe.draft_counts(http, {"speculative.n_max": 0})[0]
        if spec_probe.verdict(default, zero) != "honoured":
            raise ConfigError(f"{plan.binary}: this llama-server ignores a request's own draft "
                              "depth, so --per-class cannot measure one; build it with the "
                              "patch set (`mtpwrap build`, without --no-patches).")
        for cls, prompts in work.items():
            table[cls] = {}
            for d in depths:
                progress(f"{cls} depth {d}")
                n = seconds = 0.0
                for text in prompts:  # decode only: a passage is read once, then kept
                    r = http.post("/completion", json={
                        "prompt": text, "n_predict": plan.n_predict, "temperature": 0.0,
                        "cache_prompt": True, "speculative.n_max": d})
                    r.raise_for_status()
                    timings = dict(r.json().get("timings") or {})
                    n += float(timings.get("predicted_n", 0))
                    seconds += float(timings.get("predicted_ms", 0.0)) / 1000.0
                table[cls][str(d)] = n / seconds if seconds else None
    finally:
        http.close()
        srv.stop()
    policy = {cls: int(max(row, key=lambda k: row[k] or 0.0)) for cls, row in table.items()}
    return {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "per_class": table, "policy": policy, "argv": srv.argv, "config": cfg.to_dict()}


def _deepest(plan: TunePlan) -> BenchConfig:
    """The setting the per-class sweep serves: the deepest depth asked for (a request can only
    lower it)."""
    return BenchConfig(f"{plan.kind}-k{max(plan.depths)}", spec=plan.kind,
                       depth=max(plan.depths), kv=plan.kv,
                       draft_model=str(plan.draft_model) if plan.draft_model else None)


def write_class_policy(result: dict, plan: TunePlan) -> Path:
    """Save the measured per-class depths as the profile's `spec.policy`, in the very profile
    the sweep served (so `up` runs the same command line), validated, written atomically."""
    prof = setting_profile(plan, BenchConfig(**result["config"]))
    data = profiles.to_yaml(prof)
    data["spec"]["policy"] = dict(result["policy"])
    data["description"] = (f"Tuned per request class by mtpwrap tune on {result['created']}: "
                           + ", ".join(f"{c} depth {d}" for c, d in result["policy"].items()))
    return _write_profile(data, plan.profile.name)


def _write_profile(data: dict, name: str) -> Path:
    import yaml

    path = paths.user_config_dir() / "profiles" / f"{name}.yaml"
    profiles.validate(data, where=str(path), expected_name=name)
    paths.replace_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


def write_override(result: dict, plan: TunePlan) -> Path:
    """Save the best measured setting as a user profile override: the very profile it was
    measured with (validated), written atomically."""
    best = result["best"]
    c = best["config"] if "config" in best else next(
        p["config"] for p in result["raw"] if p["config"]["name"] == best["name"])
    cfg = BenchConfig(**c)
    data = profiles.to_yaml(setting_profile(plan, cfg))
    data["description"] = (
        f"Tuned by mtpwrap tune on {result['created']}: {best['name']} measured "
        f"{best['tokens_per_s']:.1f} t/s ({best['measured_speedup']:.2f}x baseline)."
    )
    return _write_profile(data, plan.profile.name)


def markdown(result: dict) -> str:
    lines = ["# mtpwrap tune", "",
             f"Baseline {result['baseline_tokens_per_s']:.1f} t/s. Fitted step cost "
             f"r(k) = {result['fit']['a']:.3f} + {result['fit']['c']:.3f}·k baseline steps.", "",
             "| setting | k | p_min | t/s | acceptance rate | α | speedup formula | "
             "speedup model | speedup measured |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: object, fmt: str = "{:.2f}") -> str:
        return fmt.format(v) if isinstance(v, (int, float)) else "–"

    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r.get('k', '–')} | {f(r['p_min'])} | "
                     f"{f(r['tokens_per_s'], '{:.1f}')} | {f(r.get('acceptance_rate'), '{:.3f}')}"
                     f" | {f(r.get('alpha'), '{:.3f}')} | {f(r.get('formula_speedup'))} | "
                     f"{f(r.get('modelled_speedup'))} | {f(r['measured_speedup'])} |")
    b = result["best"]
    lines += ["", f"Best measured: **{b['name']}** at {b['tokens_per_s']:.1f} t/s "
              f"({b['measured_speedup']:.2f}x).", "",
              "- speedup formula: 1 + α + … + α^k, drafting free.",
              "- speedup model: formula ÷ fitted step cost (a + c·k).",
              "- speedup measured: t/s ÷ baseline t/s.", ""]
    return "\n".join(lines)


def write_report(result: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "tune.json", "md": out_dir / "tune.md"}
    files["json"].write_text(json.dumps(result, indent=1, default=str))
    files["md"].write_text(markdown(result))
    return files
