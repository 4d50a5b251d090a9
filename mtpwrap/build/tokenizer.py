"""A small byte-level BPE tokenizer, made in code, for the models `tiny_gguf` writes.

llama.cpp's `gpt2` tokenizer type needs a token list, the merges that build longer tokens out of
bytes, and a pre-tokenizer name it knows. This module makes all three without any file from a
llama.cpp tree: the 256 byte tokens (GPT-2's byte-to-character mapping), merges learnt from a
short Korean and English text written for this purpose, filler tokens up to the vocabulary size
a model's embedding has, and three control tokens. Any text tokenizes (every byte has a token)
and every token detokenizes, which is all a random-weight or shape-only model needs.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

#: The training text: contract and statute sentences in Korean and English, so that common
#: syllables and words of the benchmark's prompts become single tokens.
CORPUS = """
제1조(목적) 이 계약은 임대인과 임차인 사이의 권리와 의무를 정함을 목적으로 한다.
제2조(정의) 이 법에서 사용하는 용어의 뜻은 다음과 같다. 대한민국은 민주공화국이다.
제3조(계약의 해지) 임차인은 계약 기간이 끝나기 전에 서면으로 계약의 해지를 통지할 수 있다.
제4조(손해배상) 당사자 일방이 계약을 위반한 경우에는 상대방에게 손해를 배상하여야 한다.
제5조(준거법) 이 계약은 대한민국 법률에 따라 해석되며, 분쟁은 서울중앙지방법원의 관할로 한다.
법원은 원고의 청구를 기각한다. 소송비용은 원고가 부담한다. 판결 이유는 다음과 같다.
금융위원회는 금융회사의 건전성을 감독하고 투자자를 보호하기 위하여 필요한 조치를 할 수 있다.
Article 1 (Purpose) The purpose of this Act is to protect the rights of tenants and landlords.
Article 2 (Definitions) In this Act, the following terms have the meanings given below.
The parties agree that this contract is governed by the laws of the Republic of Korea.
The tenant shall pay the rent on the first day of each month, and the landlord shall keep the
premises in good repair. Either party may terminate this agreement by written notice.
The court dismisses the claim of the plaintiff; the costs of the action are borne by the
plaintiff. The reasons for the judgment are as follows. The quick brown fox jumps over the lazy
dog. Hello, how are you today? I am fine, thank you. 0 1 2 3 4 5 6 7 8 9 10 100 2024 2026.
"""

#: llama.cpp's word splitting, close enough for learning merges (letters, digits, the rest).
_WORDS = re.compile(r" ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+")

BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"
CONTROL = (BOS, EOS, "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3

#: ChatML, so llama-server's chat endpoint has a template to render.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Vocabulary:
    """What goes under `tokenizer.ggml.*` in a GGUF file."""

    tokens: list[str]
    token_type: list[int]
    merges: list[str]
    bos: int
    eos: int

    def __len__(self) -> int:
        return len(self.tokens)


@functools.lru_cache(maxsize=1)
def byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte value (index = byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def _encode(word: str) -> tuple[str, ...]:
    table = byte_chars()
    return tuple(table[b] for b in word.encode("utf-8"))


@functools.lru_cache(maxsize=4)
def learn_merges(text: str = CORPUS, limit: int = 600) -> tuple[str, ...]:
    """BPE merges ("a b") learnt from `text`: the most frequent adjacent pair, merged, again,
    until `limit` or until no pair occurs twice."""
    words: Counter[tuple[str, ...]] = Counter(
        _encode(w) for w in _WORDS.findall(text) if w.strip())
    merges: list[str] = []
    while len(merges) < limit:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        merges.append(f"{a} {b}")
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return tuple(merges)


def _filler() -> Iterator[str]:
    """Plain-letter tokens ("ab", "Ġab", "abc", ...), so a vocabulary of any size has only
    tokens that print as text."""
    space = byte_chars()[ord(" ")]
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(2):
        for combo in itertools.product(letters, repeat=n):
            word = "".join(combo)
            yield word
            yield space + word


@functools.lru_cache(maxsize=8)
def vocabulary(size: int | None = None) -> Vocabulary:
    """Byte tokens, learnt merges, filler up to `size` (default: no filler), control tokens.
    Cached: treat the lists as read-only."""
    merges = learn_merges()
    tokens = list(byte_chars())
    seen = set(tokens)
    for merge in merges:
        joined = merge.replace(" ", "")
        if joined not in seen:
            seen.add(joined)
            tokens.append(joined)
    target = max(size or 0, len(tokens) + len(CONTROL))
    filler = _filler()
    while len(tokens) < target - len(CONTROL):
        word = next(filler)
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(CONTROL)
    tokens += CONTROL
    return Vocabulary(tokens, types, list(merges), tokens.index(BOS), tokens.index(EOS))

