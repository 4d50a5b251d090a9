"""Token classes: decided on the text around a token, one class per streamed piece."""

from __future__ import annotations

import pytest

from mtpwrap.bench import tokenclass as tc


@pytest.mark.parametrize(("text", "cls"), [
    ("대한민국", tc.HANGUL),
    ("法律", tc.HANJA),
    ("大韓民國憲法", tc.HANJA),
    ("제17조제2항제3호", tc.ARTICLE),
    ("2010", tc.ARTICLE),
    ("Section 4(a)", tc.ARTICLE),
    ("license", tc.LATIN),
    ("Licensor", tc.LATIN),
    ("·", tc.PUNCT),
    (".", tc.PUNCT),
    ("`x_y`", tc.CODE),
    ("foo_bar", tc.CODE),
    ("a == b", tc.CODE),
    ("  \n", tc.SPACE),
])
def test_classify(text: str, cls: str) -> None:
    assert tc.classify(text) == cls


def test_article_number_context_wins_over_script() -> None:
    # "조" alone is Hangul; inside 제17조 it is part of an article number.
    pieces = ["헌법 ", "제", "17", "조", "에 ", "따라"]
    assert tc.classify_pieces(pieces) == [tc.HANGUL, tc.ARTICLE, tc.ARTICLE, tc.ARTICLE,
                                          tc.HANGUL, tc.HANGUL]
    assert tc.classify("조") == tc.HANGUL


def test_held_back_pieces_take_next_class() -> None:
    # llama-server sends "" for a token that ends inside a multi-byte character.
    assert tc.classify_pieces(["", "한", " law"]) == [tc.HANGUL, tc.HANGUL, tc.LATIN]


def test_every_class_is_described() -> None:
    assert set(tc.DESCRIPTIONS) == set(tc.CLASSES)
