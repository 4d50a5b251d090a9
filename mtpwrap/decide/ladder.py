"""Stepping down after out-of-memory starts: cheaper launches, each cumulative, on `LaunchConfig`.

First the ubatch halved down to 32 (it costs read speed only), then draft depth down to 1,
speculation off, each smaller KV type per value (among those the binary offers and the model
admits), the context halved down to CONTEXT_FLOOR.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import kv
from mtpwrap.decide.vocab import CONTEXT_FLOOR, KV_TYPES, SPELLINGS, STEP_KV_TYPES
from mtpwrap.errors import ConfigError

#: the smallest ubatch a step-down goes to (the recipe's -ub 32)
UBATCH_FLOOR = 32

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.launch import LaunchConfig


def ladder(cfg: LaunchConfig, caps: Capabilities | None = None,
           kv_sizes: Mapping[str, Any] | None = None,
           cost: Callable[[LaunchConfig], int] | None = None, *,
           facts: ModelFacts | None = None, target: kv.Target | None = None
           ) -> list[LaunchConfig]:
    """The cheaper launches tried after out-of-memory starts, each cumulative: the ubatch
    halved down to UBATCH_FLOOR first (only the read slows), then draft depth down to 1,
    speculation off, each smaller KV type per value (among those the binary offers and, given
    its `facts`, the model admits on `target`), the context halved down to CONTEXT_FLOOR.
    With `cost` (planned bytes of a launch) the groups after the ubatch go in the order of the
    bytes their first step saves, least first, and a step that saves nothing is left out;
    without it, in that fixed order, leaving out steps that change nothing."""
    def ubatch(c: LaunchConfig) -> LaunchConfig | None:
        if c.ubatch is None or c.ubatch <= UBATCH_FLOOR:
            return None
        n = max(UBATCH_FLOOR, c.ubatch // 2)
        return c.replace(ubatch=n, why={"ubatch": "step-down after out-of-memory"},
                         note=f"ubatch {n}")

    def depth(c: LaunchConfig) -> LaunchConfig | None:
        if c.spec in ("mtp", "draft") and c.depth is not None and c.depth > 1:
            return c.replace(depth=1, why={"depth": "step-down after out-of-memory"},
                             note="draft depth 1")
        return None

    def no_spec(c: LaunchConfig) -> LaunchConfig | None:
        if c.spec == "none":
            return None
        return c.replace(spec="none", spec_type=None, depth=None, p_min=None, ngram_n=None,
                         draft_model=None, draft_k=None, draft_v=None,
                         why={"spec_type": "step-down after out-of-memory"},
                         note="no speculation")

    def smaller_kv(c: LaunchConfig) -> LaunchConfig | None:
        smaller = _smaller_kv(c, caps, kv_sizes, facts, target)
        if smaller is None:
            return None
        return c.replace(cache_k=smaller, cache_v=smaller, flash_attn="on",
                         why={"cache_k": "step-down after out-of-memory",
                              "cache_v": "step-down after out-of-memory",
                              "flash_attn": f"quantized V cache ({smaller}) needs it"},
                         note=f"KV {smaller}")

    def context(c: LaunchConfig) -> LaunchConfig | None:
        if c.context <= CONTEXT_FLOOR:
            return None
        n = max(CONTEXT_FLOOR, c.context // 2)
        return c.replace(context=n, why={"context": "step-down after out-of-memory"},
                         note=f"context {n}")

    groups: list[tuple[Callable[[LaunchConfig], LaunchConfig | None], bool]] = [
        (depth, False), (no_spec, False), (smaller_kv, True), (context, True)]  # (step, repeats)
    if cost is not None:
        base = cost(cfg)

        def saved(step: Callable[[LaunchConfig], LaunchConfig | None]) -> int:
            nxt = step(cfg)
            return 0 if nxt is None else base - cost(nxt)

        ranked = [(saved(g[0]), i, g) for i, g in enumerate(groups)]
        groups = [g for s, _, g in sorted(ranked) if s > 0 or g[0] is context]
    groups.insert(0, (ubatch, True))
    steps: list[LaunchConfig] = []
    notes: list[str] = []
    cur, cur_cost = cfg, cost(cfg) if cost is not None else 0
    for step, repeats in groups:
        while (nxt := step(cur)) is not None:
            if cost is not None:
                c = cost(nxt)
                if c >= cur_cost:
                    break  # saves nothing more
                cur_cost = c
            notes.append(nxt.note or "")
            cur = dataclasses.replace(nxt, note=f"step-down {len(notes)}: " + ", ".join(notes))
            steps.append(cur)
            if not repeats:
                break
    return steps


def _smaller_kv(cfg: LaunchConfig, caps: Capabilities | None,
                kv_sizes: Mapping[str, Any] | None, facts: ModelFacts | None,
                target: kv.Target | None) -> str | None:
    """The next smaller rung of STEP_KV_TYPES that the binary offers and the model admits: the
    one with the most bits per value (measured sizes win) below both of cfg's types."""
    offered: Sequence[str] = STEP_KV_TYPES
    if caps is not None:
        flag = caps.first_of(SPELLINGS["cache_k"])
        allowed = (caps.allowed(flag) if flag else None) or KV_TYPES
        offered = [t for t in STEP_KV_TYPES if t in allowed]
    if facts is not None:
        offered = [t for t in offered if kv.admits(facts, t, "K", target).admitted
                   and kv.admits(facts, t, "V", target).admitted]
    try:
        now = max(kv.bits_per_value(cfg.cache_k, kv_sizes),
                  kv.bits_per_value(cfg.cache_v, kv_sizes))
    except ConfigError:
        return None
    best: tuple[float, str] | None = None
    for t in offered:
        try:
            bits = kv.bits_per_value(t, kv_sizes)
        except ConfigError:
            continue  # a type without a known size cannot be shown to save anything
        if bits < now and (best is None or bits > best[0]):
            best = (bits, t)
    return best[1] if best else None


def step_down(cfg: LaunchConfig, step: int, caps: Capabilities | None = None,
              kv_sizes: Mapping[str, Any] | None = None,
              cost: Callable[[LaunchConfig], int] | None = None, *,
              facts: ModelFacts | None = None, target: kv.Target | None = None
              ) -> LaunchConfig | None:
    """`cfg` itself for step 0, the `step`-th rung of the ladder, or None past its end."""
    if step <= 0:
        return cfg
    steps = ladder(cfg, caps, kv_sizes, cost, facts=facts, target=target)
    return steps[step - 1] if step <= len(steps) else None
