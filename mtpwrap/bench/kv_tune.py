"""From measurement to decision: the profile's KV list ordered by the mean KL divergence
`bench kv` measured, lowest first, among the types whose memory plan fits at the context asked,
with the figures as the reason the launch quotes (`mtpwrap args`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtpwrap.bench import kv
from mtpwrap.bench.tune import _write_profile
from mtpwrap.decide import profiles
from mtpwrap.decide.resolve import Inputs
from mtpwrap.errors import ConfigError
from mtpwrap.supervision.inputs import gather, resolve_inputs


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def pick_depth(results: dict, context: int) -> int:
    """The largest measured depth not above `context` (else the smallest measured)."""
    depths = sorted({r["depth"] for r in results["rows"] if r.get("kld_mean") is not None})
    if not depths:
        raise ConfigError("bench kv --write: the report holds no measured KLD to order by.")
    fit = [d for d in depths if d <= context]
    return fit[-1] if fit else depths[0]


def plan_fits(inp: Inputs, t: str, context: int) -> tuple[bool, str]:
    """Does the profile with K and V at `t` plan to fit at `context` here? (the one resolve)"""
    prof = profiles.with_overrides(inp.profile, {"kv": {"k": [t], "v": [t]}, "context": context},
                                   where=f"bench kv --write ({t})")
    try:
        r = resolve_inputs(dataclasses.replace(inp, profile=prof), plan=True, refuse=False)
    except ConfigError as exc:
        return False, str(exc)
    if r.plan is None:
        return True, r.plan_text or "not planned"
    if r.plan.fits is False:
        return False, f"its plan does not fit at context {context:,} ({r.plan_text})"
    return True, r.plan_text or ""


def kv_order(results: dict, inp: Inputs, context: int) -> tuple[list[str], str, list[str]]:
    """(types in order, the reason, the types left out with why)."""
    depth = pick_depth(results, context)
    ranked = kv.kld_order(results["rows"], depth)
    kept: list[tuple[str, float]] = []
    dropped: list[str] = []
    for t, kld in ranked:
        ok, why = plan_fits(inp, t, context)
        if ok:
            kept.append((t, kld))
        else:
            dropped.append(f"{t} ({why})")
    if not kept:
        raise ConfigError(f"bench kv --write: no measured KV type fits at context {context:,}: "
                          + "; ".join(dropped))
    langs = sorted({r["lang"] for r in results["rows"] if r["depth"] == depth})
    pairs = ", ".join(f"{t} {kld:.4g}" for t, kld in kept)
    why = (f"measured by bench kv on {Path(results['plan']['model']).name} "
           f"({results['started'][:10]}): mean KLD against f16 at {_k(depth)}"
           f" ({'/'.join(langs)}) {pairs}")
    quant = [(t, x) for t, x in kept if t != "f16"]
    if len(quant) >= 2:
        (a, ka), (b, kb) = quant[0], quant[-1]
        why += f"; {a} before {b} for this model: KLD {ka:.3g} vs {kb:.3g} at {_k(depth)}"
    if dropped:
        why += "; left out: " + "; ".join(dropped)
    return [t for t, _ in kept], why, dropped


def write_kv_order(results: dict, *, profile: str | None, context: int | None,
                   binary: str | None) -> tuple[Path, str]:
    """Write the profile's KV list in measured order as a user profile override."""
    inp = gather(profile or "auto", model=results["plan"]["model"], binary=binary)
    ctx = context or (inp.profile.context if isinstance(inp.profile.context, int) else None)
    if ctx is None:
        raise ConfigError(f"bench kv --write: profile {inp.profile.name} has context: max; "
                          "pass --context N.")
    order, why, _ = kv_order(results, inp, ctx)
    # the order holds for the measured model at this context: the profile says so
    prof = profiles.with_overrides(
        inp.profile, {"kv": {"k": order, "v": order, "why": why}, "context": ctx,
                      "model": str(results["plan"]["model"])},
        where=f"bench kv --write for profile {inp.profile.name}")
    return _write_profile(profiles.to_yaml(prof), inp.profile.name), why
