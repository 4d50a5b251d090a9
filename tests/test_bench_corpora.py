"""Corpora: the pinned konlpy wheel (read as a zip, never imported), Debian licence texts,
and prompts cut to an exact token count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mtpwrap import hashing
from mtpwrap.bench import corpora
from mtpwrap.errors import ConfigError, IntegrityError


@pytest.mark.integration
def test_korean_corpus_is_pinned_and_korean() -> None:
    c = corpora.korean_corpus()
    assert c.archive_sha256 == corpora.KONLPY_SHA256
    names = [d.name for d in c.documents]
    assert names[0] == "kolaw/constitution.txt" and len(names) == 11
    assert c.documents[0].text.startswith("대한민국헌법")
    hangul = sum(0xAC00 <= ord(ch) <= 0xD7A3 for ch in c.documents[0].text)
    assert hangul > 10_000
    assert "konlpy" not in sys.modules  # read from the zip, never imported (it needs Java)


def test_wrong_wheel_is_refused(tmp_path: Path) -> None:
    (tmp_path / corpora.KONLPY_WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(IntegrityError, match="expected 0b7928"):
        corpora.korean_corpus(cache=tmp_path)


def test_english_corpus_dedupes_symlinks(tmp_path: Path) -> None:
    (tmp_path / "GPL-3").write_text("GNU GENERAL PUBLIC LICENSE\n")
    (tmp_path / "GPL").symlink_to(tmp_path / "GPL-3")
    (tmp_path / "MIT").write_text("Permission is hereby granted\n")
    c = corpora.english_corpus(tmp_path)
    assert sorted(d.name for d in c.documents) == ["GPL", "MIT"]
    assert c.provenance()["documents"]["MIT"] == corpora.sha256_bytes(
        b"Permission is hereby granted\n")


@pytest.mark.skipif(not corpora.ENGLISH_DIR.is_dir(), reason="no /usr/share/common-licenses")
def test_english_corpus_from_debian() -> None:
    c = corpora.english_corpus()
    assert any(d.name == "Apache-2.0" for d in c.documents)
    assert sum(len(d.text) for d in c.documents) > 100_000


def test_missing_english_folder_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        corpora.english_corpus(tmp_path / "nope")


def _char_tokenizer(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_prompt_is_cut_to_exact_length_and_walks_corpus_again(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).write_text(name * 10)
    c = corpora.english_corpus(tmp_path)
    p = corpora.build_prompt(c, 15, _char_tokenizer)
    assert p.n_tokens == 15 and "".join(map(chr, p.tokens)) == "a" * 10 + "\n\n" + "bbb"
    long = corpora.build_prompt(c, 50, _char_tokenizer)
    assert long.n_tokens == 50 and long.passes == 3 and long.documents[:3] == ["a", "b", "a"]
    with pytest.raises(ConfigError):
        corpora.build_prompt(c, 0, _char_tokenizer)


@pytest.mark.integration
def test_wheel_is_fetched_by_pip_into_an_empty_cache(tmp_path: Path) -> None:
    wheel = corpora.konlpy_wheel(tmp_path)
    assert wheel == tmp_path / corpora.KONLPY_WHEEL
    assert hashing.sha256_file(wheel) == corpora.KONLPY_SHA256
