"""The one Prometheus text reader: what it gives for llama-server's kinds of sample, and that a
page that is not the exposition format is an error at the call, never halfway through."""

from __future__ import annotations

import pytest

from mtpwrap import promtext

COUNTER = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
"""
GAUGE = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
"""
PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
LABELLED = """\
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5
"""
UNTYPED = "llamacpp:n_busy_slots_per_decode 1.5\n"


@pytest.mark.parametrize(("text", "expected"), [
    # a counter's family drops `_total`, its sample keeps it
    (COUNTER, [("llamacpp:prompt_tokens", "counter",
                [("llamacpp:prompt_tokens_total", {}, 120.0)])]),
    (GAUGE, [("llamacpp:requests_processing", "gauge",
              [("llamacpp:requests_processing", {}, 2.0)])]),
    (LABELLED, [("llamacpp:spec_decode_num_accepted_tokens_per_pos", "counter",
                 [(PER_POS, {"position": "0"}, 9.0), (PER_POS, {"position": "1"}, 5.0)])]),
    (UNTYPED, [("llamacpp:n_busy_slots_per_decode", "unknown",
                [("llamacpp:n_busy_slots_per_decode", {}, 1.5)])]),
    ("", []),
])
def test_families(text: str, expected: list[tuple[str, str, list[tuple[str, dict[str, str],
                                                                   float]]]]) -> None:
    got = [(f.name, f.type, [(s.name, s.labels, s.value) for s in f.samples])
           for f in promtext.families(text)]
    assert got == expected


def test_samples_are_every_family_in_page_order() -> None:
    text = COUNTER + GAUGE + LABELLED
    assert [(s.name, s.labels.get("position")) for s in promtext.samples(text)] == [
        ("llamacpp:prompt_tokens_total", None),
        ("llamacpp:requests_processing", None),
        (PER_POS, "0"),
        (PER_POS, "1"),
    ]


@pytest.mark.parametrize("text", [
    "<html><body>502 Bad Gateway</body></html>",
    "not metrics at all",
    'llamacpp:x{a="1"} many',
    # good lines first: the error still comes at the call, with nothing taken
    COUNTER + "garbage here\n",
])
@pytest.mark.parametrize("read", [promtext.families, promtext.samples])
def test_garbage_is_a_value_error_at_the_call(text: str, read: object) -> None:
    assert callable(read)
    with pytest.raises(ValueError):
        read(text)
