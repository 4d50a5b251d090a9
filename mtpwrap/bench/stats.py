"""Speculation statistics, defined once.

Two different numbers are both called "acceptance" (docs/facts.md §4):
- llama.cpp's acceptance rate = accepted draft tokens ÷ drafted tokens;
- the recipe's α = the per-position acceptance that, with independent positions and stopping at
  the first miss, explains the observed tokens per verification step: 1 + α + α² + … + α^k.
With k = 3 and α = 0.73 the first is 0.55 and the tokens per step 2.65. Report both.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from mtpwrap import promtext

# The acceptance model lives in decide: the front's depth policy uses it too.
from mtpwrap.decide import acceptance
from mtpwrap.decide.acceptance import alpha_for_tokens_per_step, expected_tokens_per_step

#: Counter names as llama-server prints them on /metrics (with `--metrics`).
M_PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
M_PREDICTED = "llamacpp:tokens_predicted_total"
M_PREDICTED_S = "llamacpp:tokens_predicted_seconds_total"
M_DECODE = "llamacpp:n_decode_total"
M_DRAFTED = "llamacpp:spec_decode_num_draft_tokens_total"
M_ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
M_STEPS = "llamacpp:spec_decode_num_drafts_total"
M_PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"

#: the step gap when the server counted no generation time (a stream without its counters)
FALLBACK_GAP_S = 0.002


def parse_metrics(text: str) -> dict[str, object]:
    """Prometheus text → {sample name: value}, per-position counter → {name: {pos: value}}.

    Read by the one Prometheus text reader (`mtpwrap.promtext`); other labelled samples are
    left out.
    """
    out: dict[str, object] = {}
    for s in promtext.samples(text):
        if "position" in s.labels:
            per = out.setdefault(s.name, {})
            assert isinstance(per, dict)
            per[int(s.labels["position"])] = s.value
        elif not s.labels:
            out[s.name] = s.value
    return out


@dataclass
class Counters:
    """llama-server's own counters (a difference of two /metrics scrapes)."""

    prompt_tokens: float = 0.0
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    n_decode: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    steps: float = 0.0
    per_pos: list[float] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, m: dict[str, object]) -> Counters:
        def f(name: str) -> float:
            v = m.get(name, 0.0)
            return float(v) if isinstance(v, (int, float)) else 0.0

        pp = m.get(M_PER_POS, {})
        per = [float(pp[i]) for i in sorted(pp)] if isinstance(pp, dict) else []
        return cls(f(M_PROMPT_TOKENS), f(M_PREDICTED), f(M_PREDICTED_S), f(M_DECODE),
                   f(M_DRAFTED), f(M_ACCEPTED), f(M_STEPS), per)

    def _combine(self, other: Counters, op: Callable[[float, float], float]) -> Counters:
        """`op` of each counter of the two; the shorter per-position list is padded with 0."""
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + [0.0] * (n - len(self.per_pos))
        b = other.per_pos + [0.0] * (n - len(other.per_pos))
        totals = {f.name: op(getattr(self, f.name), getattr(other, f.name))
                  for f in fields(self) if f.name != "per_pos"}
        return Counters(**totals, per_pos=[op(x, y) for x, y in zip(a, b, strict=True)])

    def __sub__(self, before: Counters) -> Counters:
        return self._combine(before, operator.sub)

    def __add__(self, other: Counters) -> Counters:
        return self._combine(other, operator.add)

    def to_dict(self) -> dict:
        return asdict(self)

    def step_gap(self) -> float:
        """The stream gap that separates verification steps: a fifth of the server's own mean
        generation step here (a step's tokens arrive back to back, steps a forward pass apart),
        so a loaded machine's slower steps are not split; FALLBACK_GAP_S when it counted none.
        A step emits its accepted drafts and one token of its own, so generation took
        predicted − accepted steps (n_decode would count the prompt's batches too: at long
        context more than the steps)."""
        steps = self.predicted_tokens - self.accepted
        if steps > 0 and self.predicted_seconds > 0:
            return 0.2 * self.predicted_seconds / steps
        return FALLBACK_GAP_S


@dataclass
class SpecStats:
    depth: int
    drafted: int
    accepted: int
    steps: int
    acceptance_rate: float | None  # accepted ÷ drafted (llama.cpp's number)
    per_position: list[float]  # P(position i accepted) = per_pos[i] ÷ steps
    per_position_conditional: list[float]  # P(i accepted | i-1 accepted)
    mean_accepted_length: float | None  # tokens per verification step = 1 + accepted ÷ steps
    mean_draft_length: float | None  # drafted ÷ steps
    alpha: float | None  # solves 1 + α + … + α^k = mean_accepted_length
    predicted_speedup: float | None  # the formula's: 1 + α + … + α^k with that α, i.e. no cost

    def to_dict(self) -> dict:
        return asdict(self)


def spec_stats(c: Counters, depth: int) -> SpecStats:
    steps = int(round(c.steps))
    drafted = int(round(c.drafted))
    accepted = int(round(c.accepted))
    per = [p / steps for p in c.per_pos[:depth]] if steps else []
    cond: list[float] = []
    prev = float(steps)
    for p in c.per_pos[:depth]:
        cond.append(p / prev if prev else 0.0)
        prev = p
    mal = 1.0 + accepted / steps if steps else None
    alpha = alpha_for_tokens_per_step(mal, depth) if mal is not None and depth >= 1 else None
    return SpecStats(
        depth=depth, drafted=drafted, accepted=accepted, steps=steps,
        acceptance_rate=acceptance.rate(drafted, accepted),
        per_position=per, per_position_conditional=cond,
        mean_accepted_length=mal,
        mean_draft_length=drafted / steps if steps else None,
        alpha=alpha,
        predicted_speedup=expected_tokens_per_step(alpha, depth) if alpha is not None else None,
    )


def fit_step_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of r = a + c·k, where r is (time per verification step) ÷ (time per
    baseline decode token) at draft depth k. Returns (a, c): a = verification overhead of a step,
    c = cost of drafting one token, both in baseline decode steps."""
    if not points:
        return 1.0, 0.0
    if len({k for k, _ in points}) == 1:
        k, _ = points[0]
        r = sum(r for _, r in points) / len(points)
        return 1.0, max(0.0, (r - 1.0) / k) if k else 0.0
    n = len(points)
    mk = sum(k for k, _ in points) / n
    mr = sum(r for _, r in points) / n
    sxx = sum((k - mk) ** 2 for k, _ in points)
    sxy = sum((k - mk) * (r - mr) for k, r in points)
    c = sxy / sxx
    return mr - c * mk, c


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    idx = (len(s) - 1) * q
    lo = int(idx)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (idx - lo)
