"""Acceptance statistics: the formula, its inverse, counters from Prometheus text, bursts."""

from __future__ import annotations

import pytest

from mtpwrap.bench import stats
from mtpwrap.bench.runner import StreamResult, bursts, rejection_points
from mtpwrap.decide import acceptance

# The exposition format llama-server writes (tools/server/server-task.cpp), trimmed.
METRICS_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 512
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 64
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 0.5
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 17
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 48
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: accepted
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 30
# HELP llamacpp:spec_decode_num_drafts_total Speculative: verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 16
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total per position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 14
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 10
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 6
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
"""


def test_recipe_figures_from_facts() -> None:
    # docs/facts.md §4: k = 3, α = 0.73 gives 2.65 tokens per step and accepted ÷ drafted 0.55.
    assert acceptance.expected_tokens_per_step(0.73, 3) == pytest.approx(2.65, abs=5e-3)
    assert acceptance.alpha_for_tokens_per_step(2.651917, 3) == pytest.approx(0.73, abs=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_alpha_inverts_formula(alpha: float, k: int) -> None:
    t = acceptance.expected_tokens_per_step(alpha, k)
    assert acceptance.alpha_for_tokens_per_step(t, k) == pytest.approx(alpha, abs=1e-9)


def test_alpha_clips_out_of_range() -> None:
    assert acceptance.alpha_for_tokens_per_step(0.5, 3) == 0.0
    assert acceptance.alpha_for_tokens_per_step(7.0, 3) == 1.0
    with pytest.raises(ValueError):
        acceptance.alpha_for_tokens_per_step(2.0, 0)


def test_counters_from_prometheus_text_and_spec_stats() -> None:
    c = stats.Counters.from_metrics(stats.parse_metrics(METRICS_TEXT))
    assert (c.drafted, c.accepted, c.steps) == (48, 30, 16)
    assert c.per_pos == [14, 10, 6]
    assert c.predicted_tokens == 64 and c.prompt_tokens == 512
    s = stats.spec_stats(c, 3)
    assert s.acceptance_rate == pytest.approx(30 / 48)
    assert s.mean_accepted_length == pytest.approx(1 + 30 / 16)
    assert s.per_position == pytest.approx([14 / 16, 10 / 16, 6 / 16])
    assert s.per_position_conditional == pytest.approx([14 / 16, 10 / 14, 6 / 10])
    # Per-position counts add up to the accepted total: each accepted token has one position.
    assert sum(c.per_pos) == c.accepted
    assert acceptance.expected_tokens_per_step(s.alpha, 3) == pytest.approx(s.mean_accepted_length)


def test_counter_difference() -> None:
    before = stats.Counters(drafted=10, accepted=5, steps=4, per_pos=[3, 2])
    after = stats.Counters(drafted=40, accepted=25, steps=14, per_pos=[10, 8, 7])
    d = after - before
    assert (d.drafted, d.accepted, d.steps, d.per_pos) == (30, 20, 10, [7, 6, 7])


def test_fit_step_cost_recovers_line() -> None:
    pts = [(k, 1.2 + 0.35 * k) for k in (1, 2, 3, 5)]
    a, c = stats.fit_step_cost(pts)
    assert a == pytest.approx(1.2) and c == pytest.approx(0.35)
    assert acceptance.modelled_speedup(1.0, 3, a, c) == pytest.approx(4 / (1.2 + 1.05))


def _result(arrivals: list[float], pieces: list[str]) -> StreamResult:
    return StreamResult(pieces, list(range(len(pieces))), arrivals, arrivals[0],
                        arrivals[-1], {})


def test_the_step_gap_is_a_fifth_of_the_servers_mean_step() -> None:
    # 40 tokens, 30 of them accepted drafts: 10 steps of 0.3 s. The prompt's 64 decode calls
    # (a long prompt in small batches) are not steps.
    c = stats.Counters(predicted_tokens=40, accepted=30, predicted_seconds=3.0, n_decode=74)
    assert c.step_gap() == pytest.approx(0.06)
    assert stats.Counters(predicted_tokens=30, predicted_seconds=3.0).step_gap() == \
        pytest.approx(0.02)  # no speculation: a token a step
    assert stats.Counters().step_gap() == stats.FALLBACK_GAP_S  # no counters: the fallback


def test_bursts_group_by_gap() -> None:
    t = [0.0, 0.010, 0.0101, 0.0102, 0.0103, 0.020, 0.0201, 0.030]
    assert bursts(t, 0.001) == [1, 4, 2, 1]
    assert bursts([], 0.001) == []
    # A held-back token arrives with the next step: the surplus over depth + 1 goes back.
    assert bursts([0.0, 0.0001, 0.010, 0.0101, 0.0102, 0.0103, 0.0104], 0.001, cap=4) == [3, 4]
    # ... but never past the previous run's own room.
    assert bursts([0.0, 0.010, 0.0101, 0.0102], 0.001, cap=1) == [1, 3]


def test_rejection_points_by_class() -> None:
    # first token (prefill), then a full step of 4 at depth 3, then a step of 2 ending on a
    # Latin word (rejection at "law"), then a step of 1 ending on a digit (rejection at "17").
    # A final burst follows; it is not counted (the token limit may have cut it).
    pieces = ["제", "1", "조", "는", " 법", " the", "law", "17", "."]
    t = [0.0, 0.010, 0.0101, 0.0102, 0.0103, 0.020, 0.0201, 0.030, 0.040]
    per = rejection_points(_result(t, pieces), depth=3, gap_s=0.001)
    assert per["latin"] == {"drafted_positions": 2, "rejections": 1}
    assert per["digits_article"]["rejections"] == 1
    # "1", "조" accepted drafts (article number), "는" accepted, " 법" bonus → not counted
    assert per["hangul"] == {"drafted_positions": 1, "rejections": 0}
    assert sum(v["rejections"] for v in per.values()) == 2


def test_percentile() -> None:
    assert stats.percentile([], 0.5) is None
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert stats.percentile([5.0], 0.99) == 5.0
