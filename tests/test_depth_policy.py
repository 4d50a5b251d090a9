"""Request classes and the per-class speculation policy (front/depth_policy), without a server:
the classifier on the pinned corpora and real code, the policy's choices from observed counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpwrap.bench import corpora
from mtpwrap.decide import acceptance, profiles
from mtpwrap.decide.profile_types import ClassPolicy, SpecAdapt
from mtpwrap.decide.request_class import classify, classify_text, shares
from mtpwrap.errors import ConfigError
from mtpwrap.front import depth_policy
from mtpwrap.front.depth_policy import DepthPolicy
from mtpwrap.front.info import ServeInfo

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def korean_statute() -> str:
    return corpora.load("ko").documents[0].text[:3000]  # the Constitution


@pytest.fixture(scope="module")
def english_licence() -> str:
    corpus = corpora.load("en")
    return next(d.text for d in corpus.documents if d.name.startswith("Apache"))[:3000]


@pytest.mark.integration
def test_korean_statute_is_ko_prose(korean_statute: str) -> None:
    assert "대한민국" in korean_statute
    assert classify_text(korean_statute) == "ko-prose"
    assert shares(korean_statute).hangul > 0.9


def test_english_licence_is_en_prose(english_licence: str) -> None:
    assert classify_text(english_licence) == "en-prose"


def test_python_source_is_code() -> None:
    code = (REPO / "mtpwrap" / "decide" / "acceptance.py").read_text()
    body = code[code.index("def expected_tokens_per_step"):][:1500]
    assert "```" not in body
    assert classify_text(body) == "code"


@pytest.mark.integration
def test_fenced_block_in_korean_question_is_code(korean_statute: str) -> None:
    text = korean_statute[:300] + "\n```python\nprint(1)\n```"
    assert classify_text(text) == "code"


@pytest.mark.integration
def test_mixed_korean_and_english_is_other(korean_statute: str, english_licence: str) -> None:
    mixed = korean_statute[:400] + "\n" + english_licence[:500]
    s = shares(mixed)
    assert 0.4 < s.hangul < 0.6 and 0.4 < s.latin < 0.6
    assert classify_text(mixed) == "other"


def test_japanese_and_chinese() -> None:
    ja = "この契約は日本国の法律に準拠するものとします。当事者は誠実に協議する。"
    zh = "本合同受中华人民共和国法律管辖。双方应当诚实信用地履行合同义务。"
    assert classify_text(ja) == "ja-prose"
    assert classify_text(zh) == "zh-prose"


@pytest.mark.integration
def test_request_hints_win_over_text(korean_statute: str) -> None:
    chat = {"messages": [{"role": "user", "content": korean_statute[:500]}]}
    assert classify(chat) == "ko-prose"
    assert classify({**chat, "response_format": {"type": "json_object"}}) == "structured"
    assert classify({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}) \
        == "structured"
    parts = {"messages": [{"role": "user", "content": [{"type": "text",
                                                         "text": korean_statute[:500]}]}]}
    assert classify(parts) == "ko-prose"
    assert classify({"system": "You answer.", "messages": [], "prompt": None}) == "en-prose"
    assert classify(["not", "an", "object"]) == "other"


# ------------------------------------------------------------------------ policy


def _policy(**kw: object) -> DepthPolicy:
    base: dict = {"supported": True, "server_depth": 8,
                  "adapt": SpecAdapt(overhead=1.0, per_draft=0.1, probe_share=0.25,
                                     half_life_tokens=64.0)}
    base.update(kw)
    return DepthPolicy(**base)  # type: ignore[arg-type]


KO = {"prompt": "대한민국의 주권은 국민에게 있고, 모든 권력은 국민으로부터 나온다."}
EN = {"prompt": "Licensed under the Apache License, Version 2.0; you may not use this file."}


def test_client_fields_win_and_are_never_rewritten() -> None:
    pol = _policy(table={"ko-prose": ClassPolicy(0)})
    doc = {**KO, "speculative.n_max": 5}
    d = pol.decide(doc)
    assert (d.source, d.depth, d.effective_depth) == ("client", None, 5)


def test_profile_table_then_default() -> None:
    pol = _policy(table={"ko-prose": ClassPolicy(3, 0.5)})
    d = pol.decide(KO)
    assert (d.source, d.depth, d.p_min) == ("profile", 3, 0.5)
    assert pol.decide(EN).source == "default"
    assert pol.decide(EN).header() == b"class=en-prose depth=8 source=default"


def test_unsupported_binary_changes_nothing() -> None:
    pol = _policy(supported=False, table={"ko-prose": ClassPolicy(2)})
    d = pol.decide(KO)
    assert (d.source, d.depth) == ("unsupported", None)
    assert pol.snapshot()["status"] == "unsupported"


def test_learned_depth_follows_the_cost_model() -> None:
    pol = _policy()
    for _ in range(10):
        d = pol.decide(KO)
        pol.observe(d, drafted=8 * 4, accepted=8 * 3)  # acceptance 0.75 at the server's depth 8
    alpha = pol.state["ko-prose"].alpha
    assert alpha is not None and 0.8 < alpha < 1.0
    want, _ = depth_policy.best_depth(alpha, 8, pol.adapt)
    d = pol.decide(KO)
    assert (d.source, d.depth) == ("learned", want)
    assert want == max(range(1, 9), key=lambda k: acceptance.modelled_speedup(alpha, k, 1.0, 0.1))


def test_off_below_break_even_and_probing_brings_it_back() -> None:
    pol = _policy(table={"en-prose": ClassPolicy(2)})
    for _ in range(6):  # acceptance 0.05: below break-even for any depth at 0.1 per draft
        d = pol.decide(EN)
        pol.observe(d, drafted=20, accepted=1)
    assert pol.current_depth("en-prose") == 0
    seen = [pol.decide(EN) for _ in range(8)]
    probes = [d for d in seen if d.source == "probe"]
    offs = [d for d in seen if d.source == "learned"]
    assert len(probes) == 2 and all(d.depth and d.depth > 0 for d in probes)  # 1 in 4
    assert offs and all(d.depth == 0 for d in offs)
    probed = 0
    for _ in range(60):  # the text changed: probes now see most drafts accepted
        d = pol.decide(EN)
        if d.source == "probe":
            probed += 1
            pol.observe(d, drafted=2 * 10, accepted=2 * 9)
        if pol.current_depth("en-prose"):
            break
    assert (pol.current_depth("en-prose") or 0) >= 1 and probed >= 1
    assert pol.decide(EN).source == "learned"


def test_adapt_off_keeps_the_static_table() -> None:
    pol = _policy(table={"ko-prose": ClassPolicy(2)},
                  adapt=SpecAdapt(enabled=False, probe_share=0.5))
    for _ in range(5):
        d = pol.decide(KO)
        assert (d.source, d.depth) == ("profile", 2)
        pol.observe(d, drafted=20, accepted=0)
    assert pol.state["ko-prose"].alpha == 0.0  # still estimated and shown, never acted on


def test_inject_keeps_every_other_byte() -> None:
    body = b' {"prompt": "x",\n "n_predict": 4}'
    out = depth_policy.inject(body, 2, None)
    assert out == b' {"speculative.n_max":2,"prompt": "x",\n "n_predict": 4}'
    assert json.loads(depth_policy.inject(b"{ }", 0, 0.5)) == {"speculative.n_max": 0,
                                                              "speculative.p_min": 0.5}


def test_draft_counts_from_a_stream_s_last_timings() -> None:
    from mtpwrap.front.usage import Tally

    tally = Tally(route="/v1/chat/completions", stream=True)
    for piece in (b'data: {"choices":[],"timings":{"draft_n":7,"draft_n_accepted":3}}\n\nda',
                  b'ta: {"choices":[],"timings":{"predicted_n":9,"draft_n":12,',
                  b'"draft_n_accepted":5}}\n\ndata: [DONE]\n\n'):
        tally.feed(piece)
    said = tally.said()
    assert (said["drafted_tokens"], said["accepted_tokens"]) == (12, 5)
    plain = Tally(route="/completion")
    plain.feed(b'{"content":"no timings"}')
    assert plain.said()["drafted_tokens"] is None


def _profile(spec: dict) -> dict:
    return {"name": "t", "description": "d", "model": "demo", "context": 1024,
            "hardware": {"requires_gpu": False}, "spec": spec}


def test_profile_spec_policy_and_adapt_are_validated() -> None:
    p = profiles.validate(_profile({"kind": "ngram", "policy": {"ko-prose": 3, "code": "off",
                                                                "en-prose": {"depth": 1,
                                                                             "p_min": 0.7}},
                                    "adapt": {"probe_share": 0.1}}), where="t.yaml")
    assert dict(p.spec.policy) == {"code": ClassPolicy(0), "en-prose": ClassPolicy(1, 0.7),
                                   "ko-prose": ClassPolicy(3)}
    assert p.spec.adapt.probe_share == 0.1 and p.spec.adapt.enabled
    assert not profiles.validate(_profile({"kind": "ngram", "adapt": False}),
                                 where="t.yaml").spec.adapt.enabled
    with pytest.raises(ConfigError, match=r"t.yaml: spec.policy.fr-prose: unknown key"):
        profiles.validate(_profile({"kind": "ngram", "policy": {"fr-prose": 2}}), where="t.yaml")
    with pytest.raises(ConfigError, match=r"spec.policy.code: expected off, a depth"):
        profiles.validate(_profile({"kind": "ngram", "policy": {"code": "deep"}}), where="t.yaml")
    with pytest.raises(ConfigError, match=r"spec.adapt.probe_share: expected a number 0..1"):
        profiles.validate(_profile({"kind": "ngram", "adapt": {"probe_share": 2}}),
                          where="t.yaml")


def test_serve_info_carries_the_profile_table_to_the_front() -> None:
    prof = profiles.validate(_profile({"kind": "ngram", "depth": 6,
                                       "policy": {"code": 4, "en-prose": "off"},
                                       "adapt": {"enabled": False, "per_draft": 0.3}}),
                             where="t.yaml")
    pol = depth_policy.for_launch(ServeInfo(speculation=prof.spec, per_request_depth="honoured"))
    assert pol is not None and pol.supported and pol.server_depth == 6
    assert pol.table == {"code": ClassPolicy(4), "en-prose": ClassPolicy(0)}
    assert pol.adapt == SpecAdapt(enabled=False, per_draft=0.3)
    assert pol.snapshot()["status"] == "active" and "reason" not in pol.snapshot()
    none = profiles.validate(_profile({"kind": "none"}), where="t.yaml")
    assert depth_policy.for_launch(ServeInfo(speculation=none.spec,
                                             per_request_depth="honoured")) is None
    assert depth_policy.for_launch(ServeInfo()) is None
    unknown = depth_policy.for_launch(ServeInfo(speculation=prof.spec))
    assert unknown is not None and not unknown.supported
    assert unknown.decide({"prompt": "x"}).header().endswith(b"source=unsupported why=not-probed")
    assert "not known whether" in unknown.snapshot()["reason"]


def test_a_binary_that_ignores_the_depth_says_unsupported_and_why() -> None:
    """The fork's probe says `ignored`: no body is changed, and /healthz's table says why."""
    prof = profiles.validate(_profile({"kind": "mtp", "depth": 3, "policy": {"en-prose": 2}}),
                             where="t.yaml")
    info = ServeInfo(speculation=prof.spec, per_request_depth="ignored",
                     per_request_depth_detail="draft_n 41 with n_max 0")
    pol = depth_policy.for_launch(info)
    assert pol is not None and not pol.supported
    d = pol.decide(EN)
    assert (d.source, d.depth, d.effective_depth) == ("unsupported", None, 3)
    assert d.header() == b"class=en-prose depth=3 source=unsupported why=probe-ignored"
    snap = pol.snapshot()
    assert snap["status"] == "unsupported"
    assert "ignores a request's own speculative.n_max (draft_n 41 with n_max 0)" \
        in snap["reason"] and "depth 3" in snap["reason"]
