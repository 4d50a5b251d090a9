"""The acceptance model of speculative decoding: per-position acceptance α, tokens per
verification step, and the speedup a step-cost model predicts (pure arithmetic).

With independent positions and drafting stopped at the first miss, a draft of depth k gives
1 + α + α² + … + α^k tokens per verification step; a step at depth k costs a + c·k plain
decode steps (what `mtpwrap tune` fits).
"""

from __future__ import annotations


def rate(drafted: float, accepted: float | None) -> float | None:
    """llama.cpp's acceptance: accepted ÷ drafted tokens (None before anything was drafted).
    Not α: a run at depth 3 with α = 0.73 has a rate of (α + α² + α³)/3 = 0.55."""
    if not drafted or accepted is None:
        return None
    return accepted / drafted


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """1 + α + α² + … + α^k."""
    return sum(alpha**i for i in range(k + 1))


def alpha_for_tokens_per_step(tokens_per_step: float, k: int, tol: float = 1e-12) -> float:
    """The α in [0, 1] with 1 + α + … + α^k = tokens_per_step (bisection; the sum is monotone).

    Clipped: ≤ 1 token per step gives 0, ≥ k + 1 gives 1.
    """
    if k < 1:
        raise ValueError("draft depth k must be >= 1")
    if tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def modelled_speedup(alpha: float, k: int, a: float, c: float) -> float:
    """Speedup the cost model predicts: tokens per step ÷ (a + c·k) baseline steps."""
    denom = a + c * k
    return expected_tokens_per_step(alpha, k) / denom if denom > 0 else 0.0
