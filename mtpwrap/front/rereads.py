"""Why a prompt was read again: a cause for each request to the chat model that read more
than `proxy.reread_threshold_tokens` of its prompt (llama-server's prompt tokens less its cached
ones). It works from llama-server's counts and hashes of the key's earlier prompts, never
their text: each message's text is cut in blocks ending at the first line end past
`BLOCK_CHARS` (an edit early in a message moves no later cut, except in text without line
ends, cut every 4 × `BLOCK_CHARS`), and only each block's 8-byte BLAKE2b digest and place
(message, block) are kept, in memory, the last `ENTRIES` per key (keyless requests under `-`).

Over the prompt's blocks in order: `evicted` when its start sat where it was, under the same
llama-server child, and holds most of what was read again (llama-server had dropped it); else,
of the long blocks past that start seen before, `restarted` when all were seen before the
child's last restart, `moved` when one sits in another place (the client's layout), `changed`
when they sit where they were after something that differs (a date in a system prompt);
`cold` when none was seen.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client import Counter

BLOCK_CHARS = 1024
#: a block: BLOCK_CHARS, then to the next line end (within three times as many more)
_BLOCK = re.compile(rf".{{{BLOCK_CHARS}}}[^\n]{{0,{3 * BLOCK_CHARS}}}\n?|.+", re.S)
#: a shorter block ("Thanks!") proves nothing by sitting somewhere else
LONG_CHARS = 256
#: blocks kept per key (a 13K-token document is about 50)
ENTRIES = 4096
#: each cause, and what to do about it (the status page)
FIXES = {
    "moved": "A document sits in another message than before, so all from there on is read "
             "again: keep it in place (Open WebUI: RAG_SYSTEM_CONTEXT=true).",
    "changed": "The prompt differs before a long part it shares with an earlier one (a date in "
               "the system prompt?): keep its beginning the same.",
    "evicted": "llama-server had dropped this prompt's start: other prompts took its slot and "
               "the RAM cache did not keep it (documents, above).",
    "restarted": "Seen before llama-server's last restart, which emptied its cache.",
    "cold": "Never seen before: a first read.",
}

Place = tuple[int, int]  # (message, block)


class Block(NamedTuple):
    at: Place
    digest: bytes
    chars: int


def blocks(doc: object) -> tuple[Block, ...]:
    """A request body's prompt as blocks: its messages' text (Anthropic's `system` first), or
    its `prompt`."""
    if not isinstance(doc, dict):
        return ()
    msgs = doc.get("messages")
    parts = [doc["system"]] if "system" in doc else []
    parts += msgs if isinstance(msgs, list) else [doc.get("prompt")]
    return tuple(Block((m, i), hashlib.blake2b(b.encode(), digest_size=8).digest(), len(b))
                 for m, part in enumerate(parts)
                 for i, b in enumerate(_BLOCK.findall(_text(part))))


def _text(message: object) -> str:
    """A message's text: its content, or its content's text parts (images, tools aside)."""
    content = message.get("content") if isinstance(message, dict) else message
    parts = [p.get("text") if isinstance(p, dict) else p
             for p in (content if isinstance(content, list) else [content])]
    return "".join(p for p in parts if isinstance(p, str))


def classify(prompt: Sequence[Block], seen: Mapping[bytes, tuple[Place, int]],
             generation: int, tokens: int, cached: int) -> str:
    """Why `tokens - cached` of a prompt of `tokens` were read; `seen`: each digest's last place
    and the llama-server generation that read it (see the module docstring)."""
    kept = 0
    while kept < len(prompt) and seen.get(prompt[kept].digest) == (prompt[kept].at, generation):
        kept += 1
    share = sum(b.chars for b in prompt[:kept]) / (sum(b.chars for b in prompt) or 1)
    if share * tokens - cached >= (tokens - cached) / 2:
        return "evicted"
    before = [(b.at, seen[b.digest]) for b in prompt[kept:]
              if b.chars >= LONG_CHARS and b.digest in seen]
    if not before:
        return "cold"
    if all(gen != generation for _at, (_was, gen) in before):
        return "restarted"
    return "moved" if any(at != was for at, (was, _gen) in before) else "changed"


class Rereads:
    """The blocks of each key's prompts, the re-reads counted by cause, the last ones kept."""

    def __init__(self, threshold: int, counter: Counter) -> None:
        self.threshold, self.counter = threshold, counter
        for cause in FIXES:
            counter.labels(cause)
        self._seen: dict[str, collections.OrderedDict[bytes, tuple[Place, int]]] = {}
        #: the last re-reads over the threshold, for the status page (no text)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)

    def explain(self, key: str, prompt: Sequence[Block], generation: int | None,
                record: Mapping[str, Any]) -> dict[str, Any]:
        """The audit line's `reread_tokens` and `reread_cause` for a request that ended; the
        prompt's blocks are kept for the next ones where llama-server answered it."""
        out: dict[str, Any] = {"reread_tokens": None, "reread_cause": None}
        if not prompt or generation is None or record.get("status") != 200:
            return out
        seen = self._seen.setdefault(key, collections.OrderedDict())
        tokens, cached = record.get("prompt_tokens"), record.get("cached_tokens")
        # llama-server's own counts only: a reservation or an estimate says nothing it read
        if record.get("tokens_from") == "answer" and tokens is not None and cached is not None \
                and tokens - cached > self.threshold:
            cause = classify(prompt, seen, generation, tokens, cached)
            out = {"reread_tokens": tokens - cached, "reread_cause": cause}
            self.counter.labels(cause).inc(tokens - cached)
            self.recent.append({"time": record.get("time"), "key": key, **out,
                                "fix": FIXES[cause]})
        for b in prompt:
            seen[b.digest] = (b.at, generation)
            seen.move_to_end(b.digest)
        while len(seen) > ENTRIES:
            seen.popitem(last=False)
        return out
