"""Token classes for locating speculation rejections.

A token's class is decided on the text around it, not on the token alone: the "조" in "제17조"
is part of an article number, a "(" inside `f(x);` is code. Classes are assigned per character
over the whole generated text, then each token takes the class most of its characters have.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

HANGUL = "hangul"
HANJA = "hanja_cjk"
ARTICLE = "digits_article"
LATIN = "latin"
PUNCT = "punct"
CODE = "code"
SPACE = "space"
OTHER = "other"

CLASSES = (HANGUL, HANJA, ARTICLE, LATIN, PUNCT, CODE, SPACE, OTHER)

DESCRIPTIONS = {
    HANGUL: "Hangul syllables and jamo",
    HANJA: "Han characters (Hanja) and other CJK ideographs, kana, CJK punctuation",
    ARTICLE: "digits, and article references such as 제17조제2항제3호 or Section 4(a)",
    LATIN: "letters of Latin script (words)",
    PUNCT: "punctuation and symbols outside code",
    CODE: "code-like spans: backticks, identifiers with _ or ::, operators such as == -> {}",
    SPACE: "whitespace only",
    OTHER: "anything else (other scripts, emoji)",
}

# 제17조, 제17조의2, 제17조제2항제3호, 제2항, 제3호; "Section 4(a)", "Article 12", "§ 3".
_ARTICLE_RE = re.compile(
    r"제\s?\d+\s?(?:조(?:의\s?\d+)?|항|호|장|절|관|편)(?:\s?제\s?\d+\s?(?:항|호|목))*"
    r"|(?:Section|Article|Sec\.|Art\.|§)\s?\d+(?:\.\d+)*(?:\([a-z0-9]+\))*"
    r"|\d+(?:[.,]\d+)*",
    re.IGNORECASE,
)
_CODE_RE = re.compile(
    r"`[^`\n]{1,80}`"
    r"|\b[A-Za-z]+_[A-Za-z0-9_]+\b"
    r"|\b\w+::\w+"
    r"|\b[a-z]+[A-Z]\w*\("
    r"|\b\w+\s*(?:==|!=|<=|>=|->|=>|&&|\|\|)\s*\w+"
    r"|==|!=|<=|>=|->|=>|&&|\|\||::|\{|\}|;\s*$",
    re.MULTILINE,
)


def _char_class(ch: str) -> str:
    cp = ord(ch)
    if ch.isspace():
        return SPACE
    if 0xAC00 <= cp <= 0xD7A3 or 0x1100 <= cp <= 0x11FF or 0x3130 <= cp <= 0x318F:
        return HANGUL
    if (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF
            or 0x20000 <= cp <= 0x2FFFF or 0x3000 <= cp <= 0x30FF):
        return HANJA
    if ch.isdigit():
        return ARTICLE
    cat = unicodedata.category(ch)
    if cat.startswith("L"):
        name = unicodedata.name(ch, "")
        return LATIN if "LATIN" in name else OTHER
    if cat[0] in "PS":
        return PUNCT
    return OTHER


def char_classes(text: str) -> list[str]:
    """The class of every character of `text`, spans (article numbers, code) taking priority."""
    classes = [_char_class(c) for c in text]
    for m in _CODE_RE.finditer(text):
        for i in range(m.start(), m.end()):
            if classes[i] != SPACE:
                classes[i] = CODE
    for m in _ARTICLE_RE.finditer(text):
        for i in range(m.start(), m.end()):
            if classes[i] != SPACE:
                classes[i] = ARTICLE
    return classes


def classify_pieces(pieces: list[str]) -> list[str]:
    """One class per piece (token text, in order). Empty pieces — a multi-byte character the
    server holds back until it is complete — take the class of the next non-empty piece."""
    text = "".join(pieces)
    cc = char_classes(text)
    out: list[str] = []
    pos = 0
    for piece in pieces:
        span = cc[pos:pos + len(piece)]
        pos += len(piece)
        if not span:
            out.append("")
            continue
        counts = Counter(span)
        non_space = [(n, c) for c, n in counts.items() if c != SPACE]
        out.append(max(non_space)[1] if non_space else SPACE)
    nxt = OTHER
    for i in range(len(out) - 1, -1, -1):
        if out[i] == "":
            out[i] = nxt
        else:
            nxt = out[i]
    return out


def classify(text: str) -> str:
    return classify_pieces([text])[0]
